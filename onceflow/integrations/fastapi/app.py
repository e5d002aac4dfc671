"""The HTTP API: services built per process, ``Depends`` providers, the router and the app.

Order of checks on every request, each before the next runs:

1. body size and shape (ASGI middleware, before anything parses the body): 413, and 422
   for a JSON body nested too deep or holding NaN/Infinity;
2. the key (``Authorization: Bearer <key>``), then its scope against the
   workspace or worker class in the path: 401, 403 — before the body is parsed
   and before any lookup, so a refused caller learns nothing about ids;
3. validation of the body and parameters: 422;
4. the operation: 404, 409 (lease lost, op id conflict, input mismatch).

Endpoints that touch the database are plain ``def`` functions: FastAPI runs them
in its thread pool, as blocking calls (psycopg, the Celery send) need.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response, Security
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from onceflow.errors import (
    AccessDenied,
    DatabaseUnavailable,
    InputMismatch,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    LockUnavailable,
    NotFound,
    OnceflowError,
    OpIdConflict,
    PayloadTooLarge,
    ReplayTooOld,
)
from onceflow.ids import ClaimToken, check_id
from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.auth import (
    Authenticator,
    KeyAuth,
    Principal,
    PrincipalDep,
)
from onceflow.integrations.fastapi.events import EventHub, event_stream
from onceflow.integrations.fastapi.http_errors import (
    add_error_handlers,
    http_error_response,
    one_line,
    validation_body,
)
from onceflow.integrations.fastapi.limits import BODY_ENVELOPE_DEPTH, BodyLimitMiddleware
from onceflow.integrations.fastapi.metrics_routes import install_metrics
from onceflow.integrations.fastapi.operators import OperatorAuth, bearer_key
from onceflow.integrations.fastapi.pull_routes import add_pull_routes
from onceflow.integrations.fastapi.ratelimit import RateLimited, RateLimits
from onceflow.integrations.fastapi.sdk_routes import create_sdk_router
from onceflow.models import Claim, Dispatch, NewRequest, Status
from onceflow.models import Request as StageRequest
from onceflow.models import workspace_process_requests as wpr
from onceflow.oplog import ApplyResult, OpLog, stage_op_id
from onceflow.queue import Queue
from onceflow.settings import Settings, get_settings
from onceflow.tasks import Flow

log = logging.getLogger("onceflow.api")

REPLAY_HEADER = "Idempotent-Replayed"
_bearer = HTTPBearer(auto_error=False, description="An API key or a worker key.")


# ---------------------------------------------------------------------- services


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


# ------------------------------------------------------------------------ errors


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an echoed lone surrogate (``\\ud800``) cannot break it."""

    def render(self, content: Any) -> bytes:
        """Encode ``content`` as ASCII-only JSON."""
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """422 ``{"detail": "<one line>", "code": "invalid_request", "errors": [{loc, msg, type}]}``.

    The input is left out: it may be large, and may hold what JSON cannot carry
    back (NaN, a lone surrogate), which would turn a 422 into a 500.
    """
    return AsciiJSONResponse(jsonable_encoder(validation_body(exc.errors())), 422)


