"""What the endpoints use, built per process (:class:`OnceflowServices`), and the ``Depends``
providers for your own routes.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from onceflow.integrations.fastapi.auth import Authenticator, KeyAuth
from onceflow.integrations.fastapi.events import EventHub
from onceflow.integrations.fastapi.operators import OperatorAuth
from onceflow.integrations.fastapi.ratelimit import RateLimits
from onceflow.oplog import OpLog
from onceflow.queue import Queue
from onceflow.settings import Settings
from onceflow.tasks import Flow


class OnceflowServices:
    """What the endpoints use: the flow, its queue, an op log and the event hub.

    Built per process: the queue and op log are rebuilt after a fork, and nothing
    connects until first use. :meth:`lifespan` closes the event hub.
    """

    def __init__(
        self,
        flow: Flow,
        *,
        auth: Authenticator | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.flow = flow
        self.settings = settings or flow.settings
        self.auth: Authenticator = (
            auth if auth is not None else KeyAuth.from_settings(self.settings)
        )
        self._oplog: tuple[int, OpLog] | None = None
        self._lock = threading.Lock()
        self.rate_limits = RateLimits.from_settings(self.settings)
        self.operator_auth = OperatorAuth.from_settings(self.settings)
        self._hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventHub] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def queue(self) -> Queue:
        """This process's queue (the flow's)."""
        return self.flow.queue

    @property
    def oplog(self) -> OpLog:
        """This process's op log, on the queue's engine."""
        pid = os.getpid()
        current = self._oplog
        if current is None or current[0] != pid:
            with self._lock:
                current = self._oplog
                if current is None or current[0] != pid:
                    current = self._oplog = (pid, OpLog(self.queue.engine, self.settings))
        return current[1]

    def event_hub(self) -> EventHub:
        """This event loop's hub of event streams: one Redis pub/sub connection for them all."""
        loop = asyncio.get_running_loop()
        hub = self._hubs.get(loop)
        if hub is None:
            st = self.settings
            hub = self._hubs[loop] = EventHub(
                st.redis_url,
                max_streams=st.api_sse_max_streams,
                max_per_key=st.api_sse_max_per_key,
                queue_size=st.api_sse_queue_size,
                ping_seconds=st.api_sse_keepalive_seconds,
            )
        return hub

    async def aclose(self) -> None:
        """Close this loop's event hub and work listener (the engine stays: shared per process)."""
        hub = self._hubs.pop(asyncio.get_running_loop(), None)
        if hub is not None:
            await hub.aclose()
        await self.queue.aclose()  # this loop's work listener (long-poll claims)

    def lifespan(self, app: FastAPI) -> AbstractAsyncContextManager[None]:
        """A FastAPI lifespan: ``FastAPI(lifespan=services.lifespan)``."""
        return _lifespan(self, app)


@asynccontextmanager
async def _lifespan(services: OnceflowServices, app: FastAPI) -> AsyncIterator[None]:
    app.state.onceflow = services
    # Built in the serving process (after any fork of the server); nothing connects yet.
    _ = services.queue, services.oplog
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


def get_oplog(services: Annotated[OnceflowServices, Depends(get_services)]) -> OpLog:
    """This process's :class:`~onceflow.oplog.OpLog`."""
    return services.oplog


FlowDep = Annotated[Flow, Depends(get_flow)]
QueueDep = Annotated[Queue, Depends(get_queue)]
OpLogDep = Annotated[OpLog, Depends(get_oplog)]
