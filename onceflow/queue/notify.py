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
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import Engine

from onceflow.connector import (
    AsyncConnector,
    Connector,
    Steps,
    arun,
    conninfo,
    on_every_shard,
    one_row,
    retrying,
    run,
)
from onceflow.errors import InvalidRequest
from onceflow.ids import check_worker_class
from onceflow.loops import PerLoop
from onceflow.queue.sql import NOTIFY_CHANNEL, N
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


def next_work(classes: list[str]) -> Steps[float | None]:
    """Seconds (database clock) until work of ``classes`` may be claimable; None: unknown.

    A read: repeated once on a fresh connection after a lost one.
    """
    params = {"worker_classes": classes}
    rows = yield from on_every_shard(lambda: retrying(lambda: one_row(N.NEXT_WORK, params)))
    known = [float(r["next_in"]) for r in rows if r["next_in"] is not None]
    return min(known) if known else None  # the earliest over the shards


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
    """One LISTEN connection in a daemon thread; fans notifies out to waiters."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self.cond = threading.Condition()
        self.counts: Counter[str] = Counter()  # notifies seen per worker class
        self.epoch = 0  # bumped whenever the connection is lost (notifies may be missed)
        self.ready = False  # LISTENing now
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread = threading.Thread(target=self._run, name="onceflow-listen", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = _BACKOFF_MIN
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=10) as conn:
                    self._conn = conn
                    conn.execute(f"LISTEN {CHANNEL}")
                    with self.cond:
                        self.ready = True
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
                log.warning("work listener lost its connection (%s); reconnecting", exc)
            finally:
                self._conn = None
                with self.cond:
                    if self.ready:
                        self.epoch += 1  # wake every waiter: a notify may have been missed
                    self.ready = False
                    self.cond.notify_all()
            self._stop.wait(backoff)
            backoff = min(_BACKOFF_MAX, backoff * 2)

    def wait_ready(self, deadline: float) -> bool:
        with self.cond:
            while not self.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self.cond.wait(left)
            return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_TICK * 4)


class _AsyncListener:
    """The asyncio twin of :class:`_Listener`: a task on one event loop."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self.cond = asyncio.Condition()
        self.counts: Counter[str] = Counter()
        self.epoch = 0
        self.ready = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="onceflow-listen")

    async def _run(self) -> None:
        backoff = _BACKOFF_MIN
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, connect_timeout=10
                )
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    async with self.cond:
                        self.ready = True
                        self.cond.notify_all()
                    backoff = _BACKOFF_MIN
                    async for note in conn.notifies():
                        async with self.cond:
                            self.counts[note.payload] += 1
                            self.cond.notify_all()
            except (psycopg.Error, OSError) as exc:
                log.warning("async work listener lost its connection (%s); reconnecting", exc)
            finally:
                async with self.cond:
                    if self.ready:
                        self.epoch += 1
                    self.ready = False
                    self.cond.notify_all()
            await asyncio.sleep(backoff)
            backoff = min(_BACKOFF_MAX, backoff * 2)

    async def wait_ready(self, deadline: float) -> bool:
        async with self.cond:
            while not self.ready:
                left = deadline - time.monotonic()
                if left <= 0 or self._task.done():
                    return False
                try:
                    await asyncio.wait_for(self.cond.wait(), left)
                except TimeoutError:
                    return False
            return True

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


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


def _changed(counts: Counter[str], before: dict[str, int], epoch: int, now_epoch: int) -> bool:
    return now_epoch != epoch or any(counts[c] != n for c, n in before.items())


class _Listening:
    """What both queue APIs' asyncio waits share: one listener per event loop, the wait."""

    settings: Settings

    # A plain table pruned of closed loops: a weak one never let go (the task holds its loop).
    _alisteners: PerLoop[_AsyncListener]

    def _listen_source(self) -> Engine | str:
        """The database the listener connects to (an engine or a URL)."""
        raise NotImplementedError

    def _async_listener(self) -> _AsyncListener:
        try:
            table = self._alisteners
        except AttributeError:
            table = self._alisteners = PerLoop()
        listener = table.get()
        if listener is None:
            conninfo = _conninfo(self._listen_source())
            listener = table.setdefault(lambda: _AsyncListener(conninfo))
        return listener

    async def _close_async_listener(self) -> None:
        """Stop the running event loop's work listener, if one was started."""
        table = getattr(self, "_alisteners", None)
        if table is not None:
            listener = table.pop()
            if listener is not None:
                await listener.close()

    async def _await_work(
        self,
        worker_classes: str | Sequence[str],
        timeout: float,
        next_work_in: Callable[[list[str]], Awaitable[float | None]],
    ) -> bool:
        """The asyncio wait; ``next_work_in`` runs the ``NEXT_WORK`` read without blocking."""
        classes, timeout = _check_wait(worker_classes, timeout)
        start = time.monotonic()
        listener_lost = False
        listener: _AsyncListener | None = None
        if timeout > 0 and self.settings.notify:
            listener = self._async_listener()
            if not await listener.wait_ready(start + min(timeout, _READY_WAIT)):
                listener = None  # not LISTENing (yet): look again within _READY_WAIT
                listener_lost = True
        if listener is not None:
            epoch = listener.epoch
            before = {c: listener.counts[c] for c in classes}
        next_in = await next_work_in(classes)  # after LISTEN and the note: no lost wake-up
        if next_in is not None and next_in <= 0:
            return True
        wake_at, due = _wake_at(start, timeout, next_in, degraded=listener_lost)
        left = wake_at - time.monotonic()
        if left <= 0:
            return due
        if listener is None:
            await asyncio.sleep(left)
            return due
        cond = listener.cond

        def woken() -> bool:
            return _changed(listener.counts, before, epoch, listener.epoch)

        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(woken), left)
            except TimeoutError:
                return due
        return True


