"""``GET /metrics`` of ``onceflow api`` (an operator key with the viewer role), and the
middleware counting HTTP requests by route template.

The metrics are every process's (with ``PROMETHEUS_MULTIPROC_DIR``: workers, API
processes, exporters sharing the directory) plus the database's live counts, read at
scrape time (unless ``ONCEFLOW_METRICS_DATABASE=false``). Live gauges of pids this
process cannot see are kept (``ONCEFLOW_API_METRICS_PRUNE_DEAD_PIDS=true`` drops them).
Give Prometheus a viewer key (``authorization`` with ``credentials``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from onceflow.integrations.fastapi.operators import operator_route_class
from onceflow.metrics import record

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.app import OnceflowServices

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Route label of a request no route matched (404s, scanners): raw paths are never labels.
UNMATCHED = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HttpMetricsMiddleware:
    """Counts every HTTP request by route template, method and status, and its duration.

    The route is read after routing (``scope["route"].path``, e.g.
    ``/v1/workspaces/{ws}/requests``); ``unmatched`` when no route matched. A method
    outside the standard ones is ``OTHER``. A response never started counts as 500.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None)
            method = str(scope.get("method", "")).upper()
            record.http(
                template if isinstance(template, str) and template else UNMATCHED,
                method if method in _METHODS else "OTHER",
                status,
                time.perf_counter() - start,
            )


def metrics_router(services: OnceflowServices) -> APIRouter:
    """``GET /metrics`` guarded by an operator key with the viewer role."""
    from onceflow.metrics import registry

    router = APIRouter(route_class=operator_route_class(services))
    settings = services.settings
    # No pruning unless asked: the API may not see the workers' pids (another namespace).
    reg = registry(
        settings.database_url,
        database=settings.metrics_database,
        prune_dead=settings.api_metrics_prune_dead_pids,
        count_cap=settings.metrics_count_cap,
    )

    @router.get("/metrics", include_in_schema=False, operation_id="metrics")
    async def metrics() -> Response:
        # The database read and the files' merge block: off the event loop.
        body = await run_in_threadpool(generate_latest, reg)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router


def install_metrics(app: FastAPI, services: OnceflowServices) -> None:
    """Add ``GET /metrics`` and the HTTP request counting to ``app``."""
    app.include_router(metrics_router(services))
    app.add_middleware(HttpMetricsMiddleware)
