"""Processes a benchmark starts and measures: worker subprocesses in their own process
group, a pool of spawned benchmark processes started together, CPU seconds from ``/proc``,
polling for a condition, and py-spy's stacks in buckets."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

#: The repository's root: the working directory of the processes a benchmark starts.
ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Proc:
    """A worker subprocess in its own process group, logging to a file; stop() ends it all."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str]):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop(); one run each
        self.launched = time.time()
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            tail = "\n".join(self.log().splitlines()[-20:])
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{tail}")

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {text!r} in its log after {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        stop_group(self.popen)
        self._log.close()


def stop_group(popen: subprocess.Popen[Any], grace: float = 20) -> None:
    """SIGTERM to ``popen``'s process group, SIGKILL to whatever of it is left."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            popen.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)  # any pool child left behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=10)


class ProcessPool:
    """A standing pool of spawned benchmark processes (``multiprocessing`` spawn: the client
    side is Python, and threads would serialise its work on the GIL), each driven by its
    parent over a pipe. ``target(*args_of(i), pipe)`` runs in process ``i``; it sends
    ``"ready"`` once set up, then answers each message, until it receives ``None``."""

    def __init__(self, target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]],
                 n: int) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Pipe] = []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=target, args=(*args_of(i), child), daemon=True)
                proc.start()
                self.procs.append(proc)
                self.pipes.append(parent)
            for pipe in self.pipes:
                if pipe.recv() != "ready":
                    raise RuntimeError("a benchmark process failed to start")
        except BaseException:
            self.close()
            raise

    def ask(self, n: int, msg: Any) -> list[Any]:
        """``msg`` to the first ``n`` processes at once, then their answers."""
        for pipe in self.pipes[:n]:
            pipe.send(msg)
        return [pipe.recv() for pipe in self.pipes[:n]]

    def together(
        self, n: int, warm: Any, go: Callable[[float], Any]
    ) -> tuple[list[Any], list[Any]]:
        """The warm-up message to ``n`` processes, then ``go(start_at)``: they all start
        at ``start_at`` (``time.perf_counter``, one clock across processes), 0.2 s on.
        The answers to both."""
        warmed = self.ask(n, warm)
        return warmed, self.ask(n, go(time.perf_counter() + 0.2))

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def run_until(
    op: Callable[[], int | None], start_at: float, duration: float
) -> tuple[int, float, bool]:
    """In a pool's process: wait for ``start_at``, then call ``op`` for ``duration`` seconds.
    ``op`` returns the ops it did (``None``: one), ``0`` when there is nothing left to do.
    The ops done, the seconds since ``start_at``, and whether the work ran out."""
    while time.perf_counter() < start_at:
        time.sleep(0.001)
    deadline = start_at + duration
    count, exhausted = 0, False
    while time.perf_counter() < deadline:
        done = op()
        if done is None:
            done = 1
        if not done:
            exhausted = True
            break
        count += done
    return count, time.perf_counter() - start_at, exhausted


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc``); a process gone counts 0."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def wait_until(cond: Callable[[], Any], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``cond`` until truthy or ``timeout``; returns whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something truthy, and return that; ``TimeoutError``
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stack_samples(
    paths: Iterable[Path], thread: str, buckets: Sequence[tuple[str, str]]
) -> tuple[dict[str, int], dict[str, int], int]:
    """py-spy's raw (folded) stacks in ``paths``, of the threads whose stack holds
    ``thread``: the samples per bucket (the first of ``buckets``' ``(marker, bucket)`` whose
    marker a frame holds, else ``other``), those of them waiting in psycopg, and all."""
    counts: dict[str, int] = {}
    db_wait: dict[str, int] = {}
    total = 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if thread not in stack or not count.isdigit():
                continue
            frames = stack.split(";")
            name = next((b for m, b in buckets if any(m in f for f in frames)), "other")
            counts[name] = counts.get(name, 0) + int(count)
            if any("psycopg" in f and "wait" in f for f in frames):
                db_wait[name] = db_wait.get(name, 0) + int(count)
            total += int(count)
    return counts, db_wait, total
