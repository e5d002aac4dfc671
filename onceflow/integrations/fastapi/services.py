"""What the endpoints use, built per process (:class:`OnceflowServices`), and the ``Depends``
providers for your own routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, FastAPI, Request

from onceflow.integrations.fastapi.auth import Authenticator, KeyAuth
from onceflow.integrations.fastapi.events import EventHub
from onceflow.integrations.fastapi.operators import OperatorAuth
from onceflow.integrations.fastapi.ratelimit import RateLimits
from onceflow.loops import PerLoop, PerProcess
from onceflow.models.requests import Dispatch, EnqueueResult
from onceflow.oplog import AsyncOpLog, OpLog
from onceflow.payloads import JSON
from onceflow.queue import AsyncQueue, Queue
from onceflow.queue.claim_line import ClaimLines
from onceflow.settings import Settings
from onceflow.tasks import Flow
from onceflow.tasks.config import check_broker


class OnceflowServices:
    """What the endpoints use: the flow, its queue (sync and async), an op log and the
    event hub.

    Built per process: the queues and op log are rebuilt after a fork, and nothing
    connects until first use. :meth:`lifespan` closes the event hub and this loop's
    connection pool of the async queue.
    """

    def __init__(
        self,
        flow: Flow,
        *,
        auth: Authenticator | None = None,
        settings: Settings | None = None,
    ) -> None:
        flow.check_declarations()  # a hand-off target that is no stage: refused at start-up
        self.flow = flow
        self.settings = settings or flow.settings
        self.auth: Authenticator = (
            auth if auth is not None else KeyAuth.from_settings(self.settings)
        )
        self._oplog: PerProcess[OpLog] = PerProcess(self._new_oplog)
        self._async_queue: PerProcess[AsyncQueue] = PerProcess(
            lambda: AsyncQueue.from_queue(self.queue)
        )
        self._async_oplog: PerProcess[AsyncOpLog] = PerProcess(
            lambda: AsyncOpLog(settings=self.settings, connector=self.async_queue.aconnector)
        )
        self.rate_limits = RateLimits.from_settings(self.settings)
        self.operator_auth = OperatorAuth.from_settings(self.settings)
        # Pruned of closed loops (their Redis sockets shut): a weak table kept every hub.
        self._hubs: PerLoop[EventHub] = PerLoop(EventHub.drop_sockets)
        self._lines: PerLoop[ClaimLines] = PerLoop()

    @property
    def queue(self) -> Queue:
        """This process's queue (the flow's)."""
        return self.flow.queue

    @property
    def oplog(self) -> OpLog:
        """This process's op log, on the queue's database (on each of its shards when the
        database is split by workspace)."""
        return self._oplog.get()

    def _new_oplog(self) -> OpLog:
        queue = self.queue
        if queue.shard_map is not None:
            return OpLog(settings=self.settings, shard_map=queue.shard_map)
        return OpLog(queue.engine, self.settings)

    @property
    def async_queue(self) -> AsyncQueue:
        """This process's :class:`~onceflow.AsyncQueue`: the flow's queue (its database or
        shard map, settings and stage declarations), on a psycopg async pool per event loop
        (per shard)."""
        return self._async_queue.get()

    @property
    def async_oplog(self) -> AsyncOpLog:
        """This process's :class:`~onceflow.AsyncOpLog`: on the async queue's connection pools
        (one per event loop, per shard) and one ``redis.asyncio`` client per event loop."""
        return self._async_oplog.get()

    # Flow.enqueue's signature on purpose: the asyncio entry point, delegating to AsyncQueue.
    async def enqueue(
        self,
        stage: str,
        workspace_id: str,
        job_id: str,
        branch_path: str = "",
        input: JSON = None,
        *,
        priority: int | None = None,
        strict: bool = False,
        worker_class: str | None = None,
    ) -> EnqueueResult:
        """:meth:`Flow.enqueue <onceflow.tasks.Flow.enqueue>` without blocking the event loop.

        The row is written on the async queue (the Flow's declarations resolve and
        validate it, as for ``Flow.enqueue``); once it is committed, the wake-up of a
        row this call created is sent by ``Flow.dispatch`` in a worker thread (kombu
        publishes blocking). A send that fails leaves the row for the sweeper, as
        ``Flow.enqueue`` does; a duplicate sends nothing.
        """
        result = await self.async_queue.enqueue(
            stage,
            workspace_id,
            job_id,
            branch_path,
            input,
            priority=priority,
            strict=strict,
            worker_class=worker_class,
        )
        await self.wake(result)
        return result

    async def wake(self, result: EnqueueResult) -> None:
        """Send the wake-up of a committed row if this call created it (``Flow.dispatch``,
        from a worker thread: kombu publishes blocking). A failed send marks the row
        unsent for the sweeper; a pull-worker class gets none."""
        if not result.created or result.worker_class in self.flow.pull_worker_classes:
            return  # (Flow.dispatch would return at once for a pull-worker class)
        item = Dispatch(result.request_id, result.stage, result.worker_class, result.workspace_id)
        await anyio.to_thread.run_sync(self.flow.dispatch, item)

    def event_hub(self) -> EventHub:
        """This event loop's hub of event streams: one Redis pub/sub connection for them all."""
        hub = self._hubs.get()
        if hub is None:
            st = self.settings
            hub = self._hubs.setdefault(
                lambda: EventHub(
                    st.redis_url,
                    max_streams=st.api_sse_max_streams,
                    max_per_key=st.api_sse_max_per_key,
                    queue_size=st.api_sse_queue_size,
                    ping_seconds=st.api_sse_keepalive_seconds,
                )
            )
        return hub

    def claim_lines(self) -> ClaimLines:
        """This event loop's lines of long-poll claimers, one per worker class: a claimable
        row wakes one waiter (:mod:`onceflow.queue.claim_line`)."""
        lines = self._lines.get()
        if lines is None:
            lines = self._lines.setdefault(lambda: ClaimLines(self.async_queue))
        return lines

    async def aclose(self) -> None:
        """Close this loop's event hub, claim lines, work listener and async queue's
        connection pool (the engine stays: shared per process)."""
        hub = self._hubs.pop()
        if hub is not None:
            await hub.aclose()
        lines = self._lines.pop()
        if lines is not None:
            await lines.aclose()
        await self.queue.aclose()  # this loop's work listener (long-poll claims)
        queue = self._async_queue.made()
        if queue is not None:
            await queue.aclose()  # this loop's pool; other loops close their own
        op_log = self._async_oplog.made()
        if op_log is not None:
            await op_log.aclose()

    def lifespan(self, app: FastAPI) -> AbstractAsyncContextManager[None]:
        """A FastAPI lifespan: ``FastAPI(lifespan=services.lifespan)``."""
        return _lifespan(self, app)


