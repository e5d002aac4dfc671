# Over ~400 lines on purpose: one listener in two drivers beside both APIs' waits, kept in step.
"""Waiting for work without polling: LISTEN on ``onceflow_work`` (mixins of both queue APIs).

The statements that make a request claimable now (enqueue of a due row, a failure
queued again and due, a rescue, a requeue, the sweeper's due / re-dispatch marks)
send ``NOTIFY onceflow_work, '<worker class>'`` in their own transaction, so it is
delivered exactly when they commit (see ``onceflow.queue.sql._notify``). A waiter:

1. makes sure this process's listener connection is LISTENing (lazily started),
2. notes the listener's counters, then
3. asks the database when the next request of its classes may be claimable
   (``NEXT_WORK``: due now, or the earliest ``run_after`` / lapsing lease),

and sleeps until a notify for one of its classes arrives, the listener reconnects
(notifies may have been missed), that next event passes, or the timeout. Since the
listener LISTENs before the counters are noted and the query runs after, a commit
is either seen by the query or counted after the note: no lost wake-up. It never
claims: the caller's claim decides (a wake-up may be spurious).

A database split by workspace (docs/sharding.md, 5.4): one listener per shard, all
sharing one condition, and the steps above hold per shard — every listener LISTENs
and is noted before ``NEXT_WORK`` runs on every shard; the wait ends on a notify of
any shard, at the earliest next event over the shards. A shard whose listener is
not connected neither blocks the others nor is forgotten: while its database answers
``NEXT_WORK`` the wait ends within ``_READY_WAIT`` (a spurious wake-up, so the caller
looks again, as on one database); while it does not answer either, the wait goes by
the other shards, its timeout, and ends when that listener connects again (whatever
committed meanwhile is then claimable). ``NEXT_WORK`` failing on every shard raises.

:class:`~onceflow.Queue` waits in the calling thread (``wait_for_work``, a listener
thread per process) or on an event loop (``wait_for_work_async``, the query in a worker
thread: the queue's connections are sync); :class:`~onceflow.AsyncQueue`'s
``wait_for_work`` is the coroutine, its query a step on the async pool (see
:mod:`onceflow.connector`). One listener per event loop serves both async waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import psycopg
from sqlalchemy import Engine

from onceflow.connector import (
    AsyncConnector,
    Connector,
    OnShard,
    ShardCount,
    Steps,
    arun,
    conninfo,
    one_row,
    retrying,
    run,
)
from onceflow.errors import DatabaseUnavailable, InvalidRequest
from onceflow.ids import check_worker_class
from onceflow.loops import PerLoop
from onceflow.models.scopes import WorkspaceScope, as_scope, scope_params
from onceflow.queue import sql
from onceflow.queue.sql import NOTIFY_CHANNEL
from onceflow.settings import Settings

log = logging.getLogger("onceflow.queue.notify")

CHANNEL = NOTIFY_CHANNEL
#: The longest a single wait_for_work may be asked to wait.
WAIT_MAX_SECONDS = 3600.0
#: Reconnect backoff of a lost listener connection.
_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 2.0
#: How often the listener thread checks whether it was asked to stop.
_TICK = 0.5
#: How long a wait gives a (re)connecting listener before it goes on without it; without
#: one, waits end after this long too, so a consumer looks again at least this often.
_READY_WAIT = 1.0


def _conninfo(source: Engine | str) -> str:
    """The listener's libpq connection string, from a queue's engine or database URL."""
    if isinstance(source, Engine):
        return source.url.set(drivername="postgresql").render_as_string(hide_password=False)
    return conninfo(source)


#: One shard's answer to NEXT_WORK: seconds, None (nothing known), or why it did not answer.
ShardNext = float | None | DatabaseUnavailable


def next_work_by_shard(
    classes: list[str], workspaces: WorkspaceScope | Iterable[str] | None = None
) -> Steps[list[ShardNext]]:
    """Per shard, in shard order: seconds (database clock) until work of ``classes`` (in
    ``workspaces``; None: any) may be claimable there, None when nothing is known, or the
    :class:`DatabaseUnavailable` of a shard that did not answer — raised instead when no
    shard answered.

    A read: repeated once on a fresh connection after a lost one.
    """
    params: dict[str, Any] = {"worker_classes": classes}
    query = sql.NEXT_WORK
    scope = as_scope(workspaces)
    if scope is not None:
        params.update(scope_params(scope))
        query = sql.NEXT_WORK_SCOPED
    count: int = yield ShardCount()
    out: list[ShardNext] = []
    for index in range(count):
        try:
            row = yield OnShard(index, retrying(lambda: one_row(query, params)))
        except DatabaseUnavailable as exc:
            if count > 1:
                log.info("wait_for_work: shard %d did not answer: %s", index, exc)
            out.append(exc)
            continue
        out.append(None if row["next_in"] is None else float(row["next_in"]))
    if all(isinstance(a, DatabaseUnavailable) for a in out):
        first = out[0]
        assert isinstance(first, DatabaseUnavailable)  # noqa: S101 - count >= 1
        raise first
    return out


def _earliest(answers: Sequence[ShardNext]) -> float | None:
    known = [a for a in answers if isinstance(a, float)]
    return min(known) if known else None


def next_work(classes: list[str]) -> Steps[float | None]:
    """Seconds (database clock) until work of ``classes`` may be claimable; None: unknown.

    The earliest over the shards that answered (see :func:`next_work_by_shard`).
    """
    return _earliest((yield from next_work_by_shard(classes)))


def _check_wait(worker_classes: str | Sequence[str], timeout: float) -> tuple[list[str], float]:
    if isinstance(worker_classes, str):
        classes = [worker_classes]
    elif isinstance(worker_classes, Sequence):
        classes = list(worker_classes)
    else:
        raise InvalidRequest("worker_classes must be a worker class or a sequence of them")
    if not classes:
        raise InvalidRequest("worker_classes must name at least one worker class")
    for wc in classes:
        check_worker_class(wc)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 <= timeout <= WAIT_MAX_SECONDS
    ):
        raise InvalidRequest(f"timeout must be a number of seconds in [0, {WAIT_MAX_SECONDS:g}]")
    return sorted(set(classes)), float(timeout)


class _Listener:
    """One LISTEN connection in a daemon thread; fans notifies out to waiters.

    ``cond`` may be shared by the listeners of several shards: a waiter waits on it once.
    """

    def __init__(
        self, conninfo: str, cond: threading.Condition | None = None, name: str = ""
    ) -> None:
        self._conninfo = conninfo
        self.cond = cond or threading.Condition()
        self.counts: Counter[str] = Counter()  # notifies seen per worker class
        # Bumped whenever the connection is lost (notifies may be missed) or comes up.
        self.epoch = 0
        self.ready = False  # LISTENing now
        self.failing = False  # its last attempt to connect failed (it is backing off)
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"onceflow-listen{name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        backoff = _BACKOFF_MIN
        while not self._stop.is_set():
            connected = False
            try:
                with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=10) as conn:
                    self._conn = conn
                    conn.execute(f"LISTEN {CHANNEL}")
                    connected = True
                    with self.cond:
                        self.ready, self.failing = True, False
                        self.epoch += 1  # a waiter that began while it was down looks again
                        self.cond.notify_all()
                    backoff = _BACKOFF_MIN
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=_TICK):
                            with self.cond:
                                self.counts[note.payload] += 1
                                self.cond.notify_all()
            except (psycopg.Error, OSError) as exc:
                if self._stop.is_set():
                    break
                if connected or not self.failing:  # once per outage, not per attempt
                    log.warning("work listener lost its connection (%s); reconnecting", exc)
            finally:
                self._conn = None
                with self.cond:
                    if self.ready:
                        self.epoch += 1  # wake every waiter: a notify may have been missed
                    self.ready = False
                    self.failing = self.failing or not connected
                    self.cond.notify_all()
            self._stop.wait(backoff)
            backoff = min(_BACKOFF_MAX, backoff * 2)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Tell the thread to end (it does at its next tick); :meth:`close` waits for it."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_TICK * 4)


class _Mark(NamedTuple):
    """A listener's state noted by a waiter before its ``NEXT_WORK`` query."""

    epoch: int
    counts: dict[str, int]
    ready: bool


