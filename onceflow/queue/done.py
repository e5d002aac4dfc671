"""Waiting for a request to end, woken by the database (mixins of both queue APIs).

A request someone waits for sends ``NOTIFY onceflow_done, '<request id>'`` from the
statement that ends it — succeeded, dead or cancelled (a trigger, migration 0010, on rows
marked ``waited``): delivered when that transaction commits, never when it rolls back. A
request nobody waits for sends nothing, so completions pay no notification. A wait checks
its arguments before any SQL, then:

1. LISTENs on ``onceflow_done`` on the database that holds the row (its workspace's shard;
   a sharded queue given no workspace reads the row first to learn it),
2. marks the row ``waited`` and reads it in one statement — :class:`NotFound` if there is
   none, the row if it has ended — after the LISTEN, so an end committed before the mark
   is read by it and one committed after it sees the mark and sends the notify: no lost
   wake-up;
3. sleeps until a notify names its request, then reads the row again; at most ``_RECHECK``
   seconds at a time, and never past its deadline: :class:`WaitTimeout` then.

Without a LISTEN connection (it cannot be made, or was lost) a wait reads the row every
``_POLL`` seconds instead, so it still ends by its deadline.

:class:`~onceflow.Queue` waits in the calling thread on a LISTEN connection of its own,
closed when it returns. :class:`~onceflow.AsyncQueue`'s ``wait`` is a coroutine that holds
no thread, and its waits share one LISTEN connection per database and event loop
(:class:`_DoneHub`, reconnecting with backoff), so many waiting HTTP reads cost one
connection, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

import psycopg

from onceflow.connector import AsyncConnector, Connector, Steps, arun, conninfo, run
from onceflow.errors import InvalidRequest, WaitTimeout
from onceflow.loops import PerLoop
from onceflow.models.requests import Request
from onceflow.models.status import Status
from onceflow.queue import sql
from onceflow.queue.reads import ReadOps, one, request_key
from onceflow.settings import Settings
from onceflow.shards import ShardMap

log = logging.getLogger("onceflow.queue.done")

#: The channel of the NOTIFY a request sends when it ends (payload: its request id).
DONE_CHANNEL = "onceflow_done"
#: The longest a single wait may be asked to wait, in seconds.
WAIT_RESULT_MAX_SECONDS = 3600.0
#: The statuses a wait returns on.
TERMINAL = frozenset({Status.SUCCEEDED, Status.DEAD, Status.CANCELLED})
#: How often a wait without its LISTEN connection reads the row (and tries to LISTEN again).
_POLL = 1.0
#: The longest a wait trusts its LISTEN connection alone before it reads the row again.
_RECHECK = 30.0
#: Reconnect backoff of an async wait's lost LISTEN connection.
_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 2.0


def check_wait_timeout(timeout: object) -> float:
    """``timeout`` as seconds, or :class:`InvalidRequest`: a finite number in (0, 3600]."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= WAIT_RESULT_MAX_SECONDS
    ):
        raise InvalidRequest(
            f"timeout must be a number of seconds in (0, {WAIT_RESULT_MAX_SECONDS:g}]"
        )
    return float(timeout)


def ended(request: Request) -> bool:
    """Whether ``request`` is in a terminal status (succeeded, dead, cancelled)."""
    return request.status in TERMINAL


def _listen_info(settings: Settings, shard_map: ShardMap | None, workspace_id: str) -> str:
    """The libpq connection string of the database holding ``workspace_id``'s rows."""
    if shard_map is not None:
        return conninfo(shard_map.url_of(workspace_id))
    return conninfo(settings.database_url)


def _marked_read(queue: ReadOps, request_id: str, workspace_id: str | None) -> Steps[Request]:
    """Mark the row waited for (its end then sends the notify) and read it, in one statement;
    a row ended already, or marked by another wait, is read as it is."""
    row = yield from one(sql.WAIT_MARK, request_key(request_id, workspace_id))
    if row is not None:
        return Request.from_row(row)
    return (yield from ReadOps.get.steps(queue, request_id, workspace_id=workspace_id))


def _names(payloads: list[str], request_id: str) -> bool:
    return request_id in payloads


