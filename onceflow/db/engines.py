"""Engines made lazily, one per (url, process).

Nothing connects at import. An engine is cached per (url, pid): after a fork (Celery's
prefork pool) the child builds its own engine instead of sharing the parent's sockets —
the pattern of Celery's own ``SessionManager``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from sqlalchemy import Engine, create_engine

from onceflow.db.urls import check_database_url
from onceflow.payloads import load_stored_json
from onceflow.settings import get_settings

_engines: dict[tuple[str, int], Engine] = {}
_lock = threading.Lock()
_min_pool_size = 0


def size_pools_for(concurrency: int) -> None:
    """Make engines built from now on hold at least one connection per concurrent task.

    A Celery worker with a threads (or gevent/eventlet) pool runs ``concurrency``
    stages in one process, plus the heartbeat and sweep threads: the worker calls
    this at start so no stage waits for a connection another stage holds.
    """
    global _min_pool_size
    _min_pool_size = max(0, int(concurrency)) + 2


def make_engine(url: str, *, pool_size: int | None = None, **kwargs: Any) -> Engine:
    """Build an engine for ``url`` (psycopg 3); prefer :func:`get_engine` in long-lived code.

    A malformed URL raises :class:`InvalidDatabaseUrl` (see :func:`check_database_url`).
    """
    parsed = check_database_url(url)
    size = pool_size if pool_size is not None else max(get_settings().pool_size, _min_pool_size)
    # No pre-ping: it costs a round trip per checkout. A dead connection surfaces as
    # DatabaseUnavailable on first use and is invalidated (see raw_connection).
    kwargs.setdefault("pool_pre_ping", False)
    kwargs.setdefault("connect_args", {"connect_timeout": 10})
    # jsonb is loaded by psycopg with this (raw connections and SQLAlchemy alike): a stored
    # value too deep to serve comes back as a placeholder instead of failing the read.
    kwargs.setdefault("json_deserializer", load_stored_json)
    return create_engine(parsed, pool_size=size, max_overflow=size, **kwargs)


def get_engine(url: str | None = None) -> Engine:
    """The engine of this process for ``url`` (the settings' database URL by default)."""
    url = url or get_settings().database_url
    key = (url, os.getpid())
    engine = _engines.get(key)
    if engine is None:
        with _lock:
            engine = _engines.get(key)
            if engine is None:
                engine = make_engine(url)
                _engines[key] = engine
    return engine


def renew_lock_after_fork() -> None:
    """In a forked child: a fresh lock for the engine cache (see :mod:`onceflow.db.forks`)."""
    # A forked child has only the forking thread: had another thread (the sweep watchdog in
    # a prefork worker's main process) held _lock at that instant, nobody would release it,
    # and the child's first get_engine or dispose_engines would wait forever.
    global _lock
    _lock = threading.Lock()


def dispose_engines() -> None:
    """Forget every engine built in a parent process (call in a freshly forked child)."""
    with _lock:
        for (_, pid), engine in list(_engines.items()):
            # close=False: the parent still owns those sockets; the child must not close them.
            engine.dispose(close=False)
            if pid != os.getpid():
                del _engines[(_, pid)]