def _note(listener: _Listener | _AsyncListener, classes: list[str]) -> _Mark:
    """(The caller holds the listener's condition.)"""
    return _Mark(listener.epoch, {c: listener.counts[c] for c in classes}, listener.ready)


def _moved(listeners: Sequence[_Listener | _AsyncListener], marks: Sequence[_Mark]) -> bool:
    """A notify of a noted class, a lost or a new connection since the marks."""
    return any(
        lis.epoch != m.epoch or any(lis.counts[c] != n for c, n in m.counts.items())
        for lis, m in zip(listeners, marks, strict=True)
    )


def _awaited(listener: _Listener | _AsyncListener, alive: bool) -> bool:
    """Worth waiting for (at the start of a wait): starting, not known to be failing."""
    return alive and not listener.ready and not listener.failing


class _Listeners:
    """This process's listeners of one queue: one per database (shard), one condition."""

    def __init__(self, conninfos: Sequence[str]) -> None:
        self.cond = threading.Condition()
        many = len(conninfos) > 1
        self.listeners = [
            _Listener(info, self.cond, f"-{k}" if many else "") for k, info in enumerate(conninfos)
        ]

    def note(self, classes: list[str], ready_by: float) -> list[_Mark]:
        """Wait (until ``ready_by`` at most) for listeners still starting, then note each."""
        with self.cond:
            while any(_awaited(lis, lis.alive) for lis in self.listeners):
                left = ready_by - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return [_note(lis, classes) for lis in self.listeners]

    def moved(self, marks: Sequence[_Mark]) -> bool:
        return _moved(self.listeners, marks)

    def close(self) -> None:
        for listener in self.listeners:  # all told first: their threads end side by side
            listener.stop()
        for listener in self.listeners:
            listener.close()