class DoneWaiter:
    """``wait``: a request's end, woken by ``onceflow_done`` (a mixin of
    :class:`~onceflow.Queue`)."""

    settings: Settings
    connector: Connector
    shard_map: ShardMap | None

    def _read(self, request_id: str, workspace_id: str | None) -> Request:
        return run(self.connector, _marked_read(self, request_id, workspace_id))  # type: ignore[arg-type]

    def _done_conninfo(self, workspace_id: str | None) -> str | None:
        """The database holding ``workspace_id``'s rows; None: unknown (sharded, no workspace)."""
        if self.shard_map is None:
            engine = getattr(self, "engine", None)
            if engine is not None:
                return conninfo(engine.url.render_as_string(hide_password=False))
            return conninfo(self.settings.database_url)
        if workspace_id is None:
            return None
        return _listen_info(self.settings, self.shard_map, workspace_id)

    def _listen(self, info: str) -> psycopg.Connection[Any] | None:
        try:
            conn = psycopg.connect(info, autocommit=True, connect_timeout=10)
        except (psycopg.Error, OSError) as exc:
            log.info("wait: cannot LISTEN (%s); reading the row every %gs", exc, _POLL)
            return None
        try:
            conn.execute(f"LISTEN {DONE_CHANNEL}")
        except (psycopg.Error, OSError) as exc:
            conn.close()
            log.info("wait: cannot LISTEN (%s); reading the row every %gs", exc, _POLL)
            return None
        return conn

    # Twin of the asyncio wait below on purpose: each step is I/O (a connection here, a hub there).
    def wait(self, request_id: str, *, timeout: float, workspace_id: str | None = None) -> Request:
        """The request once it has ended — succeeded, dead or cancelled — read after the
        commit that ended it; :class:`NotFound` if there is no such request;
        :class:`WaitTimeout` (its ``request``: the row as last read) if it has not ended
        within ``timeout`` seconds (0 < timeout <= 3600). Woken by the database's NOTIFY,
        not by polling; on a database split by workspace, on the row's shard."""
        seconds = check_wait_timeout(timeout)
        request_key(request_id, workspace_id)
        deadline = time.monotonic() + seconds
        info = self._done_conninfo(workspace_id)
        if info is None:  # a sharded queue without the workspace: its row says which shard
            first = self._read(request_id, None)
            if ended(first):
                return first
            workspace_id = first.workspace_id
            info = self._done_conninfo(workspace_id)
            assert info is not None  # noqa: S101 - the workspace is known now
        conn = self._listen(info)
        try:
            while True:
                request = self._read(request_id, workspace_id)  # after LISTEN
                if ended(request):
                    return request
                workspace_id = request.workspace_id
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(request_id, seconds, request)
                if conn is None:
                    time.sleep(min(left, _POLL))
                    conn = self._listen(info)
                    continue
                try:
                    self._until_named(conn, request_id, min(left, _RECHECK))
                except (psycopg.Error, OSError) as exc:
                    log.info("wait: LISTEN connection lost (%s); reading the row", exc)
                    conn.close()
                    conn = None
        finally:
            if conn is not None:
                conn.close()

    @staticmethod
    def _until_named(conn: psycopg.Connection[Any], request_id: str, seconds: float) -> None:
        """Return when a notify names ``request_id`` or after ``seconds``."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            payloads = [n.payload for n in conn.notifies(timeout=left, stop_after=1)]
            if _names(payloads, request_id):
                return


class _DoneHub:
    """One LISTEN connection on one database, shared by every async wait of an event loop.

    A wait watches its request id (:meth:`watch`: an :class:`asyncio.Event`, set by each notify
    naming it) before it reads the row. The connection coming up or going down sets every
    watcher's event (a notify may have been missed): their waits read the row again.
    """

    def __init__(self, info: str) -> None:
        self._info = info
        self.ready = False  # LISTENing now
        self._up = asyncio.Event()
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._task = asyncio.get_running_loop().create_task(self._run(), name="onceflow-done")

    def watch(self, request_id: str) -> asyncio.Event:
        event = asyncio.Event()
        self._watchers.setdefault(request_id, set()).add(event)
        return event

    def unwatch(self, request_id: str, event: asyncio.Event) -> None:
        events = self._watchers.get(request_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self._watchers[request_id]

    async def until_ready(self, seconds: float) -> bool:
        """Whether it LISTENs, waiting up to ``seconds`` for a connection being made."""
        if not self.ready and seconds > 0 and not self._task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), seconds)
        return self.ready

    def _wake_all(self) -> None:
        for events in self._watchers.values():
            for event in events:
                event.set()

    async def _run(self) -> None:
        backoff = _BACKOFF_MIN
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._info, autocommit=True, connect_timeout=10
                )
                async with conn:
                    await conn.execute(f"LISTEN {DONE_CHANNEL}")
                    self.ready = True
                    self._up.set()
                    self._wake_all()  # ends committed while it was down: read again
                    backoff = _BACKOFF_MIN
                    async for note in conn.notifies():
                        for event in self._watchers.get(note.payload, ()):
                            event.set()
            except (psycopg.Error, OSError) as exc:
                log.info(
                    "wait: LISTEN %s lost or refused (%s); waits read their rows", DONE_CHANNEL, exc
                )
            finally:
                if self.ready:
                    self._wake_all()
                self.ready = False
                self._up.clear()
            await asyncio.sleep(backoff)
            backoff = min(_BACKOFF_MAX, backoff * 2)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class AsyncDoneWaiter:
    """``wait`` as a coroutine (a mixin of :class:`~onceflow.AsyncQueue`): holds no thread.

    Its waits share one LISTEN connection per database (shard) and event loop, started by
    the first wait; ``AsyncQueue.aclose`` stops the running loop's.
    """

    settings: Settings
    aconnector: AsyncConnector
    shard_map: ShardMap | None
    _done_hubs: PerLoop[dict[str, _DoneHub]]

    async def _aread(self, request_id: str, workspace_id: str | None) -> Request:
        steps = _marked_read(self, request_id, workspace_id)  # type: ignore[arg-type]
        return await arun(self.aconnector, steps)

    def _done_conninfo(self, workspace_id: str | None) -> str | None:
        """The database holding ``workspace_id``'s rows; None: unknown (sharded, no workspace)."""
        if self.shard_map is None:
            url = getattr(self.aconnector, "url", None)
            return conninfo(str(url) if url is not None else self.settings.database_url)
        if workspace_id is None:
            return None
        return _listen_info(self.settings, self.shard_map, workspace_id)

    def _done_hub(self, info: str) -> _DoneHub:
        try:
            table = self._done_hubs
        except AttributeError:
            table = self._done_hubs = PerLoop()
        hubs = table.setdefault(dict)
        hub = hubs.get(info)
        if hub is None:
            hub = hubs[info] = _DoneHub(info)
        return hub

    async def _close_done_hubs(self) -> None:
        """Stop the running event loop's LISTEN connections of waits, if any were started."""
        table = getattr(self, "_done_hubs", None)
        hubs = table.pop() if table is not None else None
        for hub in (hubs or {}).values():
            await hub.close()

    # Twin of the sync wait above on purpose: each step is I/O, awaited here.
    async def wait(
        self, request_id: str, *, timeout: float, workspace_id: str | None = None
    ) -> Request:
        """:meth:`Queue.wait <onceflow.queue.done.DoneWaiter.wait>` on asyncio: the same
        answers and errors; cancel to stop."""
        seconds = check_wait_timeout(timeout)
        request_key(request_id, workspace_id)
        deadline = time.monotonic() + seconds
        info = self._done_conninfo(workspace_id)
        if info is None:  # a sharded queue without the workspace: its row says which shard
            first = await self._aread(request_id, None)
            if ended(first):
                return first
            workspace_id = first.workspace_id
            info = self._done_conninfo(workspace_id)
            assert info is not None  # noqa: S101 - the workspace is known now
        hub = self._done_hub(info)
        woken = hub.watch(request_id)
        try:
            await hub.until_ready(min(seconds, _POLL))
            while True:
                woken.clear()
                request = await self._aread(request_id, workspace_id)  # after LISTEN
                if ended(request):
                    return request
                workspace_id = request.workspace_id
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(request_id, seconds, request)
                slice_ = min(left, _RECHECK if hub.ready else _POLL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), slice_)
        finally:
            hub.unwatch(request_id, woken)
