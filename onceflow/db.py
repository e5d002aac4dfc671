"""Engines made lazily per process, and driver errors translated at the boundary.

Nothing connects at import. An engine is cached per (url, pid): after a fork
(Celery's prefork pool) the child builds its own engine instead of sharing the
parent's sockets — the pattern of Celery's own ``SessionManager``.

Lost connections. The pool does not ping a connection before handing it out
(a round trip per call). After a Postgres restart every pooled connection is
dead, so the first call that meets a dead one invalidates the *whole* pool:
every connection opened before that moment is replaced at its next checkout,
and the error is raised as :class:`ConnectionLost`. :func:`is_disconnect` tells
such an error from a server that cannot be reached at all, and
:func:`retry_disconnect` repeats a call that is safe to repeat once, on a fresh
connection.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn, TypeVar

import psycopg
import sqlalchemy.exc as sa_exc
from psycopg.rows import tuple_row
from sqlalchemy import URL, Connection, Engine, TextClause, create_engine, make_url
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.pool import PoolProxiedConnection

from onceflow.errors import (
    ConnectionLost,
    DatabaseUnavailable,
    InvalidDatabaseUrl,
    InvalidRequest,
    NotMigrated,
    OnceflowError,
    StoreError,
)
from onceflow.payloads import load_stored_json
from onceflow.settings import get_settings

log = logging.getLogger("onceflow.db")

T = TypeVar("T")

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


def redact_url(url: str | URL) -> str:
    """``url`` without its password, for messages (also for a string that does not parse)."""
    if isinstance(url, URL):
        clean = url._replace(password=None).difference_update_query(["password"])
        return clean.render_as_string(hide_password=False)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"  # a libpq key=value string may carry password=…: show none of it
    rest = rest.split("?", 1)[0]  # a query string may carry ?password=…
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return f"{scheme}{sep}{rest}"
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}@{hostpart}"


#: The spellings of PostgreSQL accepted; the driver is always psycopg 3.
_POSTGRES_SCHEMES = ("postgresql+psycopg", "postgresql", "postgres")


def check_database_url(url: str) -> URL:
    """``url`` parsed as a PostgreSQL URL for psycopg 3, or :class:`InvalidDatabaseUrl`.

    Accepts the libpq spelling (``postgresql://``, ``postgres://``) users copy from
    elsewhere. Nothing connects; the error names the problem, never the password.
    """
    shown = redact_url(url)
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError:
        raise InvalidDatabaseUrl(shown, "not a URL") from None
    except ValueError as exc:  # e.g. a port that is not a number
        raise InvalidDatabaseUrl(shown, _bad_port(exc)) from None
    if parsed.drivername not in _POSTGRES_SCHEMES:
        raise InvalidDatabaseUrl(
            shown, f"onceflow needs PostgreSQL through psycopg 3, not {parsed.drivername!r}"
        )
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise InvalidDatabaseUrl(shown, f"port {parsed.port} is not in 1-65535")
    return parsed.set(drivername="postgresql+psycopg")


def _bad_port(exc: ValueError) -> str:
    match = re.search(r"int\(\) with base 10: '(.*)'$", str(exc))
    return f"port {match.group(1)!r} is not a number" if match else "cannot be parsed"


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


def _renew_lock_after_fork() -> None:
    # A forked child has only the forking thread: had another thread (the sweep watchdog in
    # a prefork worker's main process) held _lock at that instant, nobody would release it,
    # and the child's first get_engine or dispose_engines would wait forever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_lock_after_fork)


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
    commits on its own; wrap several in ``conn.transaction()``. The checkout is the
    pool's own (``engine.raw_connection()``), without a SQLAlchemy ``Connection``
    around it: that wrapper costs a stage's two statements a noticeable share of a worker
    child's CPU, and nothing here uses it. A thread inside
    :func:`holding_connections` keeps its checkout between calls instead.
    """
    held = _held_for(engine)
    if held is not None:
        with _on_held(engine, held) as conn:
            yield conn
        return
    with translate_errors(engine.url):
        fairy = engine.raw_connection()
        try:
            raw = fairy.driver_connection
            assert raw is not None  # noqa: S101 - a live checkout always has one
            raw.autocommit = True
            _lend_cursor(raw)
            try:
                yield raw
            except BaseException as exc:
                if raw.broken or raw.closed:
                    lost = _drop_dead_connection(engine, fairy, exc)
                    if lost is not None:
                        raise lost from exc
                raise
            finally:
                _take_cursor_back(raw)
                if not raw.closed:
                    raw.autocommit = False  # what SQLAlchemy's pool expects back
        finally:
            fairy.close()  # back to the pool (an invalidated one is discarded)


# ------------------------------------------------------------------ held connections
#
# A pool checkout and check-in per statement is a good default for a thread that runs a
# statement now and then (a web request's enqueue): the connection goes back for the
# other threads at once. A thread that does nothing but run statements (a prefork
# worker child running stages, a worker loop around claim_next) pays it twice per
# stage for nothing, and with several such processes per core that is a good part of their
# CPU (bench/claim_layers.py shows it). Such a thread may *hold* its connection: inside
# holding_connections(), raw_connection() hands the thread the connection it held last
# (one per engine), checked out at its first use and back in the pool at the end.


class _Held:
    """One engine's connection held by one thread. ``busy`` while a call uses it; ``done``
    once given back (or inherited by a forked child: never to be touched); ``give_back``
    when its thread stopped holding while a call was using it."""

    __slots__ = ("__weakref__", "busy", "done", "fairy", "give_back", "pool", "raw", "started")

    def __init__(
        self, engine: Engine, fairy: PoolProxiedConnection, raw: psycopg.Connection[Any]
    ) -> None:
        self.fairy = fairy
        self.raw = raw
        self.busy = False
        self.done = False
        self.give_back = False
        # The pool it came from and when its connection was opened (what the pool checks
        # at a checkout; its attributes, read once and defensively: not public API).
        self.pool = engine.pool
        record = getattr(fairy, "_connection_record", None)
        self.started: float | None = getattr(record, "starttime", None)

    def __del__(self) -> None:
        # Collected without being given back (its thread ended inside a hold): the pool's
        # own finaliser returns the connection next, and must not get it in autocommit
        # (a later transaction's rollback would undo nothing).
        if self.done:
            return
        with suppress(Exception):
            _take_cursor_back(self.raw)
            if _idle(self.raw):
                self.raw.autocommit = False
            else:
                self.fairy.invalidate()


class _Holding(threading.local):
    depth = 0
    #: engine -> its held connection (only while depth > 0: checked out at its first use),
    #: least recently used first.
    conns: dict[Engine, _Held]

    def __init__(self) -> None:
        self.conns = {}


_holding = _Holding()
_IDLE = psycopg.pq.TransactionStatus.IDLE
#: The most engines one thread holds a connection of; the least recently used goes back
#: first (a thread that makes engine after engine must not pin a connection of each).
MAX_HELD_ENGINES = 4
#: Every held connection of every thread (weakly: a thread's own dict owns them), for a
#: fork to find them all, not only the forking thread's.
_live: weakref.WeakSet[_Held] = weakref.WeakSet()
_at_fork: list[_Held] = []
#: Connections a forked child inherited held from its parent: never used, never closed or
#: returned (that would roll back or close the parent's session); kept from the collector,
#: whose finalisers would return them to the pool.
_inherited: list[_Held] = []


@contextmanager
def holding_connections() -> Iterator[None]:
    """Inside this block, the calling thread keeps one pooled connection per engine.

    For a thread that runs statement after statement: a prefork worker child (onceflow's
    Celery runtime enters it for the child's life), a worker loop around
    ``Queue.claim_next`` and ``complete``. The first statement checks a connection out;
    the next ones run on it, without a checkout and a check-in each; it goes back to the
    pool when the outermost block exits. Nothing else changes: each statement still
    commits on its own, a transaction is still ``conn.transaction()``.

    The held connection is given up and replaced by a fresh checkout when it died (the
    error is raised as for any connection, :class:`ConnectionLost`); when a call left it
    inside a transaction or out of autocommit, or was interrupted mid-statement; and when
    the pool would not hand it out again (invalidated after it was opened — a server
    restart seen by another thread —, older than ``pool_recycle``, or of a pool
    ``engine.dispose()`` replaced). A call nested inside another call on the same thread
    gets a connection of its own from the pool, as before. A process forked inside the
    block does not touch the parent's connections: the child checks out its own. Not for
    a thread of a large pool of threads that each run a statement now and then: each
    would keep one of the pool's connections for the whole block.
    """
    hold_connections()
    try:
        yield
    finally:
        release_connections()


def holding() -> bool:
    """Whether the calling thread holds its connections (see :func:`holding_connections`)."""
    return _holding.depth > 0


def hold_connections() -> None:
    """Start holding on this thread, as :func:`holding_connections` does (for a caller
    that cannot wrap a block: a worker child from its start); nests. End with
    :func:`release_connections`."""
    _holding.depth += 1


def release_connections() -> None:
    """End one :func:`hold_connections`; the outermost end gives the connections back."""
    if _holding.depth <= 0:
        return
    _holding.depth -= 1
    if _holding.depth == 0:
        conns, _holding.conns = _holding.conns, {}
        for held in conns.values():
            if held.busy:  # released from inside a call on it: given back as that ends
                held.give_back = True
                continue
            with suppress(Exception):  # one that cannot go back must not keep the rest
                _give_back(held)


def _held_for(engine: Engine) -> _Held | None:
    """This thread's idle held connection for ``engine`` (checked out now if it has none);
    None when the thread is not holding, or its held connection is in use (a nested call)."""
    if not _holding.depth:
        return None
    conns = _holding.conns
    held = conns.pop(engine, None)  # put back last: the most recently used
    if held is not None:
        if held.busy:
            conns[engine] = held
            return None
        if _usable(engine, held):
            conns[engine] = held
            return held
        _discard(held)
    with translate_errors(engine.url):
        fairy = engine.raw_connection()
        raw = fairy.driver_connection
        assert raw is not None  # noqa: S101 - a live checkout always has one
        held = _Held(engine, fairy, raw)  # owned (given back) before autocommit is turned on
        conns[engine] = held
        _live.add(held)
        raw.autocommit = True
        _lend_cursor(raw)
    while len(conns) > MAX_HELD_ENGINES:
        oldest = next(e for e, h in conns.items() if not h.busy)
        _give_back(conns.pop(oldest))
    return held


def _usable(engine: Engine, held: _Held) -> bool:
    """Whether a held connection may run the next call: open, idle, in autocommit, and
    not one the pool would replace at a checkout (a held one has none)."""
    if not (_idle(held.raw) and held.raw.autocommit):
        return False
    # What the pool checks at a checkout: invalidated after it was opened (invalidate_pool:
    # a thread met a dead connection, e.g. after a server restart), or older than
    # pool_recycle; and a pool the engine replaced (engine.dispose()).
    pool = engine.pool
    if held.pool is not pool:
        return False
    started = held.started
    if started is None:
        return True
    if getattr(pool, "_invalidate_time", 0) > started:
        return False
    recycle = getattr(pool, "_recycle", -1)
    return not (recycle > -1 and time.time() - started > recycle)


@contextmanager
def _on_held(engine: Engine, held: _Held) -> Iterator[psycopg.Connection[Any]]:
    held.busy = True
    try:
        yield held.raw
    except BaseException as exc:
        _reraise_held(engine, held, exc)
    finally:
        _held_done(held)


def _reraise_held(engine: Engine, held: _Held, exc: BaseException) -> NoReturn:
    """Raise what a call on ``held`` that raised ``exc`` raises (from its except block):
    the connection dealt with (:func:`_held_failed`), the error translated."""
    with translate_errors(engine.url):
        lost = _held_failed(engine, held, exc)
        if lost is not None:
            raise lost from exc
        raise exc


def _held_failed(engine: Engine, held: _Held, exc: BaseException) -> ConnectionLost | None:
    """A call on ``held`` raised ``exc``: a dead connection is dropped (the error to raise
    instead is returned), one left busy is discarded; an idle one stays held."""
    raw = held.raw
    if raw.broken or raw.closed:
        _forget(engine, held)
        lost = _drop_dead_connection(engine, held.fairy, exc)
        held.done = True
        held.fairy.close()
        return lost
    if not _idle(raw):
        # Interrupted mid-statement (a signal's exception: Celery's soft time limit), or
        # left inside a transaction: not to be kept checked out.
        _forget(engine, held)
        _discard(held)
    return None


def _held_done(held: _Held) -> None:
    held.busy = False
    if held.give_back and not held.done:
        _give_back(held)


def run_statement(
    engine: Engine,
    query: str,
    params: dict[str, Any],
    take: Callable[[psycopg.Cursor[Any], str], Any],
) -> Any:
    """``take(cursor, query)`` after ``query`` ran on a connection of ``engine``'s: what
    ``with raw_connection(engine) as raw: _run(raw, ...)`` does, without its three context
    managers on a held connection (a stage's statements, the hottest path)."""
    held = _held_for(engine)
    if held is None:
        with raw_connection(engine) as raw:
            return _run(raw, query, params, take)
    held.busy = True
    try:
        return _run(held.raw, query, params, take)
    except BaseException as exc:
        _reraise_held(engine, held, exc)
    finally:
        _held_done(held)


def _forget(engine: Engine, held: _Held) -> None:
    """Stop holding ``held`` (if this thread still holds it for ``engine``)."""
    if _holding.conns.get(engine) is held:
        del _holding.conns[engine]


def _idle(raw: psycopg.Connection[Any]) -> bool:
    """Open, and outside any transaction (nothing left running or uncommitted)."""
    # pgconn's own status (raw.info would build a ConnectionInfo at every call).
    return not raw.broken and raw.pgconn.transaction_status == _IDLE


def _give_back(held: _Held) -> None:
    """A held connection back to the pool (discarded if it is not clean)."""
    if held.done:
        return
    _take_cursor_back(held.raw)
    if not _idle(held.raw):
        _discard(held)
        return
    try:
        held.raw.autocommit = False  # what SQLAlchemy's pool expects back
    except psycopg.Error:
        _discard(held)
        return
    held.done = True
    held.fairy.close()


def _discard(held: _Held) -> None:
    """Close a held connection that must not be used again and free its pool slot."""
    if held.done:
        return
    held.done = True
    _take_cursor_back(held.raw)
    try:
        held.fairy.invalidate()
    finally:
        held.fairy.close()


def _before_fork() -> None:
    # Strong references to every thread's held connections across the fork: were the
    # child to free the other threads' state (their threading.local dicts; CPython 3.11
    # keeps it), a connection collected there would be returned to the pool and rolled
    # back on the parent's socket.
    _at_fork[:] = list(_live)


def _after_fork_in_parent() -> None:
    _at_fork.clear()


def _after_fork_in_child() -> None:
    # Every held connection is the parent's session: the child keeps them referenced and
    # inert (done: never used, given back, closed or collected) and checks out its own.
    for held in _at_fork:
        held.done = True
    _inherited.extend(_at_fork)
    _at_fork.clear()
    _live.clear()
    _holding.conns = {}


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


#: SQLSTATEs of a session ended by its own timeout: the server is fine, so the pool is kept.
_SESSION_ONLY_SQLSTATES = frozenset({"25P03", "57P05"})  # idle-in-transaction / idle session
#: SQLSTATEs that say an established connection is gone (admin or crash shutdown, link loss).
_DISCONNECT_SQLSTATES = frozenset({"57P01", "57P02", "08000", "08003", "08006", "08007"})


def _drop_dead_connection(
    engine: Engine, fairy: PoolProxiedConnection, exc: BaseException
) -> ConnectionLost | None:
    """The checked-out connection died under ``exc``: never hand it (or its peers) out again.

    A database error on a dead connection invalidates the whole pool (connections
    opened before now are replaced at their next checkout — a server restart
    killed them all) and becomes :class:`ConnectionLost`. Anything else (e.g. an
    interrupt mid-query) drops only this connection and is re-raised as it is.
    """
    database_error = isinstance(exc, psycopg.Error | DatabaseUnavailable)
    if database_error and getattr(exc, "sqlstate", None) not in _SESSION_ONLY_SQLSTATES:
        invalidate_pool(engine, fairy)
    fairy.invalidate()
    if not database_error or isinstance(exc, ConnectionLost):
        return None
    return ConnectionLost(f"Postgres connection lost: {_first_line(exc)}")


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
    invalidate = getattr(pool, "_invalidate", None)
    if invalidate is None:  # pragma: no cover - a SQLAlchemy without it: start a new pool
        engine.dispose(close=False)
        return
    invalidate(fairy, None, _checkin=False)
    log.info("Postgres connection lost: every pooled connection will be replaced")


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


# ------------------------------------------------------------------ statements
#
# While onceflow has a connection checked out (raw_connection: a pooled call, or a thread's
# hold), its statements run on one dict-row cursor the connection keeps (REUSED_CURSOR). A
# new cursor per statement built a fresh adapters map and looked every column's loader up
# again, about a tenth of the client CPU of a claim + completion.
# The cursor is lent at onceflow's checkout and taken back before the connection returns
# to the pool (kept aside under _IDLE_CURSOR for onceflow's next checkout): whoever gets
# the connection from the pool next (a SQLAlchemy Connection, a caller's raw checkout it
# hands to onceflow.connector.on_connection and may share between its threads, which
# psycopg allows for connections and not for cursors) sees no cursor and uses its own.
# A statement whose result is large (more than one row with a JSON column, or more than
# KEEP_ROWS rows) leaves its cursor closed and a fresh one in its place, so a large result
# is never kept in memory with an idle connection or across a stage's body.

REUSED_CURSOR = "_onceflow_cursor"
_IDLE_CURSOR = "_onceflow_idle_cursor"
#: A result of more rows than this is not kept by the reused cursor.
KEEP_ROWS = 100
#: Column types that may hold a payload (json, jsonb, bytea): a result of more than one row
#: with one of them is not kept either.
_BULKY_TYPES = frozenset({114, 3802, 17})


def _lend_cursor(raw: psycopg.Connection[Any]) -> None:
    """At onceflow's checkout: the connection's reusable cursor (kept aside since its last
    onceflow checkout, or a new one)."""
    cur = getattr(raw, _IDLE_CURSOR, None)
    if cur is None or cur.closed:
        cur = raw.cursor(row_factory=tuple_row)
    else:
        setattr(raw, _IDLE_CURSOR, None)
    setattr(raw, REUSED_CURSOR, cur)


def _take_cursor_back(raw: psycopg.Connection[Any]) -> None:
    """Before the connection goes back to the pool: nobody else may find the cursor."""
    cur = getattr(raw, REUSED_CURSOR, None)
    if cur is not None:
        setattr(raw, REUSED_CURSOR, None)
        setattr(raw, _IDLE_CURSOR, cur)


def _reused(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any] | None:
    cur: psycopg.Cursor[Any] | None = getattr(conn, REUSED_CURSOR, None)
    return None if cur is None or cur.closed else cur


def is_large(result: Any) -> bool:
    """Whether a result (a psycopg ``PGresult``) is too large to keep with its cursor."""
    rows = int(result.ntuples)
    if rows <= 1:
        return False
    if rows > KEEP_ROWS:
        return True
    return any(result.ftype(i) in _BULKY_TYPES for i in range(result.nfields))


def fetch_one(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> Any:
    """Run ``query``; its first row as a dict, or None."""
    return _run(conn, query, params, one_as_dict)


def fetch_all(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[Any]:
    """Run ``query``; every row as a dict."""
    rows: list[Any] = _run(conn, query, params, all_as_dicts)
    return rows


def execute(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> int:
    """Run ``query``; the number of rows it touched."""
    count: int = _run(conn, query, params, rowcount)
    return count


def rowcount(cur: psycopg.Cursor[Any], query: str) -> int:
    """The number of rows the statement touched (a ``take`` of :func:`run_statement`)."""
    return cur.rowcount


# The reused cursors make tuple rows, and a row becomes a dict with its statement's column
# names kept from the statement's first result: psycopg's dict_row decodes every column's
# name from each result again (27 names for a claim), a measurable share of a claim +
# completion's client CPU. A statement's text fixes its column names (onceflow's statements
# name their columns; no `SELECT *` of a table); the number of columns is checked at every
# result all the same, and a statement whose result differs in it gets its names read again.
_NAMES: dict[str, tuple[str, ...]] = {}
#: Statements whose column names are kept (a process runs a few dozen; cleared past this).
NAMES_KEPT = 512


def column_names(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], query: str
) -> tuple[str, ...]:
    """The column names of ``cur``'s current result, which ``query`` produced."""
    names = _NAMES.get(query)
    result = cur.pgresult
    if names is None or result is None or len(names) != result.nfields:
        names = tuple(c.name for c in cur.description or ())
        if len(_NAMES) >= NAMES_KEPT:
            _NAMES.clear()
        _NAMES[query] = names
    return names


def named_row(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], query: str, row: Any
) -> dict[str, Any] | None:
    """A tuple row of ``cur``'s current result as a dict (None stays None)."""
    return None if row is None else dict(zip(column_names(cur, query), row, strict=True))


def named_rows(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], query: str, rows: list[Any]
) -> list[dict[str, Any]]:
    """The tuple rows of ``cur``'s current result as dicts."""
    if not rows:
        return []
    names = column_names(cur, query)
    return [dict(zip(names, row, strict=True)) for row in rows]


def one_as_dict(cur: psycopg.Cursor[Any], query: str) -> dict[str, Any] | None:
    """The first row of a tuple-row cursor's result, as a dict (None: no row)."""
    return named_row(cur, query, cur.fetchone())


def all_as_dicts(cur: psycopg.Cursor[Any], query: str) -> list[dict[str, Any]]:
    """Every row of a tuple-row cursor's result, as dicts."""
    return named_rows(cur, query, cur.fetchall())


def _run(
    conn: psycopg.Connection[Any],
    query: str,
    params: dict[str, Any],
    take: Callable[[psycopg.Cursor[Any], str], Any],
) -> Any:
    """``take(cursor, query)`` after running ``query`` on the connection's reused cursor
    (or on a cursor of its own, for a connection onceflow did not check out)."""
    cur = _reused(conn)
    if cur is None:
        with conn.cursor(row_factory=tuple_row) as own:
            own.execute(query, params)
            return take(own, query)
    try:
        cur.execute(query, params)
        return take(cur, query)
    finally:  # also when a row failed to load: a large result is not kept either way
        result = cur.pgresult
        if result is not None and is_large(result):
            cur.close()  # the result freed now; the next statement gets a fresh cursor
            setattr(conn, REUSED_CURSOR, conn.cursor(row_factory=tuple_row))


@contextmanager
def translate_errors(url: str | URL | None = None) -> Iterator[None]:
    """Translate SQLAlchemy / psycopg errors into onceflow's tree; ours pass through.

    ``url`` names the database in :class:`NotMigrated` (one of onceflow's tables is
    missing); the settings' database URL by default. See :func:`translated`.
    """
    try:
        yield
    except Exception as exc:
        new = translated(exc, url)
        if new is exc:
            raise
        raise new from exc


def translated(exc: Exception, url: str | URL | None = None) -> Exception:
    """What :func:`translate_errors` raises for ``exc``: onceflow's error for a psycopg or
    SQLAlchemy one, ``exc`` itself for any other (onceflow's own included)."""
    if isinstance(exc, OnceflowError):
        return exc
    if isinstance(exc, psycopg.Error):
        if isinstance(exc, psycopg.OperationalError):
            return DatabaseUnavailable(f"Postgres unavailable: {_first_line(exc)}")
        if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
            return InvalidRequest(f"rejected by the database: {_first_line(exc)}")
        return _not_migrated(exc, url) or StoreError(_first_line(exc))
    if not isinstance(exc, sa_exc.SQLAlchemyError):
        return exc
    if isinstance(exc, sa_exc.OperationalError):
        if exc.connection_invalidated:  # SQLAlchemy invalidated the pool already
            return ConnectionLost(f"Postgres connection lost: {_first_line(exc)}")
        return DatabaseUnavailable(f"Postgres unavailable: {_first_line(exc)}")
    if isinstance(exc, sa_exc.DataError):
        return InvalidRequest(f"rejected by the database: {_first_line(exc)}")
    if isinstance(exc, sa_exc.IntegrityError):
        constraint = getattr(getattr(exc.orig, "diag", None), "constraint_name", None)
        return InvalidRequest(f"violates {constraint or 'a constraint'}: {_first_line(exc)}")
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return ConnectionLost(f"Postgres connection lost: {_first_line(exc)}")
        return _not_migrated(exc, url) or StoreError(_first_line(exc))
    return StoreError(_first_line(exc))


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


#: An "undefined table" error names the relation in its message (not in its diagnostics).
_UNDEFINED_RELATION = re.compile(r'relation "(?:[^"]+\.)?([^".]+)" does not exist')


def _not_migrated(exc: BaseException, url: str | URL | None) -> NotMigrated | None:
    """:class:`NotMigrated` if ``exc`` says one of onceflow's tables does not exist."""
    from onceflow.models import metadata  # the tables; models import nothing of ours

    orig = getattr(exc, "orig", None) or exc
    if not isinstance(orig, psycopg.errors.UndefinedTable):
        return None
    match = _UNDEFINED_RELATION.search(str(orig))
    ours = {*metadata.tables, "onceflow_alembic_version"}
    if match is None or match.group(1) not in ours:
        return None
    where = redact_url(url if url is not None else get_settings().database_url)
    return NotMigrated(where, f"table {match.group(1)} is missing")