def error_response(exc: Exception) -> JSONResponse:
    """The HTTP answer to an onceflow error (the body is :class:`~.schemas.ErrorOut`)."""
    status, code, headers = 500, "internal", {}
    extra: dict[str, Any] = {}
    detail = str(exc)
    if isinstance(exc, AccessDenied):
        status = exc.status
        code = "unauthorized" if status == 401 else "forbidden"
        detail = exc.detail
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
    elif isinstance(exc, NotFound):
        status, code = 404, "not_found"
    elif isinstance(exc, LeaseLost):
        status, code = 409, "lease_lost"
        detail = f"no live claim on request {exc.request_id} for this token"
    elif isinstance(exc, OpIdConflict):
        status, code = 409, "op_id_conflict"
    elif isinstance(exc, ReplayTooOld):
        status, code = 409, "replay_too_old"
        extra["horizon"] = exc.horizon
    elif isinstance(exc, InputMismatch):
        status, code = 409, "input_mismatch"
    elif isinstance(exc, InvalidTransition):
        status, code = 409, "invalid_transition"
    elif isinstance(exc, PayloadTooLarge):
        status, code = 413, "payload_too_large"
    elif isinstance(exc, InvalidRequest):
        status, code = 422, "invalid_request"
    elif isinstance(exc, UnicodeError):
        # JSON may carry a lone surrogate (\ud800) that no UTF-8 store can hold.
        status, code, detail = 422, "invalid_request", "a string holds a lone surrogate"
    elif isinstance(exc, DatabaseUnavailable | LockUnavailable):
        status, code = 503, "unavailable"
        headers["Retry-After"] = "1"
    else:
        log.error("internal error: %s", type(exc).__name__, exc_info=exc)
        detail = "internal error"
    body = {"detail": one_line(detail), "code": code, **extra}
    return AsciiJSONResponse(body, status, headers=headers)


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "The body is not parseable, or Content-Length is malformed",
        401: "No key, or an unknown key",
        403: "The key is not scoped to this workspace or worker class",
        404: "No such request in this workspace",
        409: "Conflict (lease lost, op id reused, input mismatch)",
        408: "The body did not arrive within ONCEFLOW_API_BODY_TIMEOUT_SECONDS (code "
        "request_timeout; the connection is closed)",
        413: "The body is over the size limit (or a payload over the payload limit)",
        422: "Invalid parameters or body (code invalid_request; `errors` lists each field)",
        429: "Too many requests for this key (code rate_limited); retry after Retry-After",
        503: "Postgres or Redis did not answer",
    }
    return {code: {"model": s.ErrorOut, "description": text[code]} for code in statuses}


# ---------------------------------------------------------------- the route class


async def guarded_call(
    request: Request,
    authorize: Callable[[], Coroutine[Any, Any, None]],
    handler: Callable[[Request], Coroutine[Any, Any, Response]],
) -> Response:
    """``authorize()`` then ``handler(request)``; every refusal in the API's error shape."""
    try:
        await authorize()
        return await handler(request)
    except RateLimited as exc:
        return exc.response()
    except (OnceflowError, UnicodeError) as exc:
        return error_response(exc)
    except RequestValidationError as exc:
        return validation_response(exc)
    except StarletteHTTPException as exc:  # e.g. 400: the body cannot be parsed
        return http_error_response(request, exc)


def _route_class(services: OnceflowServices) -> type[APIRoute]:
    """Routes that check the key and its scope before FastAPI parses the body."""

    class OnceflowRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            kind = "workspace" if "{ws}" in self.path else "wc" if "{wc}" in self.path else "claim"

            async def guarded(request: Request) -> Response:
                async def authorize() -> None:
                    request.state.onceflow_principal = await services.rate_limits.authorize(
                        request, lambda: _authorize(services.auth, request, kind)
                    )

                return await guarded_call(request, authorize, handler)

            return guarded

    return OnceflowRoute


def _authorize(auth: Authenticator, request: Request, kind: str) -> Principal:
    principal = auth.authenticate(bearer_key(request))
    if principal is None:
        raise AccessDenied(401, "unknown key")
    params = request.path_params
    if kind == "workspace" and not principal.may_use_workspace(params["ws"]):
        raise AccessDenied(403, "this key is not scoped to that workspace")
    if kind == "wc" and not principal.may_work(params["wc"]):
        raise AccessDenied(403, "this key is not a worker key of that worker class")
    if kind == "claim" and not principal.is_worker:
        raise AccessDenied(403, "claims need a worker key")
    return principal


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
    return router


