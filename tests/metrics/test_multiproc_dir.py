"""A missing or unusable PROMETHEUS_MULTIPROC_DIR never stops onceflow's processes: imports
and --help work, a worker works (without its metrics port), the exporter refuses in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine

from tests.acceptance.procs import ROOT, Proc, free_port, wait_for


def _bad_dirs(tmp_path: Path) -> dict[str, Path]:
    afile = tmp_path / "a-file"
    afile.write_text("")
    return {"missing": tmp_path / "missing", "under-a-file": afile / "sub"}


def _run(args: list[str], prom: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("kind", ["missing", "under-a-file"])
def test_imports_and_help_work_without_the_directory(tmp_path: Path, kind: str) -> None:
    prom = _bad_dirs(tmp_path)[kind]
    code = (
        "import onceflow.queue, onceflow.locks, onceflow.tasks.flow, onceflow.integrations.fastapi"
        "\nfrom onceflow.metrics import record\nrecord.lock_outcome('preflight_hits')"
        "\nrecord.lock_wait(0.1)\nprint('imported')"
    )
    done = _run(["-c", code], prom)
    assert done.returncode == 0, done.stderr
    assert "imported" in done.stdout
    done = _run(["-m", "onceflow.cli", "--help"], prom)
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout


def test_exporter_refuses_a_missing_directory_in_one_line(tmp_path: Path) -> None:
    prom = tmp_path / "missing"
    done = _run(["-m", "onceflow.cli", "metrics", "--port", str(free_port())], prom)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"onceflow: PROMETHEUS_MULTIPROC_DIR={prom} is not a directory (create it, empty, at start)"
    ]


def test_worker_works_without_its_metrics_port(tmp_path: Path, clean_db: Engine) -> None:
    from onceflow.queue import Queue

    queue = Queue(clean_db)
    rid = queue.enqueue("s", "w", "ok", worker_class="m-nodir").request_id
    port = free_port()
    args = ["work", "tests.metrics.stages:standalone", "-w", "m-nodir", "--metrics-port", str(port)]
    env = {"PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing")}
    proc = Proc(args, tmp_path / "work.log", env, ROOT)
    try:
        wait_for(
            lambda: queue.get(rid).status == "succeeded",
            timeout=30,
            what="the worker to run the request",
        )
    finally:
        proc.stop()
    assert f"not serving metrics on port {port}: PROMETHEUS_MULTIPROC_DIR=" in proc.log()
