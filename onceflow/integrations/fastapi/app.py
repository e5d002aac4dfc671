"""The HTTP API: the ``/v1`` router and the app.

Its parts, each in its own module: ``services`` (built per process, and the ``Depends``
providers), ``responses`` (errors as JSON), ``guard`` (the key checked before the body is
parsed), ``routes_requests``, ``routes_claims`` and ``routes_ops``.

Order of checks on every request, each before the next runs:

1. body size and shape (ASGI middleware, before anything parses the body): 413, and 422
   for a JSON body nested too deep or holding NaN/Infinity;
2. the key (``Authorization: Bearer <key>``), then its scope against the
   workspace or worker class in the path: 401, 403 — before the body is parsed
   and before any lookup, so a refused caller learns nothing about ids;
3. validation of the body and parameters: 422;
4. the operation: 404, 409 (lease lost, op id conflict, input mismatch).

Every request, claim and op route is ``async def`` on the services'
:class:`~onceflow.AsyncQueue` and :class:`~onceflow.AsyncOpLog`: a request waiting on the
database holds no thread; the Celery wake-up (a blocking kombu publish) goes through a
worker thread.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Security
from fastapi.security import HTTPBearer

from onceflow.errors import InvalidRequest
from onceflow.integrations.fastapi.auth import Authenticator
from onceflow.integrations.fastapi.guard import _route_class, guarded_call
from onceflow.integrations.fastapi.http_errors import add_error_handlers
from onceflow.integrations.fastapi.limits import BODY_ENVELOPE_DEPTH, BodyLimitMiddleware
from onceflow.integrations.fastapi.metrics_routes import install_metrics
from onceflow.integrations.fastapi.openapi_choices import name_choices
from onceflow.integrations.fastapi.permit_routes import add_permit_routes
from onceflow.integrations.fastapi.probes import probes_router
from onceflow.integrations.fastapi.pull_routes import add_pull_routes
from onceflow.integrations.fastapi.responses import (
    AsciiJSONResponse,
    _responses,
    error_response,
    validation_response,
)
from onceflow.integrations.fastapi.routes_claims import _claim_routes
from onceflow.integrations.fastapi.routes_ops import REPLAY_HEADER, _op_routes
from onceflow.integrations.fastapi.routes_requests import _request_routes
from onceflow.integrations.fastapi.sdk_routes import create_sdk_router
from onceflow.integrations.fastapi.server_spans import ServerSpanMiddleware, native_telemetry_off
from onceflow.integrations.fastapi.services import (
    AsyncQueueDep,
    FlowDep,
    OnceflowServices,
    OpLogDep,
    QueueDep,
    get_async_queue,
    get_flow,
    get_oplog,
    get_queue,
    get_services,
)
from onceflow.settings import Settings, get_settings
from onceflow.tasks import Flow

# Moved out of this module (services.py, responses.py, guard.py, routes_*.py); importable here.
# Spelled out on purpose: the names older imports find here (the package re-exports them too).
__all__ = [
    "REPLAY_HEADER",
    "AsciiJSONResponse",
    "AsyncQueueDep",
    "FlowDep",
    "OnceflowServices",
    "OpLogDep",
    "QueueDep",
    "create_app",
    "create_router",
    "error_response",
    "get_async_queue",
    "get_flow",
    "get_oplog",
    "get_queue",
    "get_services",
    "guarded_call",
    "validation_response",
]

_bearer = HTTPBearer(auto_error=False, description="An API key or a worker key.")


# ----------------------------------------------------------------------- router


def create_router(
    flow: Flow | None = None,
    *,
    auth: Authenticator | None = None,
    settings: Settings | None = None,
    services: OnceflowServices | None = None,
) -> APIRouter:
    """The ``/v1`` routes for ``flow`` (or ``services``), guarded by ``auth``.

    ``auth`` defaults to the hashed keys of the settings (``ONCEFLOW_API_KEYS``,
    ``ONCEFLOW_WORKER_KEYS``). Mount it in your app with the body limit::

        services = OnceflowServices(flow)
        app = FastAPI(lifespan=services.lifespan)
        app.add_middleware(BodyLimitMiddleware, max_body_bytes=1 << 20, body_timeout=30)
        app.include_router(create_router(services=services))
        add_error_handlers(app)  # 404/405 (with a full Allow) in onceflow's error shape
    """
    if services is None:
        if flow is None:
            raise InvalidRequest("create_router needs flow= or services=")
        services = OnceflowServices(flow, auth=auth, settings=settings)
    svc = services
    router = APIRouter(
        prefix="/v1",
        route_class=_route_class(svc),
        dependencies=[Security(_bearer)],
        responses=_responses(400, 401, 403, 408, 413, 422, 429, 503),
    )
    _request_routes(router, svc)
    _claim_routes(router, svc)
    _op_routes(router, svc)
    add_pull_routes(router, svc, _responses(409, 413, 503))
    add_permit_routes(router, svc, _responses(409, 413, 503))
    return router


# -------------------------------------------------------------------------- app


def create_app(
    flow: Flow | None = None,
    *,
    auth: Authenticator | None = None,
    settings: Settings | None = None,
    title: str = "onceflow",
) -> FastAPI:
    """A FastAPI app serving the ``/v1`` API for ``flow`` (the ``ONCEFLOW_APP`` flow if None).

    Keys come from ``auth`` or the settings (hashed); with none configured every
    request is refused (401). Bodies over ``ONCEFLOW_API_MAX_BODY_BYTES`` get 413.
    """
    if flow is None:
        from onceflow.tasks.loader import load_app

        _, loaded = load_app((settings or get_settings()).app)
        if loaded is None:
            raise InvalidRequest("ONCEFLOW_APP names a Celery app, not an onceflow Flow")
        flow = loaded
    services = OnceflowServices(flow, auth=auth, settings=settings)
    app = FastAPI(
        title=title,
        version="1",
        lifespan=services.lifespan,
        description="Enqueue stages, claim them from pull workers, write ops once, follow "
        "commits. Every route but the probes (`/healthz`, `/readyz`) takes "
        "`Authorization: Bearer <key>`.",
        # No /docs or /redoc: FastAPI's pages load Swagger UI and ReDoc from a CDN, and a
        # script from another site on the dashboard's origin could read the operator key the
        # page keeps in sessionStorage. The schema stays at /openapi.json for any viewer.
        docs_url=None,
        redoc_url=None,
        **native_telemetry_off(),  # onceflow's own server span instead (server_spans.py)
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=services.settings.api_max_body_bytes,
        body_timeout=services.settings.api_body_timeout_seconds,
        max_json_depth=services.settings.max_payload_depth + BODY_ENVELOPE_DEPTH,
    )
    # Outermost (added last): a request refused by the body limit has its span too.
    app.add_middleware(ServerSpanMiddleware, record_path=services.settings.trace_workspace_ids)
    app.include_router(create_router(services=services))
    app.include_router(probes_router(services))  # /healthz, /readyz: no key, no rate limit
    install_metrics(app, services)
    from onceflow.integrations.fastapi.dashboard import create_dashboard_router
    from onceflow.integrations.fastapi.spend_routes import create_spend_router

    app.include_router(create_dashboard_router(services))  # /dashboard: docs/dashboard.md
    app.include_router(create_spend_router(services))  # /dashboard/api/spend: operator keys
    app.include_router(create_sdk_router())  # /sdk/index.js: the browser SDK (docs/browser.md)
    add_error_handlers(app)
    name_choices(app, flow, services.settings)  # stages, op types, providers: enums
    return app
