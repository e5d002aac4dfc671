"""Lost connections: how a dead one is dropped, and which errors say a connection was lost.

The pool does not ping a connection before handing it out (a round trip per call). After
a Postgres restart every pooled connection is dead, so the first call that meets a dead
one invalidates the *whole* pool: every connection opened before that moment is replaced
at its next checkout, and the error is raised as :class:`ConnectionLost`.
:func:`is_disconnect` tells such an error from a server that cannot be reached at all,
and :func:`retry_disconnect` repeats a call that is safe to repeat once, on a fresh
connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
import sqlalchemy.exc as sa_exc
from sqlalchemy import Connection, Engine
from sqlalchemy.pool import Pool, PoolProxiedConnection

from onceflow.db.translate import first_line
from onceflow.errors import ConnectionLost, DatabaseUnavailable

log = logging.getLogger("onceflow.db")

T = TypeVar("T")

#: SQLSTATEs of a session ended by its own timeout: the server is fine, so the pool is kept.
_SESSION_ONLY_SQLSTATES = frozenset({"25P03", "57P05"})  # idle-in-transaction / idle session
#: SQLSTATEs that say an established connection is gone (admin or crash shutdown, link loss).
_DISCONNECT_SQLSTATES = frozenset({"57P01", "57P02", "08000", "08003", "08006", "08007"})


def drop_dead_connection(
    engine: Engine, fairy: PoolProxiedConnection, exc: BaseException
) -> ConnectionLost | None:
    """The checked-out connection died under ``exc``: never hand it (or its peers) out again.

    A database error on a dead connection invalidates the whole pool (connections
    opened before now are replaced at their next checkout — a server restart
    killed them all) and becomes :class:`ConnectionLost`, returned for the caller to
    raise. Anything else (e.g. an interrupt mid-query) drops only this connection and
    None is returned: the caller re-raises ``exc`` as it is.
    """
    database_error = isinstance(exc, psycopg.Error | DatabaseUnavailable)
    if database_error and getattr(exc, "sqlstate", None) not in _SESSION_ONLY_SQLSTATES:
        invalidate_pool(engine, fairy)
    fairy.invalidate()
    if not database_error or isinstance(exc, ConnectionLost):
        return None
    return ConnectionLost(f"Postgres connection lost: {first_line(exc)}")


def invalidate_pool(
    engine: Engine, seen_by: Connection | PoolProxiedConnection | None = None
) -> None:
    """Mark every connection the pool opened so far as stale; each is replaced at its checkout.

    Nothing is closed now and no round trip is made: a connection checked out
    elsewhere finishes its call, and the pool swaps it for a fresh one the next
    time it is handed out (SQLAlchemy's own disconnect handling, ``Pool._invalidate``,
    which moves the pool's invalidation time). ``seen_by`` is the connection (a
    SQLAlchemy one or a pool checkout) that saw the disconnect: if the pool was
    invalidated after it was opened, the time is not moved again, so newer, live
    connections are kept.
    """
    pool = engine.pool
    if isinstance(seen_by, Connection):
        fairy = None if seen_by.invalidated else seen_by.connection
    else:
        fairy = seen_by if seen_by is not None and seen_by.is_valid else None
    # SQLAlchemy has no public call for "every connection opened so far is stale, close
    # none now" (engine.dispose() replaces the pool and orphans the checked-out
    # connections): this is the one it makes itself on a disconnect, read defensively.
    invalidate = getattr(pool, "_invalidate", None)
    if invalidate is None:  # pragma: no cover - a SQLAlchemy without it: start a new pool
        engine.dispose(close=False)
        return
    invalidate(fairy, None, _checkin=False)
    log.info("Postgres connection lost: every pooled connection will be replaced")


def would_replace(pool: Pool, opened_at: float) -> bool:
    """Whether ``pool`` would replace, at its next checkout, a connection opened at
    ``opened_at`` (``time.time()``): invalidated since (:func:`invalidate_pool`), or older
    than the pool's ``pool_recycle``."""
    # The two times the pool itself compares at a checkout; SQLAlchemy has no public
    # accessor for them, so they are read here, defensively, next to _invalidate above.
    if getattr(pool, "_invalidate_time", 0) > opened_at:
        return True
    recycle = getattr(pool, "_recycle", -1)
    return recycle > -1 and time.time() - opened_at > recycle


def is_disconnect(exc: BaseException) -> bool:
    """Whether ``exc`` says an *established* Postgres connection was lost under a call.

    True for :class:`ConnectionLost` (what onceflow raises: a server restart or
    fast shutdown, a killed backend, a dropped link), and for a driver error of
    that kind — a SQLAlchemy error whose connection was invalidated, or a
    psycopg error with an admin/crash-shutdown or connection-failure SQLSTATE —
    anywhere in the ``__cause__`` chain. False for a connection that could not
    be opened (server down, refused, still starting), for other database errors
    (constraint violations, timeouts) and for anything else.

    A call that failed this way may or may not have committed: repeat it (on a
    fresh connection; the pool was invalidated) only if it is safe to run twice
    — a read, an ``INSERT … ON CONFLICT`` with ids minted before the first
    attempt, a write fenced by a claim token — e.g. with :func:`retry_disconnect`.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionLost):
            return True
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, psycopg.Error) and current.sqlstate in _DISCONNECT_SQLSTATES:
            return True
        current = current.__cause__
    return False


def retry_disconnect(fn: Callable[[], T]) -> T:
    """``fn()``, called once more if it failed with a lost connection (:func:`is_disconnect`).

    For calls that are safe to run twice (see :func:`is_disconnect`): the retry
    runs at once on a fresh connection, since the failure invalidated the pool.
    Exactly one retry; a server that cannot be reached raises
    :class:`DatabaseUnavailable` at once, without a retry, and any other error
    passes through. Build ids and payloads *before* the call, so both attempts
    send the same statement.
    """
    try:
        return fn()
    except Exception as exc:
        if not is_disconnect(exc):
            raise
        log.info("retrying once on a fresh connection after: %s", exc)
    return fn()
