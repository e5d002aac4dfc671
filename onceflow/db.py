"""Engines made lazily per process, and driver errors translated at the boundary.

Nothing connects at import. An engine is cached per (url, pid): after a fork
(Celery's prefork pool) the child builds its own engine instead of sharing the
parent's sockets — the pattern of Celery's own ``SessionManager``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy.exc as sa_exc
from sqlalchemy import Engine, create_engine

from onceflow.errors import DatabaseUnavailable, InvalidRequest, OnceflowError, StoreError
from onceflow.settings import get_settings

_engines: dict[tuple[str, int], Engine] = {}
_lock = threading.Lock()


def make_engine(url: str, *, pool_size: int | None = None, **kwargs: Any) -> Engine:
    """Build an engine for ``url`` (psycopg 3); prefer :func:`get_engine` in long-lived code."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        # Accept the libpq spelling users copy from elsewhere; the driver is always psycopg 3.
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    size = pool_size if pool_size is not None else get_settings().pool_size
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("connect_args", {"connect_timeout": 10})
    return create_engine(url, pool_size=size, max_overflow=size, **kwargs)


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


def dispose_engines() -> None:
    """Forget every engine built in a parent process (call in a freshly forked child)."""
    with _lock:
        for (_, pid), engine in list(_engines.items()):
            # close=False: the parent still owns those sockets; the child must not close them.
            engine.dispose(close=False)
            if pid != os.getpid():
                del _engines[(_, pid)]


@contextmanager
def translate_errors() -> Iterator[None]:
    """Translate SQLAlchemy / psycopg errors into onceflow's tree; ours pass through."""
    try:
        yield
    except OnceflowError:
        raise
    except sa_exc.OperationalError as exc:
        raise DatabaseUnavailable(f"Postgres unavailable: {_first_line(exc)}") from exc
    except sa_exc.DataError as exc:
        raise InvalidRequest(f"rejected by the database: {_first_line(exc)}") from exc
    except sa_exc.IntegrityError as exc:
        constraint = getattr(getattr(exc.orig, "diag", None), "constraint_name", None)
        raise InvalidRequest(
            f"violates {constraint or 'a constraint'}: {_first_line(exc)}"
        ) from exc
    except sa_exc.DBAPIError as exc:
        if exc.connection_invalidated:
            raise DatabaseUnavailable(f"Postgres connection lost: {_first_line(exc)}") from exc
        raise StoreError(_first_line(exc)) from exc
    except sa_exc.SQLAlchemyError as exc:
        raise StoreError(_first_line(exc)) from exc


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