#: Told of each notify (its worker class) and of each (re)connection (None): look again.
WorkWatcher = Callable[[str | None], None]


def _tell(watchers: set[WorkWatcher], payload: str | None) -> None:
    for watcher in list(watchers):
        try:
            watcher(payload)
        except Exception:  # a watcher's bug must not stop the listener
            log.exception("a work watcher failed")


class _AsyncListener:
    """The asyncio twin of :class:`_Listener`: a task on one event loop."""

    def __init__(
        self,
        conninfo: str,
        cond: asyncio.Condition | None = None,
        watchers: set[WorkWatcher] | None = None,
    ) -> None:
        self._conninfo = conninfo
        self.cond = cond or asyncio.Condition()
        self.watchers: set[WorkWatcher] = watchers if watchers is not None else set()
        self.counts: Counter[str] = Counter()
        self.epoch = 0
        self.ready = False
        self.failing = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="onceflow-listen")

    async def _run(self) -> None:
        backoff = _BACKOFF_MIN
        while True:
            connected = False
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, connect_timeout=10
                )
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    connected = True
                    async with self.cond:
                        self.ready, self.failing = True, False
                        self.epoch += 1
                        self.cond.notify_all()
                    _tell(self.watchers, None)
                    backoff = _BACKOFF_MIN
                    async for note in conn.notifies():
                        async with self.cond:
                            self.counts[note.payload] += 1
                            self.cond.notify_all()
                        _tell(self.watchers, note.payload)
            except (psycopg.Error, OSError) as exc:
                if connected or not self.failing:
                    log.warning("async work listener lost its connection (%s); reconnecting", exc)
            finally:
                async with self.cond:
                    if self.ready:
                        self.epoch += 1
                    self.ready = False
                    self.failing = self.failing or not connected
                    self.cond.notify_all()
                _tell(self.watchers, None)
            await asyncio.sleep(backoff)
            backoff = min(_BACKOFF_MAX, backoff * 2)

    @property
    def alive(self) -> bool:
        return not self._task.done()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class _AsyncListeners:
    """The asyncio twin of :class:`_Listeners` (on one event loop)."""

    def __init__(self, conninfos: Sequence[str]) -> None:
        self.cond = asyncio.Condition()
        self.watchers: set[WorkWatcher] = set()
        self.listeners = [_AsyncListener(info, self.cond, self.watchers) for info in conninfos]

    @property
    def listening(self) -> bool:
        """Every listener LISTENing now (else a notify may go unheard)."""
        return all(lis.ready for lis in self.listeners)

    async def note(self, classes: list[str], ready_by: float) -> list[_Mark]:
        async with self.cond:
            while any(_awaited(lis, lis.alive) for lis in self.listeners):
                left = ready_by - time.monotonic()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.cond.wait(), left)
            return [_note(lis, classes) for lis in self.listeners]

    def moved(self, marks: Sequence[_Mark]) -> bool:
        return _moved(self.listeners, marks)

    async def close(self) -> None:
        for listener in self.listeners:
            await listener.close()


