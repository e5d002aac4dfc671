"""Routes for pull workers that are not Python (browser tabs): compute locks, events, reads.

The compute lock's protocol per expensive call (docs/locks.md), with the client doing
steps 1, 3 and 4 and these routes the lock itself (the same Redis ``SET NX PX`` lock, keys
and broadcasts as :func:`onceflow.locks.compute_once`, so a tab, a Celery stage and a
Python pull worker asking for the same cell share one lock):

* ``POST /v1/claims/{request_id}/locks`` ``{claim_token, task, ttl_seconds?}`` — for the
  holder of a live claim (DB clock), on the cell ``(claim's workspace, claim's job, task)``:
  201 ``{acquired: true, lock_token, ttl_ms}``, or 200 ``{locked: true, remaining_ms}``:
  someone else is on it — wait for the workspace's ``lock_released`` or ``commit``
  event (``GET /v1/workspaces/{ws}/events``), check again, and try again at the latest
  when ``remaining_ms`` has passed (the holder may have died: its lock expires);
* ``POST …/locks/extend`` ``{claim_token, task, lock_token, ttl_seconds?}`` — compare and
  extend: ``{held: true|false}`` (a long call keeps its lock; the claim must be live);
* ``POST …/locks/release`` ``{claim_token, task, lock_token, outcome}`` — compare and delete,
  then announce ``lock_released`` (``ok`` unless ``outcome`` is ``failed``) on the
  workspace channel: ``{released: true|false}``. It does not need a live claim: a lock
  is released by its own token whatever happened to the claim meanwhile. Only a release
  that released something is counted and announced (a wrong token or a repeat is not).

``POST /v1/claims/{request_id}/events`` ``{claim_token}`` streams the claimed request's own
news from its workspace's channel (events as on ``GET /v1/workspaces/{ws}/events``:
``ready``, then ``commit`` of the sub-docs its stage may read — its ``sub_docs`` — and
``lock_released`` of its own job's cells; never another job's or sub-doc's) to a worker
key, which holds no workspace scope: opened for a live claim only, and ended
(``event: end``) within ``CLAIM_CHECK_SECONDS`` (or the keep-alive interval if shorter)
once the claim is over (completed, failed, lapsed). It is what a waiting tab listens to.

``POST /v1/claims/{request_id}/sub-docs`` ``{claim_token, sub_doc}`` reads a sub-doc of the
claimed request's workspace (``{workspace_id, sub_doc, clock, state}``) for a live claim: the
pre-flight and double-check reads of a tab's stage, as ``ctx.read_sub_doc`` in Python. Only
a sub-doc the claimed stage declares (``Flow.stage(..., sub_docs=...)``; its job's,
``job:{job_id}`` and ``job:{job_id}:*``, by default): another is 403, nothing read.

Every body also takes the claimed request's ``workspace_id`` (optional for now): the row is
then found by its key ``(workspace_id, request_id)``; another workspace than the request's
is the same 409 lease_lost as a wrong token.

``ttl_seconds`` is at least 1 s (shorter: 422, the lock untouched) and at most
``ONCEFLOW_LOCK_TTL_SECONDS`` (a longer one is cut to it). The
locks, their TTL cap and the choice of Redis or SQL come from the app's settings
(``create_app(settings=…)``), as do its event streams: a waiter hears the release.
``outcome`` (``computed``, ``double_check``, ``failed`` or ``abandoned``) feeds the workspace's
compute-lock counters, so the dashboard's savings include the tabs' calls. The lock
token is a secret of its holder: never logged, only compared in Redis.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool

from onceflow.errors import LeaseLost, NotFound
from onceflow.ids import check_id
from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.auth import Principal, PrincipalDep
from onceflow.integrations.fastapi.events import event_stream
from onceflow.integrations.fastapi.routes_claims import claim_ref, out_of_scope
from onceflow.keys import lock_key
from onceflow.locks.aio import AsyncLockHandle, get_async_backend
from onceflow.locks.base import LockBackend, LockHandle, ttl_to_ms
from onceflow.locks.counters import COMPUTE_ERRORS, COMPUTES, DOUBLE_CHECK_HITS
from onceflow.locks.protocol import get_backend
from onceflow.models import Request as StageRequest
from onceflow.models.sub_doc_scope import SubDocScope, request_fields
from onceflow.settings import Settings

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.services import OnceflowServices

Task = Annotated[str, StringConstraints(min_length=1, max_length=200)]
LockToken = Annotated[str, StringConstraints(min_length=1, max_length=200)]
#: How often a claim's event stream checks that the claim is still live (then ends if not).
CLAIM_CHECK_SECONDS = 5.0
#: A lock TTL a client may ask for: at least a second (a shorter lock would lapse before the
#: holder's call got anywhere, and let the next acquire in: a second paid call), at most an
#: hour (and at most ONCEFLOW_LOCK_TTL_SECONDS: a longer one is cut to it).
TTL_MIN_SECONDS = 1.0
TtlSeconds = Annotated[float, Field(ge=TTL_MIN_SECONDS, le=3600)]


class ClaimBodyIn(BaseModel):
    # Strict like every /v1 body (schemas._In): "5" is not a TTL, nor is true.
    model_config = ConfigDict(extra="forbid", strict=True)
    claim_token: s.ClaimTokenStr
    workspace_id: s.WorkspaceIdStr | None = Field(
        default=None, description=s.CLAIM_WORKSPACE_DESCRIPTION
    )


class _In(ClaimBodyIn):
    task: Task = Field(description="The expensive call, e.g. `eval:<column>`.")


class LockIn(_In):
    """Take the cell's compute lock."""

    ttl_seconds: TtlSeconds | None = Field(
        default=None,
        description="The lock's TTL: 1 s to an hour, cut to ONCEFLOW_LOCK_TTL_SECONDS (the "
        "default).",
    )


