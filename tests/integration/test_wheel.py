"""The wheel works outside the source tree: built from this tree, installed with its declared
dependencies alone into a fresh virtualenv, and run from an empty directory.

It migrates a database of its own, enqueues a request, runs a standalone worker until the
request has succeeded, and imports every public module of the core install (the optional
integrations need their extras). Slow (a pip install of the dependencies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import project_copy

pytestmark = pytest.mark.slow

#: Modules that need an extra (fastapi, django, mcp, flower, matplotlib, the embedded wheels),
#: and the migrations, which Alembic runs.
NEEDS_AN_EXTRA = (
    "onceflow.integrations.", "onceflow.embedded", "onceflow.demo", "onceflow.flower_conf",
    "onceflow.migrations",  # Alembic runs them (env.py is a script of its own)
)  # fmt: skip

SCRIPT = r"""
import importlib, json, pkgutil, sys, threading
import onceflow
from onceflow.migrate import migrate
from onceflow.models import NewRequest
from onceflow.queue import Queue
from onceflow.tasks import Flow
from onceflow.worker import Worker

url, skip = sys.argv[1], tuple(json.loads(sys.argv[2]))
imported = []
for mod in pkgutil.walk_packages(onceflow.__path__, "onceflow."):
    name = mod.name
    if name.startswith(skip) or name.endswith("__main__"):
        continue
    importlib.import_module(name)
    imported.append(name)
migrate(url)
queue = Queue(url)
[req] = queue.enqueue_many([NewRequest("ws", "job", "s", worker_class="w", input={"x": 2})])
done = threading.Event()
def body(ctx):
    done.set()
    return {"twice": ctx.request.input["x"] * 2}
with Worker(queue, "w", body, concurrency=1):
    assert done.wait(60), "the worker never ran the request"
    for _ in range(600):
        row = queue.get(req.request_id)
        if row.status.value == "succeeded":
            break
        threading.Event().wait(0.1)
print(json.dumps({"status": row.status.value, "result": row.result,
                  "version": onceflow.__version__, "file": onceflow.__file__,
                  "imported": len(imported)}))
"""


@pytest.mark.timeout(900)
def test_the_wheel_runs_a_request_from_outside_the_tree(
    tmp_path: Path, empty_database: str
) -> None:
    src = project_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    [wheel] = dist.glob("onceflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for part in ("onceflow/py.typed", "onceflow/locks/", "onceflow/migrations/versions/",
                 "onceflow/sdk/js/index.js", "onceflow/integrations/fastapi/dashboard_static/",
                 "onceflow/flower_conf.py", "LICENSE"):  # fmt: skip
        assert any(part in n for n in names), f"the wheel lacks {part}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"{wheel}[binary]"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-4000:]
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCEFLOW_", "PYTHON"))}
    run = subprocess.run(
        [python, "-c", SCRIPT, empty_database, json.dumps(NEEDS_AN_EXTRA)],
        cwd=empty, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["status"] == "succeeded" and out["result"] == {"twice": 4}, out
    assert str(venv) in out["file"]  # the installed wheel, not this tree
    assert out["imported"] > 50, out
    version = subprocess.run(
        [python, "-m", "pip", "show", "onceflow"], capture_output=True, text=True, check=True
    ).stdout
    assert f"Version: {out['version']}" in version
    assert (
        "License-Expression: MIT"
        in zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    )
