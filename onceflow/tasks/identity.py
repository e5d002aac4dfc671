"""This process as a claimant of requests: ``host:pid``."""

from __future__ import annotations

import os
import socket

_worker_id: list[str] = []


def worker_id() -> str:
    """This process as a claimant: ``host:pid`` (made once per process: a stage asked for it
    every time, a ``uname`` system call each; forgotten in a forked child)."""
    if not _worker_id:
        _worker_id.append(f"{socket.gethostname()}:{os.getpid()}")
    return _worker_id[0]


os.register_at_fork(after_in_child=_worker_id.clear)