class WorkWatch:
    """A watcher of this event loop's work listeners (:meth:`_Listening.watch_work`)."""

    def __init__(self, group: _AsyncListeners, watcher: WorkWatcher) -> None:
        self._group = group
        self._watcher = watcher

    @property
    def listening(self) -> bool:
        """Every listener LISTENing now: without, the watcher must look again by itself."""
        return self._group.listening

    def close(self) -> None:
        self._group.watchers.discard(self._watcher)


def _wake_at(
    start: float, timeout: float, next_in: float | None, *, degraded: bool
) -> tuple[float, bool]:
    """When a wait ends (monotonic) and whether that moment is a known due time.

    ``next_in``: seconds until the next known event by the database clock. A wait
    without its listener (``degraded``) ends within ``_READY_WAIT`` with True (a
    spurious wake-up, so the caller claims and looks again; False means the timeout).
    """
    wake_at, due = start + timeout, False
    now = time.monotonic()
    if next_in is not None and now + next_in < wake_at:
        wake_at, due = now + next_in, True
    if degraded and now + _READY_WAIT < wake_at:
        # Not the timeout: a (documented) spurious True makes the caller look again.
        wake_at, due = now + _READY_WAIT, True
    return wake_at, due


def _plan(
    start: float, timeout: float, marks: Sequence[_Mark], answers: Sequence[ShardNext]
) -> tuple[float, bool] | None:
    """When a wait ends (see :func:`_wake_at`); None: work is due now.

    ``marks``: the listeners' notes, one per shard (none without listeners). A shard whose
    listener was not LISTENing while its database answered makes the wait degraded.
    """
    next_in = _earliest(answers)
    if next_in is not None and next_in <= 0:
        return None
    degraded = any(
        not m.ready and not isinstance(a, DatabaseUnavailable)
        for m, a in zip(marks, answers, strict=False)
    )
    return _wake_at(start, timeout, next_in, degraded=degraded)


