"""``GET /metrics`` of ``onceflow api`` (an operator key with the viewer role), and the
middleware counting HTTP requests by route template.

The metrics are every process's (with ``PROMETHEUS_MULTIPROC_DIR``: workers, API
processes, exporters sharing the directory) plus the database's live counts, read at
scrape time (unless ``ONCEFLOW_METRICS_DATABASE=false``). Live gauges of pids this
process cannot see are kept (``ONCEFLOW_API_METRICS_PRUNE_DEAD_PIDS=true`` drops them).
Give Prometheus a viewer key (``authorization`` with ``credentials``).
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi import routing as fastapi_routing
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import compile_path

from onceflow.integrations.fastapi.guard import operator_route_class
from onceflow.metrics import record

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.services import OnceflowServices

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
    ``/v1/workspaces/{ws}/requests``), or, for a request refused before routing (413 by
    the body limit, installed outside this middleware), matched from its path;
    ``unmatched`` when no route matches. A method
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
            template = getattr(scope.get("route"), "path", None) or _template_of(scope)
            method = str(scope.get("method", "")).upper()
            record.http(
                template if isinstance(template, str) and template else UNMATCHED,
                method if method in _METHODS else "OTHER",
                status,
                time.perf_counter() - start,
            )


_Table = list[tuple["re.Pattern[str]", frozenset[str], str]]
_tables: weakref.WeakKeyDictionary[Any, _Table] = weakref.WeakKeyDictionary()


def _route_table(app: Any) -> _Table:
    """(path regex, methods, template) of every HTTP route of ``app``, built once."""
    table = _tables.get(app)
    if table is None:
        routes: Any = getattr(app, "routes", ())
        flatten = getattr(fastapi_routing, "iter_route_contexts", None)  # included routers
        table = []
        for route in flatten(routes) if flatten is not None else routes:
            path, methods = getattr(route, "path", None), getattr(route, "methods", None)
            if isinstance(path, str) and methods:
                table.append((compile_path(path)[0], frozenset(methods), path))
        _tables[app] = table
    return table


def _template_of(scope: Scope) -> str | None:
    """The route template of a request refused before routing (e.g. 413 by the body limit).

    Starlette sets ``scope["app"]`` before its middleware runs; the first route whose path
    and method match gives its template. None when none does (404s, scanners)."""
    app = scope.get("app")
    if app is None:
        return None
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    if root and path.startswith(root + "/"):  # as Starlette's routing sees it
        path = path[len(root) :]
    method = scope.get("method")
    for regex, methods, template in _route_table(app):
        if method in methods and regex.match(path):
            return template
    return None


def metrics_router(services: OnceflowServices) -> APIRouter:
    """``GET /metrics`` guarded by an operator key with the viewer role."""
    from onceflow.metrics import registry
    from onceflow.shards import configured_map

    router = APIRouter(route_class=operator_route_class(services))
    settings = services.settings
    # No pruning unless asked: the API may not see the workers' pids (another namespace).
    reg = registry(
        # every shard of a database split by workspace
        list(configured_map(settings).urls) if settings.metrics_database else None,
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