class EventsIn(ClaimBodyIn):
    """Follow the claimed request's workspace events while the claim is live."""


class SubDocIn(ClaimBodyIn):
    """Read a sub-doc of the claimed request's workspace (one its stage declares)."""

    sub_doc: s.Id


def claims_news(scope: SubDocScope, where: dict[str, str]) -> Callable[[bytes], bool]:
    """Which of its workspace's messages a claim's stream carries: a ``commit`` of a
    sub-doc its stage may read, a ``lock_released`` of a cell of its own job; nothing else
    (another job's or sub-doc's news, a message of a kind it does not know)."""

    def accept(data: bytes) -> bool:
        try:
            message = json.loads(data)
        except ValueError:
            return False
        if not isinstance(message, dict):
            return False
        kind, sub_doc = message.get("kind"), message.get("sub_doc")
        if kind == "commit":
            return isinstance(sub_doc, str) and scope.allows(sub_doc, where)
        return kind == "lock_released" and message.get("job_id") == where["job_id"]

    return accept


class LockOut(BaseModel):
    """``acquired``: yours, release it; ``locked``: someone else is on it."""

    acquired: bool
    locked: bool
    job_id: str
    task: str
    lock_token: str | None = None
    ttl_ms: int | None = None
    remaining_ms: int | None = None


class ExtendIn(_In):
    """Extend a lock you hold."""

    lock_token: LockToken
    ttl_seconds: TtlSeconds | None = Field(
        default=None,
        description="The new TTL from now: 1 s to an hour, cut to ONCEFLOW_LOCK_TTL_SECONDS "
        "(the default).",
    )


class ExtendOut(BaseModel):
    held: bool


class ReleaseIn(_In):
    """Release a lock you hold and announce it."""

    lock_token: LockToken
    outcome: Literal["computed", "double_check", "failed", "abandoned"] = Field(
        description="What the holder did: `failed` (the call failed) and `abandoned` (stopped "
        "before calling: lease lost, cancel) announce ok=false (a waiter takes over)."
    )


class ReleaseOut(BaseModel):
    released: bool


_COUNTED = {"computed": (COMPUTES,), "double_check": (DOUBLE_CHECK_HITS,),
            "failed": (COMPUTES, COMPUTE_ERRORS), "abandoned": ()}  # fmt: skip


def _ttl(settings: Settings, asked: float | None) -> float:
    """The lock TTL: the one asked for, at most the app's ONCEFLOW_LOCK_TTL_SECONDS (a
    closed tab must not hold a cell past it; a long call extends its lock instead)."""
    cap = settings.lock_ttl_seconds
    return cap if asked is None else min(asked, cap)