class Waiter(_Listening):
    """``wait_for_work`` / ``wait_for_work_async`` (a mixin of :class:`~onceflow.queue.Queue`)."""

    connector: Connector

    if TYPE_CHECKING:  # the queue's (Queue.engine)

        @property
        def engine(self) -> Engine: ...

    # Built lazily, keyed by pid: a forked child never uses its parent's listener.
    _listener_pid: tuple[int, _Listener] | None = None

    def _listen_source(self) -> Engine | str:
        return self.engine

    def _listener(self) -> _Listener:
        pid = os.getpid()
        current = self._listener_pid
        if current is None or current[0] != pid:
            # A racing first call in a child may build two; the loser's thread just stops.
            fresh = (pid, _Listener(_conninfo(self.engine)))
            current = self._listener_pid
            if current is None or current[0] != pid:
                self._listener_pid = current = fresh
            else:
                fresh[1].close()
        return current[1]

    def _next_work(self, classes: list[str]) -> float | None:
        """Seconds (database clock) until work of ``classes`` may be claimable; None: unknown."""
        return run(self.connector, next_work(classes))

    def wait_for_work(
        self,
        worker_classes: str | Sequence[str],
        timeout: float,
        *,
        interrupt: threading.Event | None = None,
    ) -> bool:
        """Wait until a request of ``worker_classes`` may be claimable; never claims.

        True as soon as a NOTIFY for one of the classes arrives, work is due when
        called, or the next known event of those classes passes (a delayed row's
        ``run_after``, a running row's lease lapsing) — by the database clock. False
        after ``timeout`` seconds (0..3600), or when ``interrupt`` is set. A True may
        be spurious (another worker claimed first, the listener reconnected): claim
        and wait again.
        """
        classes, timeout = _check_wait(worker_classes, timeout)
        start = time.monotonic()
        listener_lost = False
        if timeout == 0 or not self.settings.notify:
            listener = None
        else:
            listener = self._listener()
            if not listener.wait_ready(start + min(timeout, _READY_WAIT)):
                listener = None  # not LISTENing (yet): look again within _READY_WAIT
                listener_lost = True
        if listener is not None:
            with listener.cond:
                epoch = listener.epoch
                before = {c: listener.counts[c] for c in classes}
        next_in = self._next_work(classes)  # after LISTEN and the note: no lost wake-up
        if next_in is not None and next_in <= 0:
            return True
        wake_at, due = _wake_at(start, timeout, next_in, degraded=listener_lost)
        while True:
            if interrupt is not None and interrupt.is_set():
                return False
            left = wake_at - time.monotonic()
            if left <= 0:
                return due
            slice_ = left if interrupt is None else min(left, 0.05)
            if listener is None:
                if interrupt is not None:
                    interrupt.wait(left)
                else:
                    time.sleep(slice_)
                continue
            with listener.cond:
                if _changed(listener.counts, before, epoch, listener.epoch):
                    return True
                listener.cond.wait(slice_)
                if _changed(listener.counts, before, epoch, listener.epoch):
                    return True

    async def wait_for_work_async(
        self, worker_classes: str | Sequence[str], timeout: float
    ) -> bool:
        """:meth:`wait_for_work` for asyncio: one listener per event loop; cancel to stop.

        This queue's connections are sync: its one query runs in a worker thread.
        :class:`~onceflow.AsyncQueue`'s ``wait_for_work`` runs it on its async pool.
        """

        async def next_work_in(classes: list[str]) -> float | None:
            return await asyncio.to_thread(self._next_work, classes)

        return await self._await_work(worker_classes, timeout, next_work_in)

    def close(self) -> None:
        """Stop this process's work listener (started by the first wait_for_work)."""
        current = self._listener_pid
        if current is not None and current[0] == os.getpid():
            self._listener_pid = None
            current[1].close()

    async def aclose(self) -> None:
        """Stop the running event loop's work listener (started by wait_for_work_async)."""
        await self._close_async_listener()


class AsyncWaiter(_Listening):
    """``wait_for_work`` as a coroutine (a mixin of :class:`~onceflow.AsyncQueue`).

    Its listener is per event loop (a task); ``AsyncQueue.aclose`` stops the running loop's.
    """

    aconnector: AsyncConnector

    def _listen_source(self) -> Engine | str:
        url = getattr(self.aconnector, "url", None)
        return str(url) if url is not None else self.settings.database_url

    async def wait_for_work(self, worker_classes: str | Sequence[str], timeout: float) -> bool:
        """Wait until a request of ``worker_classes`` may be claimable; never claims.

        True as soon as a NOTIFY for one of the classes arrives, work is due when
        called, or the next known event of those classes passes (a delayed row's
        ``run_after``, a running row's lease lapsing) — by the database clock. False
        after ``timeout`` seconds (0..3600). A True may be spurious (another worker
        claimed first, the listener reconnected): claim and wait again. Cancel to stop.
        """

        async def next_work_in(classes: list[str]) -> float | None:
            return await arun(self.aconnector, next_work(classes))

        return await self._await_work(worker_classes, timeout, next_work_in)