def _request_routes(router: APIRouter, svc: OnceflowServices) -> None:
    @router.post(
        "/workspaces/{ws}/requests",
        operation_id="enqueue_request",
        tags=["requests"],
        status_code=201,
        response_description="Created by this call",
        response_model=s.EnqueueOut,
        responses={
            200: {"model": s.EnqueueOut, "description": "The request existed already"},
            **_responses(409, 413, 503),
        },
    )
    def enqueue(
        ws: s.WorkspacePath, body: s.EnqueueIn, request: Request, response: Response
    ) -> s.EnqueueOut:
        """Enqueue a stage request: 201 for the one caller that created it, 200 for the others.

        The input is validated against the stage's model; the row is committed, then
        the wake-up is sent to the worker class's queue (a pull-worker class claims it
        over HTTP instead).
        """
        check_id("workspace_id", ws)
        result = svc.flow.enqueue(
            body.stage,
            ws,
            body.job_id,
            body.branch_path,
            body.input,
            priority=body.priority,
            strict=body.strict,
            worker_class=body.worker_class,
        )
        if result.created:
            response.status_code = 201
            raw_path = request.scope.get("raw_path") or request.url.path.encode()
            response.headers["Location"] = f"{raw_path.decode('latin-1')}/{result.request_id}"
        else:
            response.status_code = 200
        return s.EnqueueOut(
            request_id=result.request_id,
            created=result.created,
            status=result.status,
            input_mismatch=result.input_mismatch,
        )

    @router.get(
        "/workspaces/{ws}/requests/{request_id}",
        operation_id="get_request",
        tags=["requests"],
        response_model=s.RequestOut,
        responses=_responses(404, 503),
    )
    def get_request(ws: s.WorkspacePath, request_id: s.RequestIdPath) -> s.RequestOut:
        """A request of this workspace (404 also when the id belongs to another workspace)."""
        check_id("workspace_id", ws)
        found = svc.queue.get(request_id)
        if found.workspace_id != ws:
            raise NotFound(request_id)
        return _request_out(found)

    @router.get(
        "/workspaces/{ws}/requests",
        operation_id="list_requests",
        tags=["requests"],
        response_model=s.RequestList,
        responses=_responses(503),
    )
    def list_requests(
        ws: s.WorkspacePath,
        status: Annotated[list[Status] | None, Query()] = None,
        stage: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        job_id: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        worker_class: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> s.RequestList:
        """The workspace's requests, newest first, filtered by every parameter given."""
        check_id("workspace_id", ws)
        rows = svc.queue.list(
            workspace_id=ws,
            status=[st.value for st in status] if status else None,
            stage=stage,
            job_id=job_id,
            worker_class=worker_class,
            limit=limit,
        )
        return s.RequestList(requests=[_request_out(r) for r in rows])

    @router.get(
        "/workspaces/{ws}/counts",
        operation_id="count_requests",
        tags=["requests"],
        response_model=s.CountsOut,
        responses=_responses(503),
    )
    def counts(ws: s.WorkspacePath) -> s.CountsOut:
        """The workspace's requests counted by worker class and status."""
        check_id("workspace_id", ws)
        query = (
            select(wpr.c.worker_class, wpr.c.status, func.count().label("n"))
            .where(wpr.c.workspace_id == ws)
            .group_by(wpr.c.worker_class, wpr.c.status)
        )
        try:
            with svc.queue.engine.connect() as conn:
                rows = conn.execute(query).all()
        except SQLAlchemyError as exc:
            raise DatabaseUnavailable(f"counts failed: {type(exc).__name__}") from exc
        out: dict[str, dict[str, int]] = {}
        for worker_class, status, n in rows:
            out.setdefault(worker_class, {st.value: 0 for st in Status})[status] = int(n)
        total = sum(sum(per.values()) for per in out.values())
        return s.CountsOut(workspace_id=ws, counts=out, total=total)

    @router.get(
        "/workspaces/{ws}/events",
        operation_id="workspace_events",
        tags=["ops"],
        response_class=Response,
        responses={
            200: {
                "description": "An event stream: `ready`, then one `commit` event per op "
                "committed in the workspace (data: JSON); `: keep-alive` comments when idle",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            **_responses(503),
        },
    )
    async def events(ws: s.WorkspacePath, principal: PrincipalDep) -> Response:
        """Server-sent events of the workspace's commit broadcasts (what a browser tab follows)."""
        check_id("workspace_id", ws)
        keepalive = svc.settings.api_sse_keepalive_seconds
        return await event_stream(svc.event_hub(), ws, principal.key_id, keepalive)


def _claim_routes(router: APIRouter, svc: OnceflowServices) -> None:
    @router.post(
        "/worker-classes/{wc}/claims",
        operation_id="claim_next",
        tags=["pull workers"],
        status_code=201,
        response_description="Claimed: a lease on the request",
        response_model=s.ClaimOut,
        responses={204: {"description": "Nothing to claim now"}, **_responses(503)},
    )
    async def claim_next(wc: s.WorkerClassPath, body: s.ClaimIn, request: Request) -> Any:
        """Claim the next due request of this worker class (a lease; heartbeat every lease/3).

        With ``wait`` > 0, a long poll: nothing claimable now waits (no thread held) until
        something may be, and claims again, until ``wait`` is used up or the client leaves.
        """

        def claim_now() -> list[Claim]:
            claims = svc.queue.claim_next(wc, body.worker_id, 1, lease_seconds=body.lease_seconds)
            if body.lease_seconds is None:
                claims = [c for c in (_with_stage_lease(svc, claim) for claim in claims) if c]
            return claims

        claims = await run_in_threadpool(claim_now)
        if not claims and body.wait > 0:
            claims = await _long_poll(svc.queue, wc, body.wait, request, claim_now)
        if not claims:
            return Response(status_code=204)
        claim = claims[0]
        return s.ClaimOut(
            request_id=claim.request_id,
            claim_token=claim.token,
            lease_expires_at=claim.lease_expires_at,
            lease_seconds=claim.lease_seconds,
            attempt=claim.attempt,
            request=_request_out(claim.request),
        )

    def claim_of(request_id: str, token: str, principal: Principal) -> Claim:
        # One answer for "no such request", "not your worker class", "not running" and
        # "wrong token": a worker key learns nothing about requests it holds no claim on.
        check_id("request_id", request_id)
        try:
            found = svc.queue.get(request_id)
        except NotFound:
            raise LeaseLost(request_id) from None
        expires, beat = found.lease_expires_at, found.heartbeat_at
        if not principal.may_work(found.worker_class) or found.status is not Status.RUNNING:
            raise LeaseLost(request_id)
        if expires is None or beat is None:
            raise LeaseLost(request_id)
        # The SQL fences on the token and the live lease; this only carries them.
        lease = max((expires - beat).total_seconds(), 0.001)
        return Claim(found, ClaimToken(token), expires, lease)

    @router.post(
        "/claims/{request_id}/heartbeat",
        operation_id="heartbeat",
        tags=["pull workers"],
        response_model=s.HeartbeatOut,
        responses=_responses(409, 503),
    )
    def heartbeat(
        request_id: s.RequestIdPath, body: s.HeartbeatIn, principal: PrincipalDep
    ) -> s.HeartbeatOut:
        """Extend the lease; 409 lease_lost once it is gone (stop and write nothing)."""
        claim = claim_of(request_id, body.claim_token, principal)
        if body.lease_seconds is not None:
            claim = Claim(claim.request, claim.token, claim.lease_expires_at, body.lease_seconds)
        beat = svc.queue.heartbeat(claim)
        return s.HeartbeatOut(
            lease_expires_at=beat.lease_expires_at, cancel_requested=beat.cancel_requested
        )

    @router.post(
        "/claims/{request_id}/complete",
        operation_id="complete",
        tags=["pull workers"],
        response_model=s.RequestOut,
        responses=_responses(409, 413, 503),
    )
    def complete(
        request_id: s.RequestIdPath, body: s.CompleteIn, principal: PrincipalDep
    ) -> s.RequestOut:
        """Finish the claimed request (fenced: a zombie's late completion is 409, no change)."""
        claim = claim_of(request_id, body.claim_token, principal)
        then = [_follow_up(svc.flow, claim.request, f) for f in body.then]
        done, followed = svc.queue.hand_off(claim, body.result, then=then)
        for made in followed:
            if made.created:  # a hand-off that collapsed onto an existing row has its wake-up
                svc.flow.dispatch(Dispatch(made.request_id, made.stage, made.worker_class))
        return _request_out(done)

    @router.post(
        "/claims/{request_id}/fail",
        operation_id="fail",
        tags=["pull workers"],
        response_model=s.RequestOut,
        responses=_responses(409, 413, 503),
    )
    def fail(request_id: s.RequestIdPath, body: s.FailIn, principal: PrincipalDep) -> s.RequestOut:
        """Report a failed run: queued again after a backoff, or dead past its attempts."""
        claim = claim_of(request_id, body.claim_token, principal)
        failed = svc.queue.fail(claim, body.error, retryable=body.retryable, retry_in=body.retry_in)
        return _request_out(failed)

    @router.post(
        "/claims/{request_id}/ops",
        operation_id="apply_claim_op",
        tags=["pull workers"],
        status_code=201,
        response_description="Recorded by this call",
        response_model=s.ApplyOut,
        responses={
            200: {"model": s.ApplyOut, "description": "A replay: the original answer"},
            **_responses(409, 413, 503),
        },
    )
    def claim_op(
        request_id: s.RequestIdPath, body: s.ClaimOpIn, principal: PrincipalDep, response: Response
    ) -> s.ApplyOut:
        """Write to a sub-doc of the claimed request's workspace, fenced by the claim."""
        claim = claim_of(request_id, body.claim_token, principal)
        op_id = body.op_id or (stage_op_id(request_id, body.key) if body.key else None)
        if op_id is None:
            raise InvalidRequest("give key (or op_id), so that a retried write is applied once")
        result = svc.oplog.apply_op(
            claim.request.workspace_id, body.sub_doc, body.op, op_id, fence=claim
        )
        return _apply_out(result, response)


def _op_routes(router: APIRouter, svc: OnceflowServices) -> None:
    @router.post(
        "/workspaces/{ws}/sub-docs/{sub_doc}/ops",
        operation_id="apply_op",
        tags=["ops"],
        status_code=201,
        response_description="Recorded by this call",
        response_model=s.ApplyOut,
        responses={
            200: {
                "model": s.ApplyOut,
                "description": "A replay of a known op id: the original clock and result",
                "headers": {REPLAY_HEADER: {"description": "true", "schema": {"type": "string"}}},
            },
            **_responses(409, 413, 503),
        },
    )
    def apply_op(
        ws: s.WorkspacePath, sub_doc: s.SubDocPath, body: s.OpIn, response: Response
    ) -> s.ApplyOut:
        """Apply an op once by its op id: 201 when recorded now, 200 for a replay.

        The same op id with another payload is 409 op_id_conflict; an op the state
        cannot take is recorded with its error (``applied=false``), so its retry
        gets the same answer.
        """
        result = svc.oplog.apply_op(ws, sub_doc, body.op, body.op_id, base_clock=body.base_clock)
        return _apply_out(result, response)

    @router.get(
        "/workspaces/{ws}/sub-docs/{sub_doc}",
        operation_id="get_sub_doc",
        tags=["ops"],
        response_model=s.SubDocOut,
        responses=_responses(503),
    )
    def get_sub_doc(ws: s.WorkspacePath, sub_doc: s.SubDocPath) -> s.SubDocOut:
        """The sub-doc's state and commit clock."""
        doc = svc.oplog.get_sub_doc(ws, sub_doc)
        return s.SubDocOut(
            workspace_id=doc.workspace_id, sub_doc=doc.sub_doc, clock=doc.clock, state=doc.state
        )

    @router.get(
        "/workspaces/{ws}/sub-docs/{sub_doc}/ops",
        operation_id="ops_since",
        tags=["ops"],
        response_model=s.OpsOut,
        responses=_responses(503),
    )
    def ops_since(
        ws: s.WorkspacePath,
        sub_doc: s.SubDocPath,
        since: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> s.OpsOut:
        """Applied ops with a clock above ``since``, in clock order (a tab catching up)."""
        records = svc.oplog.ops_since(ws, sub_doc, since, limit=limit)
        return s.OpsOut(
            ops=[
                s.OpOut(
                    op_id=r.op_id,
                    clock=r.clock,
                    op_type=r.op_type,
                    payload=r.payload,
                    result=r.result,
                    fence=r.fence,
                    committed_at=r.committed_at,
                )
                for r in records
            ]
        )


async def _long_poll(
    queue: Queue, wc: str, wait: float, request: Request, claim_now: Callable[[], list[Claim]]
) -> list[Claim]:
    """Wait for work of ``wc`` and claim it, for up to ``wait`` s; [] on timeout or disconnect."""
    deadline = time.monotonic() + wait

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        while (left := deadline - time.monotonic()) > 0:
            waiter = asyncio.ensure_future(queue.wait_for_work_async(wc, left))
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await waiter  # retrieved: a failed wait logs no "never retrieved"
                return []
            if waiter.result():
                claims = await run_in_threadpool(claim_now)
                if claims and watcher.done():
                    # The client left while we claimed: hand the claim back (no attempt
                    # counted) instead of letting its lease lapse as a crash.
                    await run_in_threadpool(queue.release, claims)
                    return []
                if claims:
                    return claims
        return []
    finally:
        watcher.cancel()


def _with_stage_lease(svc: OnceflowServices, claim: Claim) -> Claim | None:
    """The claim with the lease its stage declares (a heartbeat sets it on the DB clock).

    The claim took the server's default lease (the stage is known only once claimed); a
    stage that declares another one gets it at once, as a Celery worker's claim would.
    """
    try:
        declared = svc.flow.spec(claim.request.stage).lease_seconds
    except OnceflowError:
        return claim  # a stage this API does not declare: the default lease
    if declared is None or declared == claim.lease_seconds:
        return claim
    try:
        beat = svc.queue.heartbeat(
            Claim(claim.request, claim.token, claim.lease_expires_at, declared, claim.max_runtime)
        )
    except LeaseLost:
        return None  # rescued in between (a default lease shorter than a moment): not ours
    return Claim(claim.request, claim.token, beat.lease_expires_at, declared, claim.max_runtime)


def _request_out(request: StageRequest) -> s.RequestOut:
    return s.RequestOut.model_validate(request, from_attributes=True)


def _apply_out(result: ApplyResult, response: Response) -> s.ApplyOut:
    if result.duplicate:
        response.status_code = 200
        response.headers[REPLAY_HEADER] = "true"
    else:
        response.status_code = 201
    return s.ApplyOut(
        workspace_id=result.workspace_id,
        sub_doc=result.sub_doc,
        op_id=result.op_id,
        clock=result.clock,
        duplicate=result.duplicate,
        applied=result.applied,
        result=result.result,
        error=result.error,
        committed_at=result.committed_at,
    )


def _follow_up(flow: Flow, parent: StageRequest, item: s.FollowUp) -> NewRequest:
    """A hand-off to ``item.stage`` in the claimed request's workspace and job (the Flow's
    one builder: declared worker class, dedupe, priority, attempts; input validated)."""
    branch = parent.branch_path if item.branch_path is None else item.branch_path
    return flow.new_request(item.stage, parent.workspace_id, parent.job_id, branch, item.input)


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
        "commits. Every route takes `Authorization: Bearer <key>`.",
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=services.settings.api_max_body_bytes,
        body_timeout=services.settings.api_body_timeout_seconds,
        max_json_depth=services.settings.max_payload_depth + BODY_ENVELOPE_DEPTH,
    )
    app.include_router(create_router(services=services))
    install_metrics(app, services)
    from onceflow.integrations.fastapi.dashboard import create_dashboard_router

    app.include_router(create_dashboard_router(services))  # /dashboard: docs/dashboard.md
    app.include_router(create_sdk_router())  # /sdk/index.js: the browser SDK (docs/browser.md)
    add_error_handlers(app)
    return app