class _InThreads:
    """A sync lock backend (the SQL one) behind the async backend's awaited calls: each call
    runs in a worker thread, so the event loop never waits on it."""

    def __init__(self, backend: LockBackend) -> None:
        self.backend = backend
        self.settings = backend.settings
        self.counters = backend.counters

    async def acquire(self, workspace_id: str, job_id: str, task: str, ttl: float) -> Any:
        return await run_in_threadpool(self.backend.acquire, workspace_id, job_id, task, ttl)

    async def remaining_ms(self, workspace_id: str, job_id: str, task: str) -> int | None:
        return await run_in_threadpool(self.backend.remaining_ms, workspace_id, job_id, task)

    async def cad_extend(self, handle: Any, ttl_ms: int) -> bool:
        return await run_in_threadpool(self.backend.cad_extend, handle, ttl_ms)

    async def cad_release(self, handle: Any) -> int:
        return await run_in_threadpool(self.backend.cad_release, handle)

    async def announce(self, handle: Any, *, ok: bool) -> None:
        await run_in_threadpool(lambda: self.backend.announce(handle, ok=ok))


def _lock_backend(settings: Settings) -> Any:
    """The app's lock backend: the running loop's async one on its Redis (where its event
    streams listen), or its SQL one in worker threads."""
    if settings.lock_backend == "redis":
        return get_async_backend(settings)
    return _InThreads(get_backend(settings))


async def claim_holder(
    svc: OnceflowServices, request_id: str, body: ClaimBodyIn, principal: Principal, *, live: bool
) -> StageRequest:
    """The claimed request of ``body``'s claim, for its holder.

    One answer (409 lease_lost) for "no such request", "not in that workspace", "not your
    worker class", "not running" and "wrong token", as on the other claim routes: nothing
    leaks about ids. The row is found by its key when the body names the workspace, by its
    id alone when not. ``live=False`` (a release) needs the request, not a live claim: the
    caller then proves its hold otherwise (a lock token, a permit's claim).
    """
    check_id("request_id", request_id)
    ref = claim_ref(request_id, body.claim_token, principal, body.workspace_id)
    found: StageRequest | None
    if live:  # one read: the token, the live lease and the key's classes in its WHERE
        found = await svc.async_queue.live_claim(
            request_id, ref.token, worker_classes=ref.worker_classes,
            workspace_id=ref.workspace_id, workspaces=ref.workspaces,
        )  # fmt: skip
    else:
        try:
            found = await svc.async_queue.get(request_id, workspace_id=ref.workspace_id)
        except NotFound:
            found = None
    if (
        found is None
        or not principal.may_work(found.worker_class)
        or not principal.may_claim_in(found.workspace_id)
    ):
        raise LeaseLost(request_id)
    return found