class _Listening:
    """What both queue APIs' asyncio waits share: listeners per event loop, the wait."""

    settings: Settings

    # A plain table pruned of closed loops: a weak one never let go (the task holds its loop).
    _alisteners: PerLoop[_AsyncListeners]

    def _listen_sources(self) -> list[Engine | str]:
        """The databases the listeners connect to (engines or URLs), one per shard in shard
        order — the order of ``NEXT_WORK``'s answers."""
        raise NotImplementedError

    def _async_listeners(self) -> _AsyncListeners:
        try:
            table = self._alisteners
        except AttributeError:
            table = self._alisteners = PerLoop()
        group = table.get()
        if group is None:
            infos = [_conninfo(source) for source in self._listen_sources()]
            group = table.setdefault(lambda: _AsyncListeners(infos))
        return group

    async def watch_work(self, watcher: WorkWatcher) -> WorkWatch:
        """Tell ``watcher`` of each work notify on this event loop (the notified worker
        class) and of each connection lost or made by its listeners (None: a notify may
        have been missed, look again). Starts the loop's listeners; waits for them up to
        ``_READY_WAIT``. Stop with :meth:`WorkWatch.close`."""
        group = self._async_listeners()
        group.watchers.add(watcher)
        await group.note([], time.monotonic() + _READY_WAIT)
        return WorkWatch(group, watcher)

    async def _close_async_listener(self) -> None:
        """Stop the running event loop's work listeners, if they were started."""
        table = getattr(self, "_alisteners", None)
        if table is not None:
            group = table.pop()
            if group is not None:
                await group.close()

    async def _await_work(
        self,
        worker_classes: str | Sequence[str],
        timeout: float,
        next_work_in: Callable[[list[str]], Awaitable[list[ShardNext]]],
    ) -> bool:
        """The asyncio wait; ``next_work_in`` runs the ``NEXT_WORK`` reads without blocking."""
        classes, timeout = _check_wait(worker_classes, timeout)
        start = time.monotonic()
        group: _AsyncListeners | None = None
        marks: list[_Mark] = []
        if timeout > 0 and self.settings.notify:
            group = self._async_listeners()
            marks = await group.note(classes, start + min(timeout, _READY_WAIT))
        answers = await next_work_in(classes)  # after LISTEN and the note: no lost wake-up
        plan = _plan(start, timeout, marks, answers)
        if plan is None:
            return True
        wake_at, due = plan
        left = wake_at - time.monotonic()
        if left <= 0:
            return due
        if group is None:
            await asyncio.sleep(left)
            return due
        moved = group.moved
        async with group.cond:
            try:
                await asyncio.wait_for(group.cond.wait_for(lambda: moved(marks)), left)
            except TimeoutError:
                return due
        return True


class _Shard(Protocol):
    """What a waiter listens on, per shard: the shard's engine (a :class:`Queue`'s)."""

    @property
    def engine(self) -> Engine: ...