@asynccontextmanager
async def _lifespan(services: OnceflowServices, app: FastAPI) -> AsyncIterator[None]:
    app.state.onceflow = services
    # A Redis Cluster as the Celery broker is refused now, not at the first wake-up.
    check_broker(services.flow.app)
    # Built in the serving process (after any fork of the server); nothing connects yet.
    _ = services.queue, services.async_queue, services.oplog, services.async_oplog
    try:
        yield
    finally:
        await services.aclose()


# ---------------------------------------------------------- Depends providers


def get_services(request: Request) -> OnceflowServices:
    """The services the app's lifespan built (for your own routes)."""
    services = getattr(request.app.state, "onceflow", None)
    if not isinstance(services, OnceflowServices):
        raise RuntimeError("use FastAPI(lifespan=services.lifespan) to provide onceflow")
    return services


def get_flow(services: Annotated[OnceflowServices, Depends(get_services)]) -> Flow:
    """The Flow: ``flow.enqueue(...)`` in your own routes."""
    return services.flow


def get_queue(services: Annotated[OnceflowServices, Depends(get_services)]) -> Queue:
    """This process's :class:`~onceflow.Queue`."""
    return services.queue


def get_async_queue(services: Annotated[OnceflowServices, Depends(get_services)]) -> AsyncQueue:
    """This process's :class:`~onceflow.AsyncQueue` (``await queue.get(...)`` in ``async def``
    routes: nothing blocks the event loop)."""
    return services.async_queue


def get_oplog(services: Annotated[OnceflowServices, Depends(get_services)]) -> OpLog:
    """This process's :class:`~onceflow.oplog.OpLog`."""
    return services.oplog


FlowDep = Annotated[Flow, Depends(get_flow)]
QueueDep = Annotated[Queue, Depends(get_queue)]
AsyncQueueDep = Annotated[AsyncQueue, Depends(get_async_queue)]
OpLogDep = Annotated[OpLog, Depends(get_oplog)]
