"""Real processes for acceptance tests: workers, beat, Flower — started, watched, killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.stages:flow"
T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


class Proc:
    """A onceflow CLI subprocess in its own process group, logging to a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        wait_for(lambda: text in self.log(), timeout=timeout, what=f"{text!r} in {self.log_path}")

    def signal_group(self, sig: int) -> None:
        os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                self.signal_group(signal.SIGCONT)
                self.signal_group(signal.SIGTERM)
                self.popen.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            self.signal_group(signal.SIGKILL)  # any pool child left behind
        self.popen.wait(timeout=15)
        self._log.close()


def start_worker(tmp: Path, *classes: str, concurrency: int = 1, name: str = "w") -> Proc:
    """A real `onceflow worker` (Celery prefork) for ``classes``; returns once it is ready."""
    args = [
        "worker",
        "--app",
        APP,
        "--concurrency",
        str(concurrency),
        "-n",
        f"{name}-{os.getpid()}@%h",
    ]
    for wc in classes:
        args += ["--worker-class", wc]
    proc = Proc(args, tmp / f"worker-{name}.log")
    proc.wait_log(" ready.")
    return proc


def start_beat(tmp: Path) -> Proc:
    """A real `onceflow beat` sending the sweeper task every ONCEFLOW_SWEEP_INTERVAL_SECONDS."""
    proc = Proc(["beat", "--app", APP], tmp / "beat.log")
    proc.wait_log("beat: Starting")
    return proc


def pool_children(proc: Proc) -> list[int]:
    """Pids of a worker's pool processes."""
    out = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]