# Route decorators alike by shape on purpose: FastAPI builds the OpenAPI contract from each one.
def add_pull_routes(
    router: APIRouter, svc: OnceflowServices, responses: dict[int | str, dict[str, Any]]
) -> None:
    """Add the lock, events and sub-doc read routes for claim holders to the ``/v1`` router."""

    def handle(be: Any, request: StageRequest, body: _In, token: str, ttl_ms: int) -> Any:
        key = lock_key(request.workspace_id, request.job_id, body.task)
        where = (request.workspace_id, request.job_id, body.task, key, token, ttl_ms)
        if isinstance(be, _InThreads):
            return LockHandle(be.backend, *where)
        return AsyncLockHandle(be, *where)

    @router.post(
        "/claims/{request_id}/locks",
        operation_id="acquire_lock",
        tags=["pull workers"],
        status_code=201,
        response_model=LockOut,
        responses={200: {"model": LockOut, "description": "Locked by someone else"}, **responses},
    )
    async def acquire(
        request_id: s.RequestIdPath, body: LockIn, response: Response, principal: PrincipalDep
    ) -> LockOut:
        """Take the compute lock of ``task`` on the claimed request's job (a live claim only)."""
        request = await claim_holder(svc, request_id, body, principal, live=True)
        lock_key(request.workspace_id, request.job_id, body.task)  # a bad task: 400 first
        be = _lock_backend(svc.settings)
        ttl = _ttl(svc.settings, body.ttl_seconds)
        got = await be.acquire(request.workspace_id, request.job_id, body.task, ttl)
        if got is not None:
            return LockOut(acquired=True, locked=False, job_id=request.job_id, task=body.task,
                           lock_token=got.token, ttl_ms=got.ttl_ms)  # fmt: skip
        response.status_code = 200
        remaining = await be.remaining_ms(request.workspace_id, request.job_id, body.task)
        return LockOut(acquired=False, locked=True, job_id=request.job_id, task=body.task,
                       remaining_ms=remaining or 0)  # fmt: skip

    @router.post(
        "/claims/{request_id}/locks/extend",
        operation_id="extend_lock",
        tags=["pull workers"],
        response_model=ExtendOut,
        responses=responses,
    )
    async def extend(
        request_id: s.RequestIdPath, body: ExtendIn, principal: PrincipalDep
    ) -> ExtendOut:
        """Compare and extend: ``held: false`` once the lock expired or was taken."""
        request = await claim_holder(svc, request_id, body, principal, live=True)
        be = _lock_backend(svc.settings)
        ttl_ms = ttl_to_ms(_ttl(svc.settings, body.ttl_seconds))
        lock = handle(be, request, body, body.lock_token, ttl_ms)
        return ExtendOut(held=await be.cad_extend(lock, ttl_ms))

    @router.post(
        "/claims/{request_id}/locks/release",
        operation_id="release_lock",
        tags=["pull workers"],
        response_model=ReleaseOut,
        responses=responses,
    )
    async def release(
        request_id: s.RequestIdPath, body: ReleaseIn, principal: PrincipalDep
    ) -> ReleaseOut:
        """Compare and delete, then announce ``lock_released`` on the workspace channel."""
        request = await claim_holder(svc, request_id, body, principal, live=False)
        be = _lock_backend(svc.settings)
        lock = handle(be, request, body, body.lock_token, 0)
        # Only 1 released now: a wrong token, an expired lock or a repeat (0, or 2 when the
        # mark of this token's earlier release is still there) counts and announces nothing.
        released = await be.cad_release(lock) == 1
        if released:
            for name in _COUNTED[body.outcome]:
                be.counters.incr(request.workspace_id, name)
            await be.announce(lock, ok=body.outcome in ("computed", "double_check"))
        return ReleaseOut(released=bool(released))

    @router.post(
        "/claims/{request_id}/events",
        operation_id="claim_events",
        tags=["pull workers"],
        response_class=Response,
        responses={
            200: {
                "description": "The claimed request's own news from its workspace's event "
                "stream (as `GET /v1/workspaces/{ws}/events`): `ready`, `commit` of the "
                "sub-docs its stage may read, `lock_released` of its job's cells",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            **responses,
        },
    )
    async def claim_events(
        request_id: s.RequestIdPath, body: EventsIn, principal: PrincipalDep
    ) -> Response:
        """Server-sent events about the claimed request, for the claim's holder: commits of
        the sub-docs its stage may read, lock news of its job's cells."""
        request = await claim_holder(svc, request_id, body, principal, live=True)
        keepalive = svc.settings.api_sse_keepalive_seconds
        ref = claim_ref(request_id, body.claim_token, principal, body.workspace_id)

        async def claim_live() -> bool:
            live = await svc.async_queue.live_claim(
                request_id, ref.token, worker_classes=ref.worker_classes,
                workspace_id=ref.workspace_id, workspaces=ref.workspaces,
            )  # fmt: skip
            return live is not None

        news = claims_news(svc.flow.sub_doc_scope(request.stage), request_fields(request))
        return await event_stream(
            svc.event_hub(), request.workspace_id, principal.key_id, keepalive,
            still_valid=claim_live, check_seconds=min(CLAIM_CHECK_SECONDS, keepalive),
            accept=news,
        )  # fmt: skip

    @router.post(
        "/claims/{request_id}/sub-docs",
        operation_id="claim_read_sub_doc",
        tags=["pull workers"],
        response_model=s.SubDocOut,
        responses={**responses, **out_of_scope("the sub-doc")},
    )
    async def read_sub_doc(
        request_id: s.RequestIdPath, body: SubDocIn, principal: PrincipalDep
    ) -> s.SubDocOut:
        """A sub-doc of the claimed request's workspace: its state and commit clock.

        Only a sub-doc the claimed stage declares (``sub_docs``; its job's, ``job:{job_id}``
        and ``job:{job_id}:*``, by default): another is 403.
        """
        request = await claim_holder(svc, request_id, body, principal, live=True)
        svc.flow.sub_doc_scope(request.stage).check(body.sub_doc, request_fields(request))
        doc = await svc.async_oplog.get_sub_doc(request.workspace_id, body.sub_doc)
        return s.SubDocOut(
            workspace_id=doc.workspace_id, sub_doc=doc.sub_doc, clock=doc.clock, state=doc.state
        )
