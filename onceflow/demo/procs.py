"""Child processes of the demo (and the acceptance tests): workers, beat, Flower.

Each runs the ``onceflow`` CLI in its own process group, logging to a file, so it
can be watched (``wait_log``), paused, killed with ``kill -9`` as a whole, and
always stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll ``condition`` until it returns something truthy; raise after ``timeout`` seconds."""
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

    def __init__(
        self, args: list[str], log: Path, env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:  # fmt: skip
        self.log_path = log
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", *args],
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        """The main process's pid (also its process group id)."""
        return self.popen.pid

    def log(self) -> str:
        """Everything it logged so far."""
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        """Wait until ``text`` appears in its log (or it exits: then raise at once)."""

        def seen() -> bool:
            if self.popen.poll() is not None and text not in self.log():
                raise RuntimeError(f"{self.log_path.name}: exited {self.popen.returncode}")
            return text in self.log()

        wait_for(seen, timeout=timeout, what=f"{text!r} in {self.log_path}")

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process and all its children."""
        os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL for anything left; always closes the log."""
        if self.popen.poll() is None:
            try:
                self.signal_group(signal.SIGCONT)
                self.signal_group(signal.SIGTERM)
                self.popen.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            self.signal_group(signal.SIGKILL)  # any pool child left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=15)
        self._log.close()


def start_worker(
    log_dir: Path, app: str, *classes: str, concurrency: int = 1, name: str = "w",
    env: dict[str, str] | None = None, cwd: Path | None = None,
) -> Proc:  # fmt: skip
    """A real `onceflow worker` (Celery prefork) for ``classes``; returns once it is ready."""
    args = ["worker", "--app", app, "--concurrency", str(concurrency)]
    args += ["-n", f"{name}-{os.getpid()}@%h"]
    for wc in classes:
        args += ["--worker-class", wc]
    proc = Proc(args, log_dir / f"worker-{name}.log", env=env, cwd=cwd)
    _wait_ready(proc, " ready.")
    return proc


def _wait_ready(proc: Proc, text: str) -> None:
    """Wait for ``proc``'s ready line; a process that never logs it is stopped, not left
    running (a worker that cannot connect retries for ever)."""
    try:
        proc.wait_log(text)
    except BaseException:
        proc.stop()
        raise


def start_beat(log_dir: Path, app: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> Proc:  # fmt: skip
    """A real `onceflow beat` sending the sweeper task every sweep interval."""
    proc = Proc(["beat", "--app", app], log_dir / "beat.log", env=env, cwd=cwd)
    _wait_ready(proc, "beat: Starting")
    return proc
