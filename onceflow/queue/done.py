"""Waiting for a request to end, woken by the database (mixins of both queue APIs).

A request that reaches a terminal status — succeeded, dead or cancelled — sends
``NOTIFY onceflow_done, '<request id>'`` from the statement that ended it (a trigger,
migration 0010): delivered when that transaction commits, never when it rolls back. A wait:

1. checks its arguments (before any SQL) and reads the row: :class:`NotFound` if there is
   none, the row itself if it has ended already;
2. LISTENs on ``onceflow_done`` on the database that holds the row (its workspace's shard),
   then reads the row again — an end committed between the first read and the LISTEN is
   seen by this read, one committed after it by a notify: no lost wake-up;
3. sleeps until a notify names its request (then reads the row again), at most
   ``_RECHECK`` seconds, and never past its deadline: :class:`WaitTimeout` then.

The LISTEN connection is the wait's own, closed when it returns. A connection that cannot
be made or is lost makes the wait read the row every ``_POLL`` seconds instead (trying to
LISTEN again each time), so it still ends by its deadline. :class:`~onceflow.Queue` waits in
the calling thread; :class:`~onceflow.AsyncQueue`'s ``wait`` is a coroutine that holds no
thread (its reads on the async pool, its LISTEN on an async connection).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import psycopg

from onceflow.connector import AsyncConnector, Connector, arun, conninfo, run
from onceflow.errors import InvalidRequest, WaitTimeout
from onceflow.models.requests import Request
from onceflow.models.status import Status
from onceflow.queue.reads import ReadOps, request_key
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


def _names(payloads: list[str], request_id: str) -> bool:
    return request_id in payloads


class DoneWaiter:
    """``wait``: a request's end, woken by ``onceflow_done`` (a mixin of
    :class:`~onceflow.Queue`)."""

    settings: Settings
    connector: Connector
    shard_map: ShardMap | None

    def _read(self, request_id: str, workspace_id: str | None) -> Request:
        return run(self.connector, ReadOps.get.steps(self, request_id, workspace_id=workspace_id))

    def _done_conninfo(self, workspace_id: str) -> str:
        if self.shard_map is None:
            engine = getattr(self, "engine", None)
            if engine is not None:
                return conninfo(engine.url.render_as_string(hide_password=False))
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

    def wait(self, request_id: str, *, timeout: float, workspace_id: str | None = None) -> Request:
        """The request once it has ended — succeeded, dead or cancelled — read after the
        commit that ended it; :class:`NotFound` if there is no such request;
        :class:`WaitTimeout` (its ``request``: the row as last read) if it has not ended
        within ``timeout`` seconds (0 < timeout <= 3600). Woken by the database's NOTIFY,
        not by polling; on a database split by workspace, on the row's shard."""
        seconds = check_wait_timeout(timeout)
        request_key(request_id, workspace_id)
        deadline = time.monotonic() + seconds
        request = self._read(request_id, workspace_id)
        if ended(request):
            return request
        info = self._done_conninfo(request.workspace_id)
        conn = self._listen(info)
        try:
            while True:
                request = self._read(request_id, request.workspace_id)  # after LISTEN
                if ended(request):
                    return request
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


class AsyncDoneWaiter:
    """``wait`` as a coroutine (a mixin of :class:`~onceflow.AsyncQueue`): holds no thread."""

    settings: Settings
    aconnector: AsyncConnector
    shard_map: ShardMap | None

    async def _aread(self, request_id: str, workspace_id: str | None) -> Request:
        steps = ReadOps.get.steps(self, request_id, workspace_id=workspace_id)
        return await arun(self.aconnector, steps)

    def _done_conninfo(self, workspace_id: str) -> str:
        if self.shard_map is None:
            url = getattr(self.aconnector, "url", None)
            if url is not None:
                return conninfo(str(url))
        return _listen_info(self.settings, self.shard_map, workspace_id)

    async def _alisten(self, info: str) -> psycopg.AsyncConnection[Any] | None:
        try:
            conn = await psycopg.AsyncConnection.connect(info, autocommit=True, connect_timeout=10)
        except (psycopg.Error, OSError) as exc:
            log.info("wait: cannot LISTEN (%s); reading the row every %gs", exc, _POLL)
            return None
        try:
            await conn.execute(f"LISTEN {DONE_CHANNEL}")
        except (psycopg.Error, OSError) as exc:
            await conn.close()
            log.info("wait: cannot LISTEN (%s); reading the row every %gs", exc, _POLL)
            return None
        return conn

    async def wait(
        self, request_id: str, *, timeout: float, workspace_id: str | None = None
    ) -> Request:
        """:meth:`Queue.wait <onceflow.queue.done.DoneWaiter.wait>` on asyncio: the same
        answers and errors; cancel to stop."""
        seconds = check_wait_timeout(timeout)
        request_key(request_id, workspace_id)
        deadline = time.monotonic() + seconds
        request = await self._aread(request_id, workspace_id)
        if ended(request):
            return request
        info = self._done_conninfo(request.workspace_id)
        conn = await self._alisten(info)
        try:
            while True:
                request = await self._aread(request_id, request.workspace_id)  # after LISTEN
                if ended(request):
                    return request
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(request_id, seconds, request)
                if conn is None:
                    await asyncio.sleep(min(left, _POLL))
                    conn = await self._alisten(info)
                    continue
                try:
                    await self._auntil_named(conn, request_id, min(left, _RECHECK))
                except (psycopg.Error, OSError) as exc:
                    log.info("wait: LISTEN connection lost (%s); reading the row", exc)
                    await conn.close()
                    conn = None
        finally:
            if conn is not None:
                await conn.close()

    @staticmethod
    async def _auntil_named(
        conn: psycopg.AsyncConnection[Any], request_id: str, seconds: float
    ) -> None:
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            payloads = [n.payload async for n in conn.notifies(timeout=left, stop_after=1)]
            if _names(payloads, request_id):
                return
