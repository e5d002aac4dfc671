"""The servers as child processes: free ports, spawn in their own session, wait until they
answer, stop with signals (and kill a wedged one)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from onceflow.embedded.base import (
    _HOST,
    _LOG_TAIL_BYTES,
    _LOG_TAIL_LINES,
    _POLL_INTERVAL,
    _PORT_ATTEMPTS,
    _STOP_TIMEOUT,
    EmbeddedServicesError,
)

_log = logging.getLogger("onceflow.embedded")


# --------------------------------------------------------------------------- child processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _read_log_tail(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(offset, size - _LOG_TAIL_BYTES))
            data = log.read()
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    lines = data.decode("utf-8", errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    return "\n".join(lines) if lines else "(log is empty)"


_Probe = Callable[["_Child", float], str | None]


class _Child:
    """One server process: how to spawn it on a port, where it logs, how to stop it."""

    def __init__(
        self,
        name: str,
        argv_for_port: Callable[[int], list[str]],
        *,
        log_path: Path,
        cwd: Path,
        stop_signal: signal.Signals,
        run_as: tuple[int, int] | None = None,
    ) -> None:
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
        self.name = name
        self.argv_for_port = argv_for_port
        self.log_path = log_path
        self.cwd = cwd
        self.stop_signal = stop_signal
        self.run_as = run_as
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_offset = 0
        self.started_at = 0.0

    def spawn(self) -> None:
        self.port = _free_port()
        uid, gid = self.run_as if self.run_as is not None else (None, None)
        with self.log_path.open("ab") as log:
            # Only this run's lines go into error messages: the log is appended across restarts.
            self.log_offset = self.log_path.stat().st_size
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.argv_for_port(self.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                # Own session and process group: a Ctrl-C in the terminal reaches only us, and we
                # stop the servers in order; it also lets us SIGKILL a server with its children.
                start_new_session=True,
                user=uid,
                group=gid,
                # Drop root's supplementary groups too, not just the uid and gid.
                extra_groups=[] if self.run_as is not None else None,
            )

    def log_tail(self) -> str:
        return _read_log_tail(self.log_path, self.log_offset)

    def wait_until_answering(self, probe: _Probe, deadline: float) -> None:
        attempts = 1
        last_error = "not probed yet"
        while True:
            if self.process is None:
                raise EmbeddedServicesError(f"{self.name} was never started")
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                if attempts < _PORT_ATTEMPTS and "Address already in use" in tail:
                    attempts += 1
                    _log.info("%s lost port %d to another process; retrying", self.name, self.port)
                    self.spawn()
                    continue
                raise EmbeddedServicesError(
                    f"{self.name} exited with code {code} before answering on "
                    f"{_HOST}:{self.port}; last lines of {self.log_path}:\n{tail}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EmbeddedServicesError(
                    f"{self.name} did not answer on {_HOST}:{self.port} before the deadline "
                    f"(last error: {last_error}); last lines of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            error = probe(self, min(remaining, 2.0))
            if error is None:
                _log.info(
                    "%s answers on %s:%d after %.2fs",
                    self.name,
                    _HOST,
                    self.port,
                    time.monotonic() - self.started_at,
                )
                return
            last_error = error
            time.sleep(min(_POLL_INTERVAL, max(0.0, deadline - time.monotonic())))

    def signal_stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.stop_signal)

    def kill_if_running(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        _log.warning("%s did not stop in time; killing its process group", self.name)
        # The group id is still ours while the leader is unreaped, so this cannot hit a stranger;
        # it takes PostgreSQL's backends down with the postmaster.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _stop_children(children: list[_Child]) -> None:
    """Ask every server to stop, wait with a deadline, then kill whatever is left."""
    for child in children:
        child.signal_stop()
    deadline = time.monotonic() + _STOP_TIMEOUT
    try:
        for child in children:
            if child.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        # Also reached when a second Ctrl-C interrupts the wait: no server may outlive us.
        for child in children:
            child.kill_if_running()
