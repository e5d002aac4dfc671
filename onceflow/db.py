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

import psycopg
import sqlalchemy.exc as sa_exc
from psycopg.rows import dict_row
from sqlalchemy import Engine, TextClause, create_engine
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

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
    # No pre-ping: it costs a round trip per checkout. A dead connection surfaces as
    # DatabaseUnavailable on first use and is invalidated (see raw_connection).
    kwargs.setdefault("pool_pre_ping", False)
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


_DIALECT = pg_psycopg.dialect()  # type: ignore[no-untyped-call]


def render(clause: TextClause) -> str:
    """A text() statement rendered once for psycopg (``%(name)s`` placeholders)."""
    return str(clause.compile(dialect=_DIALECT))


@contextmanager
def raw_connection(engine: Engine) -> Iterator[psycopg.Connection[Any]]:
    """A pooled psycopg connection in autocommit mode, for the hot paths.

    SQLAlchemy keeps the pool; the statements go straight to psycopg (its
    automatic prepared statements, no result-metadata work). Each statement
    commits on its own; wrap several in ``conn.transaction()``.
    """
    with translate_errors(), engine.connect() as sa_conn:
        raw = sa_conn.connection.driver_connection
        assert raw is not None  # noqa: S101 - a live checkout always has one
        raw.autocommit = True
        try:
            yield raw
        except BaseException:
            if raw.broken or raw.closed:
                sa_conn.invalidate()  # never hand a dead socket to the next caller
            raise
        finally:
            if not raw.closed:
                raw.autocommit = False  # what SQLAlchemy's pool expects back


def fetch_one(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> Any:
    """Run ``query``; its first row as a dict, or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchone()


def fetch_all(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[Any]:
    """Run ``query``; every row as a dict."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall()


@contextmanager
def translate_errors() -> Iterator[None]:
    """Translate SQLAlchemy / psycopg errors into onceflow's tree; ours pass through."""
    try:
        yield
    except OnceflowError:
        raise
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"Postgres unavailable: {_first_line(exc)}") from exc
    except (psycopg.DataError, psycopg.IntegrityError) as exc:
        raise InvalidRequest(f"rejected by the database: {_first_line(exc)}") from exc
    except psycopg.Error as exc:
        raise StoreError(_first_line(exc)) from exc
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
