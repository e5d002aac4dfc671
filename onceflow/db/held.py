"""Held connections: a thread that runs statement after statement keeps its checkout.

A pool checkout and check-in per statement is a good default for a thread that runs a
statement now and then (a web request's enqueue): the connection goes back for the
other threads at once. A thread that does nothing but run statements (a prefork
worker child running stages, a worker loop around claim_next) pays it twice per
stage for nothing, and with several such processes per core that is a good part of their
CPU (bench/claim_layers.py shows it). Such a thread may *hold* its connection: inside
holding_connections(), raw_connection() hands the thread the connection it held last
(one per engine), checked out at its first use and back in the pool at the end.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

import psycopg
from sqlalchemy import Engine, event
from sqlalchemy.pool import ConnectionPoolEntry, Pool, PoolProxiedConnection

from onceflow.db.disconnect import drop_dead_connection, would_replace
from onceflow.db.statements import lend_cursor, run, take_cursor_back
from onceflow.db.translate import translate_errors
from onceflow.errors import ConnectionLost

#: Key, in a pooled connection's ``info`` (kept for the life of its DBAPI connection and
#: cleared when the pool replaces it), of the time the pool opened it.
OPENED_AT = "onceflow_opened_at"


@event.listens_for(Pool, "connect")
def _note_opened(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    # Every pool's, so a held connection of an engine onceflow did not make is checked too.
    record.info[OPENED_AT] = time.time()


class _Held:
    """One engine's connection held by one thread. ``busy`` while a call uses it; ``done``
    once given back (or inherited by a forked child: never to be touched); ``give_back``
    when its thread stopped holding while a call was using it."""

    __slots__ = ("__weakref__", "busy", "done", "fairy", "give_back", "pool", "raw", "started")

    def __init__(
        self, engine: Engine, fairy: PoolProxiedConnection, raw: psycopg.Connection[Any]
    ) -> None:
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
        self.fairy = fairy
        self.raw = raw
        self.busy = False
        self.done = False
        self.give_back = False
        # The pool it came from and when its connection was opened (what the pool checks
        # at a checkout).
        self.pool = engine.pool
        self.started: float | None = fairy.info.get(OPENED_AT)

    def __del__(self) -> None:
        # Collected without being given back (its thread ended inside a hold): the pool's
        # own finaliser returns the connection next, and must not get it in autocommit
        # (a later transaction's rollback would undo nothing).
        if self.done:
            return
        with suppress(Exception):
            take_cursor_back(self.raw)
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


def held_for(engine: Engine) -> _Held | None:
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
        lend_cursor(raw)
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
    return held.started is None or not would_replace(pool, held.started)


@contextmanager
def on_held(engine: Engine, held: _Held) -> Iterator[psycopg.Connection[Any]]:
    """``held``'s connection for one call (from :func:`held_for`); an error dealt with as
    :func:`run_on_held` does."""
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
        lost = drop_dead_connection(engine, held.fairy, exc)
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


def run_on_held(
    engine: Engine,
    held: _Held,
    query: str,
    params: dict[str, Any],
    take: Callable[[psycopg.Cursor[Any], str], Any],
) -> Any:
    """``take(cursor, query)`` after ``query`` ran on ``held`` (from :func:`held_for`):
    what ``with on_held(engine, held) as raw: run(raw, ...)`` does, without the context
    manager (a stage's statements, the hottest path). An error on a dead connection is
    raised as :class:`ConnectionLost`, any other translated."""
    held.busy = True
    try:
        return run(held.raw, query, params, take)
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
    take_cursor_back(held.raw)
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
    take_cursor_back(held.raw)
    try:
        held.fairy.invalidate()
    finally:
        held.fairy.close()


def before_fork() -> None:
    """Before a fork: every thread's held connections kept referenced across it."""
    # Strong references to every thread's held connections across the fork: were the
    # child to free the other threads' state (their threading.local dicts; CPython 3.11
    # keeps it), a connection collected there would be returned to the pool and rolled
    # back on the parent's socket.
    _at_fork[:] = list(_live)


def after_fork_in_parent() -> None:
    """After a fork, in the parent."""
    _at_fork.clear()


def after_fork_in_child() -> None:
    """After a fork, in the child: the parent's held connections left alone for good."""
    # Every held connection is the parent's session: the child keeps them referenced and
    # inert (done: never used, given back, closed or collected) and checks out its own.
    for held in _at_fork:
        held.done = True
    _inherited.extend(_at_fork)
    _at_fork.clear()
    _live.clear()
    _holding.conns = {}
