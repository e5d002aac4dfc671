"""Real processes for acceptance tests: the package's process helpers, run from the repo root."""

from __future__ import annotations

import subprocess
from pathlib import Path

from onceflow.demo import procs
from onceflow.demo.procs import Proc, wait_for

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.stages:flow"
_ENV = {"PYTHONPATH": str(ROOT)}

__all__ = ["APP", "ROOT", "Proc", "pool_children", "start_beat", "start_worker", "wait_for"]


def start_worker(tmp: Path, *classes: str, concurrency: int = 1, name: str = "w") -> Proc:
    """A real `onceflow worker` of the test stages for ``classes``, once it is ready."""
    return procs.start_worker(
        tmp, APP, *classes, concurrency=concurrency, name=name, env=_ENV, cwd=ROOT
    )


def start_beat(tmp: Path) -> Proc:
    """A real `onceflow beat` for the test stages."""
    return procs.start_beat(tmp, APP, env=_ENV, cwd=ROOT)


def pool_children(proc: Proc) -> list[int]:
    """Pids of a worker's pool processes."""
    out = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]
