"""onceflow over HTTP with FastAPI (the ``fastapi`` extra): enqueue, pull workers, ops, events.

::

    from onceflow.integrations.fastapi import create_app
    from myproject.stages import flow

    app = create_app(flow=flow)     # uvicorn myproject.api:app, or `onceflow api`

or, inside your own app::

    services = OnceflowServices(flow)
    app = FastAPI(lifespan=services.lifespan)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=1 << 20)
    app.add_middleware(ServerSpanMiddleware)  # a span per request, in the caller's trace
    app.include_router(create_router(services=services))
    add_error_handlers(app)         # 400/404/405/422 in onceflow's error shape

    @app.post("/signup")
    def signup(flow: FlowDep) -> dict: ...
"""

from onceflow.integrations.fastapi.app import (
    REPLAY_HEADER,
    AsyncQueueDep,
    FlowDep,
    OnceflowServices,
    OpLogDep,
    QueueDep,
    create_app,
    create_router,
    error_response,
    get_async_queue,
    get_flow,
    get_oplog,
    get_queue,
    get_services,
)
from onceflow.integrations.fastapi.auth import (
    Authenticator,
    KeyAuth,
    Principal,
    PrincipalDep,
    get_principal,
    hash_key,
    new_key,
)
from onceflow.integrations.fastapi.http_errors import add_error_handlers
from onceflow.integrations.fastapi.limits import BodyLimitMiddleware
from onceflow.integrations.fastapi.server_spans import ServerSpanMiddleware
from onceflow.worker_tokens import mint_worker_token

# Spelled out on purpose: the package's public names (app.py keeps its own for older imports).
__all__ = [
    "REPLAY_HEADER",
    "AsyncQueueDep",
    "Authenticator",
    "BodyLimitMiddleware",
    "FlowDep",
    "KeyAuth",
    "OnceflowServices",
    "OpLogDep",
    "Principal",
    "PrincipalDep",
    "QueueDep",
    "ServerSpanMiddleware",
    "add_error_handlers",
    "create_app",
    "create_router",
    "error_response",
    "get_async_queue",
    "get_flow",
    "get_oplog",
    "get_principal",
    "get_queue",
    "get_services",
    "hash_key",
    "mint_worker_token",
    "new_key",
]
