"""Real processes for acceptance tests: the package's process helpers, run from the repo root."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from onceflow.demo import procs
from onceflow.demo.procs import Proc, wait_for

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.stages:flow"
_ENV = {"PYTHONPATH": str(ROOT)}

__all__ = [
    "APP",
    "ROOT",
    "Proc",
    "api_server",
    "free_port",
    "pool_children",
    "start_beat",
    "start_worker",
    "started_together",
    "stop_all",
    "wait_for",
    "worker_args",
]


def start_worker(tmp: Path, *classes: str, concurrency: int = 1, name: str = "w") -> Proc:
    """A real `onceflow worker` of the test stages for ``classes``, once it is ready."""
    return procs.start_worker(
        tmp, APP, *classes, concurrency=concurrency, name=name, env=_ENV, cwd=ROOT
    )


def start_beat(tmp: Path) -> Proc:
    """A real `onceflow beat` for the test stages."""
    return procs.start_beat(tmp, APP, env=_ENV, cwd=ROOT)


def worker_args(*classes: str, app: str = APP, concurrency: int = 1, name: str = "w") -> list[str]:
    """The CLI arguments of a real `onceflow worker` (as :func:`start_worker` runs it)."""
    args = ["worker", "--app", app, "--concurrency", str(concurrency)]
    args += ["-n", f"{name}-{os.getpid()}@%h"]
    for wc in classes:
        args += ["--worker-class", wc]
    return args


@contextmanager
def started_together(
    tmp: Path, *commands: tuple[str, list[str], str], env: dict[str, str] | None = None
) -> Iterator[list[Proc]]:
    """Start every ``(log name, CLI args, ready line)`` at once, then wait until each has
    logged its ready line: the start-ups overlap instead of running one after another.

    Stopped on exit, all at once (:func:`stop_all`).
    """
    started: list[Proc] = []
    try:
        for log, args, _ in commands:
            started.append(Proc(args, tmp / log, env={**_ENV, **(env or {})}, cwd=ROOT))
        for proc, (_, _, ready) in zip(started, commands, strict=True):
            proc.wait_log(ready)
        yield started
    finally:
        stop_all(started)


def stop_all(procs: list[Proc]) -> None:
    """:meth:`Proc.stop` of each, side by side (each is a warm shutdown of its own)."""
    with ThreadPoolExecutor(max(1, len(procs))) as pool:
        list(pool.map(Proc.stop, procs))


def pool_children(proc: Proc) -> list[int]:
    """Pids of a worker's pool processes."""
    out = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def api_server(log_dir: Path, env: dict[str, str], app: str = APP) -> Iterator[tuple[str, Proc]]:
    """A real `onceflow api` for ``app`` on a free port, with ``env``: (base URL, process).

    Stopped on exit; the process's log stays readable (``proc.log()``) for checks after.
    """
    port = free_port()
    args = ["api", "--app", app, "--port", str(port), "--log-level", "info"]
    proc = Proc(args, log_dir / "api.log", env={**_ENV, **env}, cwd=ROOT)
    try:
        proc.wait_log("Application startup complete", timeout=60)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()