class Waiter(_Listening):
    """``wait_for_work`` / ``wait_for_work_async`` (a mixin of :class:`~onceflow.queue.Queue`)."""

    connector: Connector

    if TYPE_CHECKING:  # the queue's (Queue.shards)

        def shards(self) -> Sequence[_Shard]: ...

    # Built lazily, keyed by pid: a forked child never uses its parent's listeners.
    _listener_pid: tuple[int, _Listeners] | None = None

    def _listen_sources(self) -> list[Engine | str]:
        return [shard.engine for shard in self.shards()]

    def _listeners(self) -> _Listeners:
        pid = os.getpid()
        current = self._listener_pid
        if current is None or current[0] != pid:
            # A racing first call in a child may build two; the loser's threads just stop.
            fresh = (pid, _Listeners([_conninfo(source) for source in self._listen_sources()]))
            current = self._listener_pid
            if current is None or current[0] != pid:
                self._listener_pid = current = fresh
            else:
                fresh[1].close()
        return current[1]

    def _next_work(
        self, classes: list[str], workspaces: WorkspaceScope | Iterable[str] | None = None
    ) -> list[ShardNext]:
        """Per shard: seconds (database clock) until work of ``classes`` (in ``workspaces``)
        may be claimable."""
        return run(self.connector, next_work_by_shard(classes, workspaces))

    def wait_for_work(
        self,
        worker_classes: str | Sequence[str],
        timeout: float,
        *,
        interrupt: threading.Event | None = None,
        workspaces: WorkspaceScope | Iterable[str] | None = None,
    ) -> bool:
        """Wait until a request of ``worker_classes`` may be claimable; never claims.

        True as soon as a NOTIFY for one of the classes arrives, work is due when
        called, or the next known event of those classes passes (a delayed row's
        ``run_after``, a running row's lease lapsing) — by the database clock. False
        after ``timeout`` seconds (0..3600), or when ``interrupt`` is set. A True may
        be spurious (another worker claimed first, the listener reconnected): claim
        and wait again. On a database split by workspace, over every shard (see the
        module): a shard that cannot be reached does not hold up the others.
        ``workspaces`` (a scoped worker's; None: any): work due in other workspaces is not
        due for this wait (a NOTIFY of the class still wakes it: claim and wait again).
        """
        classes, timeout = _check_wait(worker_classes, timeout)
        start = time.monotonic()
        group: _Listeners | None = None
        marks: list[_Mark] = []
        if timeout > 0 and self.settings.notify:
            group = self._listeners()
            marks = group.note(classes, start + min(timeout, _READY_WAIT))
        answers = self._next_work(classes, workspaces)  # after LISTEN and the note
        plan = _plan(start, timeout, marks, answers)
        if plan is None:
            return True
        wake_at, due = plan
        while True:
            if interrupt is not None and interrupt.is_set():
                return False
            left = wake_at - time.monotonic()
            if left <= 0:
                return due
            slice_ = left if interrupt is None else min(left, 0.05)
            if group is None:
                if interrupt is not None:
                    interrupt.wait(left)
                else:
                    time.sleep(slice_)
                continue
            with group.cond:
                if group.moved(marks):
                    return True
                group.cond.wait(slice_)
                if group.moved(marks):
                    return True

    # Same signature as AsyncWaiter.wait_for_work on purpose: this queue's asyncio form of it.
    async def wait_for_work_async(
        self,
        worker_classes: str | Sequence[str],
        timeout: float,
        *,
        workspaces: WorkspaceScope | Iterable[str] | None = None,
    ) -> bool:
        """:meth:`wait_for_work` for asyncio: listeners per event loop; cancel to stop.

        This queue's connections are sync: its query runs in a worker thread.
        :class:`~onceflow.AsyncQueue`'s ``wait_for_work`` runs it on its async pool.
        """

        async def next_work_in(classes: list[str]) -> list[ShardNext]:
            return await asyncio.to_thread(self._next_work, classes, workspaces)

        return await self._await_work(worker_classes, timeout, next_work_in)

    def close(self) -> None:
        """Stop this process's work listeners (started by the first wait_for_work)."""
        current = self._listener_pid
        if current is not None and current[0] == os.getpid():
            self._listener_pid = None
            current[1].close()

    async def aclose(self) -> None:
        """Stop the running event loop's work listeners (started by wait_for_work_async)."""
        await self._close_async_listener()


class AsyncWaiter(_Listening):
    """``wait_for_work`` as a coroutine (a mixin of :class:`~onceflow.AsyncQueue`).

    Its listener is per event loop (a task); ``AsyncQueue.aclose`` stops the running loop's.
    """

    aconnector: AsyncConnector

    def _listen_sources(self) -> list[Engine | str]:
        shards = getattr(self.aconnector, "shard_connectors", None)
        if shards is not None:  # a database split by workspace: one listener per shard
            return [str(shard.url) for shard in shards]
        url = getattr(self.aconnector, "url", None)
        return [str(url) if url is not None else self.settings.database_url]

    # Same signature as wait_for_work_async on purpose: the async queue's public method.
    async def wait_for_work(
        self,
        worker_classes: str | Sequence[str],
        timeout: float,
        *,
        workspaces: WorkspaceScope | Iterable[str] | None = None,
    ) -> bool:
        """Wait until a request of ``worker_classes`` may be claimable; never claims.

        True as soon as a NOTIFY for one of the classes arrives, work is due when
        called, or the next known event of those classes passes (a delayed row's
        ``run_after``, a running row's lease lapsing) — by the database clock. False
        after ``timeout`` seconds (0..3600). A True may be spurious (another worker
        claimed first, the listener reconnected): claim and wait again. Cancel to stop.
        ``workspaces`` (a scoped worker's; None: any): work due in other workspaces is
        not due for this wait (a NOTIFY of the class still wakes it: claim and wait again).
        """

        async def next_work_in(classes: list[str]) -> list[ShardNext]:
            return await arun(self.aconnector, next_work_by_shard(classes, workspaces))

        return await self._await_work(worker_classes, timeout, next_work_in)
