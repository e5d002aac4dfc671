"""The wheel works outside the source tree: built from this tree, installed with its declared
dependencies alone into a fresh virtualenv (once at their newest, once at exactly the lowest
versions pyproject.toml declares), and run from an empty directory.

It migrates a database of its own, enqueues a request, runs a standalone worker until the
request has succeeded, and imports every public module of the core install (the optional
integrations need their extras). Slow (a pip install of the dependencies).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, project_copy

pytestmark = pytest.mark.slow

#: Modules that need an extra (fastapi, django, mcp, flower, matplotlib, the embedded wheels),
#: the migrations, which Alembic runs, and the pytest plugin, which only pytest loads.
NEEDS_AN_EXTRA = (
    "onceflow.integrations.", "onceflow.embedded", "onceflow.demo", "onceflow.flower_conf",
    "onceflow.migrations",  # Alembic runs them (env.py is a script of its own)
    "onceflow.testing.pytest_plugin",  # loaded by pytest (its pytest11 entry point) only
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
    row = queue.wait(req.request_id, timeout=60)  # woken by its notify
print(json.dumps({"status": row.status.value, "result": row.result,
                  "version": onceflow.__version__, "file": onceflow.__file__,
                  "imported": len(imported)}))
"""


def _venv(tmp_path: Path, *install: str) -> Path:
    """A fresh virtualenv with ``pip install <install…>``; its python."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *install],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return python


def _run_script(python: Path, tmp_path: Path, database: str) -> dict[str, Any]:
    """SCRIPT in an empty directory (no source tree on its path); what it printed. Nothing
    may go wrong on the way, not even in a background thread (a traceback on stderr)."""
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCEFLOW_", "PYTHON"))}
    run = subprocess.run(
        [python, "-c", SCRIPT, database, json.dumps(NEEDS_AN_EXTRA)],
        cwd=empty, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["status"] == "succeeded" and out["result"] == {"twice": 4}, out
    assert out["imported"] > 50, out
    return out


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
    python = _venv(tmp_path, f"{wheel}[binary]")
    out = _run_script(python, tmp_path, empty_database)
    assert str(tmp_path / "venv") in out["file"]  # the installed wheel, not this tree
    version = subprocess.run(
        [python, "-m", "pip", "show", "onceflow"], capture_output=True, text=True, check=True
    ).stdout
    assert f"Version: {out['version']}" in version
    metadata = next(n for n in names if n.endswith("METADATA"))
    assert "License-Expression: MIT" in zipfile.ZipFile(wheel).read(metadata).decode()


def lowest_versions() -> list[str]:
    """``name==lowest`` for every dependency (and the ``binary`` extra's) with a ``>=`` floor."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = []
    for dep in [*project["dependencies"], *project["optional-dependencies"]["binary"]]:
        found = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?>=([0-9][^,; ]*)", dep)
        if found:
            pins.append(f"{found.group(1)}=={found.group(2)}")
    return pins


@pytest.mark.timeout(900)
def test_the_lowest_declared_versions_install_and_run(tmp_path: Path, empty_database: str) -> None:
    # Every floor in pyproject.toml must be true: installed at exactly those versions, the
    # package resolves, imports and runs a request to its end, woken by its notify.
    constraints = tmp_path / "lowest.txt"
    constraints.write_text("\n".join(lowest_versions()) + "\n")
    assert "click==8.1.2" in constraints.read_text()
    src = project_copy(tmp_path / "src")
    python = _venv(tmp_path, "-c", str(constraints), f"{src}[binary]")
    _run_script(python, tmp_path, empty_database)
