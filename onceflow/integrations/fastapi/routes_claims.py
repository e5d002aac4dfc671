"""The ``/v1`` claim routes of HTTP pull workers: claim (long poll), heartbeat, complete, fail,
and an op written under the claim's fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response

from onceflow.errors import InvalidRequest, LeaseLost
from onceflow.ids import check_id
from onceflow.integrations.fastapi import budget_refusals
from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.auth import WILDCARD, Principal, PrincipalDep, get_principal
from onceflow.integrations.fastapi.claim_terms import ClaimTerms
from onceflow.integrations.fastapi.responses import _responses
from onceflow.integrations.fastapi.routes_ops import _apply_out
from onceflow.integrations.fastapi.routes_requests import _follow_up, _request_out
from onceflow.integrations.fastapi.services import OnceflowServices
from onceflow.lifecycle.outcome import OnBudget, reported
from onceflow.models import Claim, ClaimRef, NewRequest, WorkspaceScope
from onceflow.oplog import stage_op_id
from onceflow.queue import AsyncQueue
from onceflow.spend.limits import async_redis
from onceflow.tracing.carrier import MAX_STORED


# Route decorators alike by shape on purpose: FastAPI builds the OpenAPI contract from each one.
def _claim_routes(router: APIRouter, svc: OnceflowServices) -> None:
    terms = ClaimTerms(svc.flow, svc.settings)  # what a claim may ask for: claim_terms.py

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
        queue = svc.async_queue
        # Each stage's lease (the client's as a ceiling) and run deadline, set by the
        # claim's own statement on the database clock, as a Celery worker's claim gets them.
        lease, runtime, stage_terms = terms.claim(wc, body.lease_seconds)

        scope = get_principal(request).claim_workspaces  # None: every workspace

        async def claim_now() -> list[Claim]:
            return await queue.claim_next(
                wc, body.worker_id, 1,
                lease_seconds=lease, max_runtime=runtime, stage_terms=stage_terms,
                workspaces=scope,
            )  # fmt: skip

        if body.wait > 0 and svc.settings.notify:
            claims = await _in_line(svc, wc, body.wait, request, claim_now, scope)
        else:
            claims = await claim_now()
            if not claims and body.wait > 0:
                claims = await _long_poll(queue, wc, body.wait, request, claim_now, scope)
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
            trace_context=_stored_trace(claim),
        )

    @router.post(
        "/claims/{request_id}/heartbeat",
        operation_id="heartbeat",
        tags=["pull workers"],
        response_model=s.HeartbeatOut,
        responses=_responses(409, 503),
    )
    async def heartbeat(
        request_id: s.RequestIdPath, body: s.HeartbeatIn, principal: PrincipalDep
    ) -> s.HeartbeatOut:
        """Extend the lease; 409 lease_lost once it is gone (stop and write nothing).

        Never past the run deadline (the stage's ``max_runtime`` from the claim); a
        ``lease_seconds`` longer than the stage's lease is 422, the lease unchanged.
        """
        ref = claim_ref(request_id, body.claim_token, principal, body.workspace_id)
        if body.lease_seconds is not None:
            held = await svc.async_queue.live_claim(
                ref.request_id, ref.token, worker_classes=ref.worker_classes,
                workspace_id=ref.workspace_id, workspaces=ref.workspaces,
            )  # fmt: skip
            if held is None:
                raise LeaseLost(request_id)
            terms.check_heartbeat(held.stage, body.lease_seconds)
        beat = await svc.async_queue.heartbeat(ref, lease_seconds=body.lease_seconds)
        return s.HeartbeatOut(
            lease_expires_at=beat.lease_expires_at, cancel_requested=beat.cancel_requested
        )

    @router.post(
        "/claims/{request_id}/complete",
        operation_id="complete",
        tags=["pull workers"],
        response_model=s.RequestOut,
        responses={**_responses(409, 413, 503), **out_of_scope("a hand-off target")},
    )
    async def complete(
        request_id: s.RequestIdPath, body: s.CompleteIn, principal: PrincipalDep
    ) -> s.RequestOut:
        """Finish the claimed request (fenced: a zombie's late completion is 409, no change).

        ``then`` hands off only to the stages the claimed stage declares (``hands_off_to``;
        none when it declares none): another is 403 and nothing changes. Each follow-up
        counts as one request against the key's rate limit (429 before anything is written).
        """
        ref = claim_ref(request_id, body.claim_token, principal, body.workspace_id)
        queue = svc.async_queue
        then: list[NewRequest] = []
        if body.then:
            # Follow-ups are named after their parent (workspace, job, branch): read it, as
            # the claim's holder sees it — or as its own completion left it, when this is a
            # retry whose answer was lost (the hand-off then recognises its landed write);
            # the hand-off statement fences on the token again.
            parent = await queue.claim_parent(ref)
            if parent is None:
                raise LeaseLost(request_id)
            # Only to the stages the claimed stage declares (hands_off_to): 403, nothing
            # written; then each follow-up is one more unit of the key's rate limit (429).
            targets = [f.stage for f in body.then]
            svc.flow.check_hand_offs(parent.stage, targets, declared_only=True)
            then = [_follow_up(svc.flow, parent, f) for f in body.then]
            await svc.rate_limits.charge(principal, len(then))
        done, followed = await queue.hand_off(ref, body.result, then=then)
        for made in followed:
            await svc.wake(made)  # a hand-off that collapsed onto an existing row has its own
        return _request_out(done)

    @router.post(
        "/claims/{request_id}/fail",
        operation_id="fail",
        tags=["pull workers"],
        response_model=s.RequestOut,
        responses=_responses(409, 413, 503),
    )
    async def fail(
        request_id: s.RequestIdPath, body: s.FailIn, principal: PrincipalDep
    ) -> s.RequestOut:
        """Report a failed run: queued again after a backoff, or dead past its attempts.

        The outcome table every runner shares (``onceflow.lifecycle``), read from the
        report: an ``error`` whose ``type`` is ``PermanentError``, ``InvalidRequest``,
        ``OutOfScope`` or ``Cancelled`` is never retried; a ``RetryLater`` error without
        ``retry_in`` is retried after its ``delay``, at most
        ``ONCEFLOW_BACKOFF_MAX_SECONDS``; a ``BudgetExceeded`` error, when this server
        refused a permit of this claim with a 402, does what the claimed stage declares
        (``on_budget``), else what the refusing budget's ``on_exceeded`` says: a wait is
        retried when the period turns (its ``retry_in``, at most that longest delay) with
        its attempt given back, a fail is dead at once. A ``BudgetExceeded`` the server did
        not answer the claim with is an ordinary failure, its attempt counted.
        """
        ref = claim_ref(request_id, body.claim_token, principal, body.workspace_id)
        if body.retry_in is not None:
            terms.check_retry_in(body.retry_in)
        on_budget, refusal = None, None
        if isinstance(body.error, dict) and body.error.get("type") == "BudgetExceeded":
            on_budget, refusal = await budget_refusal(ref)
        ran = reported(
            body.error,
            retryable=body.retryable,
            retry_in=body.retry_in,
            max_delay=float(svc.settings.backoff_max_seconds),
            on_budget=on_budget,
            refusal=refusal,
        )
        failed = await svc.async_queue.fail(
            ref, ran.error, retryable=ran.retryable, retry_in=ran.retry_in,
            count_attempt=ran.counts_attempt,
        )  # fmt: skip
        return _request_out(failed)

    async def budget_refusal(ref: ClaimRef) -> tuple[OnBudget, dict[str, Any] | None]:
        """The claimed stage's ``on_budget`` and the budget refusal the permit route
        answered this claim with (None: it answered none), read under the claim. Both None
        when the claim is not live (the failure's own fenced statement then refuses it, or
        recognises its landed write); no ``on_budget`` when the Flow does not declare the
        stage."""
        held = await svc.async_queue.live_claim(
            ref.request_id, ref.token, worker_classes=ref.worker_classes,
            workspace_id=ref.workspace_id, workspaces=ref.workspaces,
        )  # fmt: skip
        if held is None:
            return None, None
        spec = svc.flow.stages.get(held.stage)
        client, _ = async_redis(svc.settings.redis_url)
        refusal = await budget_refusals.refused(
            client, held.workspace_id, ref.request_id, ref.token
        )
        return (None if spec is None else spec.on_budget), refusal

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
            **out_of_scope("the sub-doc"),
        },
    )
    async def claim_op(
        request_id: s.RequestIdPath, body: s.ClaimOpIn, principal: PrincipalDep, response: Response
    ) -> s.ApplyOut:
        """Write to a sub-doc of the claimed request's workspace, fenced by the claim.

        Only to a sub-doc the claimed stage declares (``sub_docs``; its job's, ``job:{job_id}``
        and ``job:{job_id}:*``, by default): another is 403 and nothing is written.
        """
        ref = claim_ref(request_id, body.claim_token, principal, body.workspace_id)
        op_id = body.op_id or (stage_op_id(request_id, body.key) if body.key else None)
        if op_id is None:
            raise InvalidRequest("give key (or op_id), so that a retried write is applied once")
        # No workspace given: the fence's own statement names the claimed request's.
        # The scope is checked on the fenced row, in the write's own transaction.
        result = await svc.async_oplog.apply_op(
            None, body.sub_doc, body.op, op_id, fence=ref, sub_docs=svc.flow.sub_doc_scope
        )
        return _apply_out(result, response)


def _stored_trace(claim: Claim) -> str | None:
    """The claimed row's stored trace context (None when none was stored, or one too long
    to pass on)."""
    stored = getattr(claim, "trace_context", None)
    return stored if isinstance(stored, str) and 0 < len(stored) <= MAX_STORED else None


def out_of_scope(what: str) -> dict[int | str, dict[str, Any]]:
    """The 403 of a claim route that reaches past what the claimed stage declares."""
    text = (
        f"The key is not a worker key of this worker class, or {what} is outside what the "
        "claimed stage declares (`sub_docs`, `hands_off_to`; code forbidden)"
    )
    return {403: {"model": s.ErrorOut, "description": text}}


def claim_ref(
    request_id: str, token: str, principal: Principal, workspace_id: str | None = None
) -> ClaimRef:
    """What a pull worker holds, scoped to the worker classes its key may work and the
    workspaces it may claim in.

    Nothing is read: the fenced statement itself checks token, live lease, class and
    workspace, and finds the row by its key when the client sent the workspace (by its id
    alone when not). One answer (409 lease_lost) for "no such request", "not in that
    workspace", "not your worker class", "not one of your workspaces", "not running" and
    "wrong token": a worker key learns nothing about requests it holds no claim on.
    """
    check_id("request_id", request_id)
    if workspace_id is not None:
        check_id("workspace_id", workspace_id)
        if not principal.may_claim_in(workspace_id):
            raise LeaseLost(request_id)  # the statement would refuse it too
    scope = None if WILDCARD in principal.worker_classes else tuple(principal.worker_classes)
    return ClaimRef(request_id, token, scope, workspace_id, principal.claim_workspaces)


async def _in_line(
    svc: OnceflowServices,
    wc: str,
    wait: float,
    request: Request,
    claim_now: Callable[[], Awaitable[list[Claim]]],
    workspaces: WorkspaceScope | None,
) -> list[Claim]:
    """Claim now, else wait in ``wc``'s line of this process (one waiter woken per
    claimable row) and claim when woken, for up to ``wait`` s; [] on timeout or disconnect."""
    line = await svc.claim_lines().line(wc)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        claims = await line.claim(claim_now, wait, workspaces, watcher)
        if claims and watcher.done():
            # The client left while we claimed: hand the claim back (no attempt counted)
            # instead of letting its lease lapse as a crash.
            await svc.async_queue.release(claims)
            return []
        return claims
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


async def _long_poll(
    queue: AsyncQueue,
    wc: str,
    wait: float,
    request: Request,
    claim_now: Callable[[], Awaitable[list[Claim]]],
    workspaces: WorkspaceScope | None = None,
) -> list[Claim]:
    """Wait for work of ``wc`` (in ``workspaces``; None: any) and claim it, for up to
    ``wait`` s; [] on timeout or disconnect."""
    deadline = time.monotonic() + wait

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        while (left := deadline - time.monotonic()) > 0:
            waiter = asyncio.ensure_future(queue.wait_for_work(wc, left, workspaces=workspaces))
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await waiter  # retrieved: a failed wait logs no "never retrieved"
                return []
            if waiter.result():
                claims = await claim_now()
                if claims and watcher.done():
                    # The client left while we claimed: hand the claim back (no attempt
                    # counted) instead of letting its lease lapse as a crash.
                    await queue.release(claims)
                    return []
                if claims:
                    return claims
        return []
    finally:
        watcher.cancel()
