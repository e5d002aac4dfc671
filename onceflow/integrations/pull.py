"""A pull worker over HTTP: a Python process that works like a browser tab.

It claims requests of its worker class from onceflow's HTTP API, heartbeats on a
thread every lease/3, runs a function, and completes or fails the request — the
same lifecycle a Celery stage has, with the claim token kept in this process
and sent only in request bodies::

    from onceflow.integrations.pull import PullWorker

    def work(ctx):                                # a WorkContext, as a stage body's
        ctx.check()                              # LeaseLost / Cancelled: stop here
        ctx.apply_op(f"job:{ctx.job_id}", {"type": "cell.set", ...}, key="cell:x")
        return {"done": True}                    # the result, completed (fenced)

    with PullWorker("http://127.0.0.1:8000", worker_key, "browser") as worker:
        worker.run(work)                         # until worker.stop() is called

A worker whose lease lapsed (paused, partitioned) learns it from its next
heartbeat or fenced call (409 lease_lost) and writes nothing more.

:class:`PullContext` implements :class:`onceflow.context.WorkContext`, the interface of a
Celery stage's :class:`~onceflow.context.StageContext`, so one body runs under either; its
``compute_once`` is the compute-lock protocol over the claim's lock routes
(:mod:`onceflow.integrations.pull_locks`); it lives in :mod:`onceflow.integrations.pull_context`.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any

import httpx
from opentelemetry.trace import Span

from onceflow import tracing
from onceflow.errors import BudgetExceeded, InvalidRequest, LeaseLost, OnceflowError
from onceflow.integrations.pull_claim import PullClaim, Release
from onceflow.integrations.pull_context import PullContext
from onceflow.integrations.pull_events import ClaimEvents
from onceflow.lifecycle import spans
from onceflow.lifecycle.outcome import Outcome, RetryOn, brief_error, decide
from onceflow.oplog import ApplyResult, SubDoc, TransportError
from onceflow.oplog.http import (
    RETRYABLE_STATUSES,
    apply_result,
    path_segment,
    raise_for_api_error,
    retry_after_seconds,
)
from onceflow.payloads import is_unreadable

log = logging.getLogger("onceflow.pull")

JSON = Any

__all__ = ["PullClaim", "PullContext", "PullWorker"]

#: The longest a retried call waits on a server's ``Retry-After`` (seconds) before trying.
RETRY_AFTER_CAP = 30.0


class PullWorker:
    """Claims and runs requests of one worker class over onceflow's HTTP API.

    A run's outcome is decided as under a Celery stage (:func:`onceflow.lifecycle.decide`):
    ``RetryLater(delay)`` runs the request again after ``delay`` (at most the server's
    ``ONCEFLOW_BACKOFF_MAX_SECONDS``), :class:`PermanentError` / :class:`InvalidRequest`
    fail it at once, ``retry_on`` (a tuple of exception types or a callable, as a stage's)
    decides the other exceptions, and a ``SystemExit`` / ``KeyboardInterrupt`` is reported
    as a retryable failure before it propagates.
    """

    def __init__(
        self,
        base_url: str,
        key: str,
        worker_class: str,
        *,
        worker_id: str | None = None,
        lease_seconds: float | None = None,
        timeout: float = 10.0,
        retries: int = 5,
        client: httpx.Client | None = None,
        retry_on: RetryOn = None,
    ) -> None:
        self.worker_class = worker_class
        #: Which exceptions of a body are worth a retry (as a stage's ``retry_on``: a tuple
        #: of exception types, or a callable; None: every one but the permanent errors).
        self.retry_on = retry_on
        self.worker_id = worker_id or (
            f"pull:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        )
        self.lease_seconds = lease_seconds
        self.retries = retries
        self._client = client or httpx.Client(base_url=base_url, timeout=timeout)
        self._owns_client = client is None
        self._headers = {"Authorization": f"Bearer {key}"}
        self._stop = threading.Event()

    # ------------------------------------------------------------- one call each

    def claim(self, wait: float = 0.0) -> PullClaim | None:
        """Claim the next due request of the worker class, or None if there is none.

        ``wait`` (0..60 s): a long poll — the server waits that long for a request to
        become claimable before answering "none". Not retried: a claim whose answer
        was lost is left to lapse (its lease runs out and another worker claims it).
        """
        body: dict[str, Any] = {"worker_id": self.worker_id}
        if self.lease_seconds is not None:
            body["lease_seconds"] = self.lease_seconds
        if wait:
            body["wait"] = wait
        url = f"/v1/worker-classes/{path_segment('worker_class', self.worker_class)}/claims"
        response = self._send("POST", url, body, retry=False, extra_timeout=wait)
        raise_for_api_error(response)
        if response.status_code == 204:
            return None
        data = response.json()
        return PullClaim(
            request_id=data["request_id"],
            token=data["claim_token"],
            lease_seconds=float(data["lease_seconds"]),
            lease_expires_at=datetime.fromisoformat(data["lease_expires_at"]),
            attempt=int(data["attempt"]),
            request=data["request"],
            trace_context=_text_or_none(data.get("trace_context")),
        )

    def heartbeat(self, claim: PullClaim) -> bool:
        """Extend the lease; returns ``cancel_requested``. Raises :class:`LeaseLost`."""
        data = self._claim_call(claim, "heartbeat", {})
        return bool(data["cancel_requested"])

    def complete(
        self, claim: PullClaim, result: JSON = None, *, then: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Finish the request with ``result`` (fenced); returns the request as stored."""
        return self._claim_call(claim, "complete", {"result": result, "then": then or []})

    # Queue.fail's arguments (alike by shape): the same call, sent over HTTP.
    def fail(
        self,
        claim: PullClaim,
        error: JSON,
        *,
        retryable: bool = True,
        retry_in: float | None = None,
    ) -> dict[str, Any]:
        """Report a failed run (fenced); returns the request: queued again, or dead."""
        body = {"error": error, "retryable": retryable, "retry_in": retry_in}
        return self._claim_call(claim, "fail", body)

    def apply_op(
        self,
        claim: PullClaim,
        sub_doc: str,
        op: dict[str, Any],
        *,
        key: str | None = None,
        op_id: str | None = None,
    ) -> ApplyResult:
        """A write fenced by ``claim``; ``key`` derives the op id, so a retried run joins it."""
        body = {"sub_doc": sub_doc, "op": op, "key": key, "op_id": op_id}
        data = self._claim_call(claim, "ops", body)
        return apply_result(data)

    def read_sub_doc(self, claim: PullClaim, sub_doc: str) -> SubDoc:
        """A sub-doc of the claimed request's workspace, read under the live claim."""
        data = self._claim_call(claim, "sub-docs", {"sub_doc": sub_doc})
        return SubDoc(data["workspace_id"], data["sub_doc"], data["clock"], data["state"])

    def acquire_lock(
        self, claim: PullClaim, task: str, ttl_seconds: float | None = None
    ) -> dict[str, Any]:
        """Take the compute lock of ``task`` on the claimed request's job: ``{acquired,
        lock_token, ttl_ms}`` or ``{locked, remaining_ms}`` (a lost answer's lock expires)."""
        body: dict[str, Any] = {"task": task}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        return self._claim_call(claim, "locks", body)

    def extend_lock(
        self, claim: PullClaim, task: str, lock_token: str, ttl_seconds: float | None = None
    ) -> bool:
        """Compare and extend a held lock: False once it expired or was taken."""
        body: dict[str, Any] = {"task": task, "lock_token": lock_token}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        return bool(self._claim_call(claim, "locks/extend", body)["held"])

    def release_lock(self, claim: PullClaim, task: str, lock_token: str, outcome: Release) -> bool:
        """Compare and delete a held lock, announcing ``lock_released`` to its waiters."""
        body = {"task": task, "lock_token": lock_token, "outcome": outcome}
        return bool(self._claim_call(claim, "locks/release", body)["released"])

    def claim_events(self, claim: PullClaim) -> ClaimEvents:
        """The claimed request's workspace events, once live (see :class:`ClaimEvents`)."""
        url = f"/v1/claims/{path_segment('request_id', claim.request_id)}/events"
        events = ClaimEvents(
            self._client, url, self._call_headers(claim.trace_context), claim.request_id,
            claim.token,
            workspace_id=claim.workspace_id,
        )  # fmt: skip
        timeout = self._client.timeout
        return events.open((timeout.connect or 10.0) + (timeout.read or 10.0))

    # ClaimClient.take_permit's signature (alike by shape): the protocol method, spelled out.
    def take_permit(
        self,
        claim: PullClaim,
        provider: str,
        tokens: int,
        permit_id: str,
        *,
        cell_key: str | None = None,
        wait: float = 0.0,
    ) -> dict[str, Any]:
        """Ask for a permit of ``provider`` under ``claim`` (a long poll of ``wait`` s):
        ``{granted: true, granted_at_ms, expires_in_ms}``, or ``{granted: false, reason,
        retry_after_ms}`` — ask again then, with the same ``permit_id`` (a POST repeated
        after a lost answer is the same permit). :class:`BudgetExceeded` when a budget
        refuses; a call without an answer raises :class:`TransportError` (not retried here:
        the caller asks again with the same id)."""
        body: dict[str, Any] = {"provider": provider, "tokens": tokens, "permit_id": permit_id,
                                "wait_seconds": wait}  # fmt: skip
        if cell_key is not None:
            body["cell_key"] = cell_key
        url = f"/v1/claims/{path_segment('request_id', claim.request_id)}/permits"
        response = self._send(
            "POST", url, {**_claim_body(claim), **body}, retry=False, extra_timeout=wait,
            keep=frozenset({429}), trace_context=claim.trace_context,
        )  # fmt: skip
        status = response.status_code
        if status == 429:  # the provider is busy (or the key's request rate is spent)
            data = _json_or_none(response) or {}
            retry_ms = data.get("retry_after_ms")
            if not isinstance(retry_ms, int):
                retry_ms = round(retry_after_seconds(response, RETRY_AFTER_CAP) * 1000)
            return {"granted": False, "reason": str(data.get("reason") or data.get("code")),
                    "retry_after_ms": retry_ms}  # fmt: skip
        if status == 402:
            raise budget_exceeded(_json_or_none(response) or {})
        raise_for_api_error(response, request_id=claim.request_id)
        data = response.json()
        return {**data, "granted": True}

    def permit_call(
        self, claim: PullClaim, permit_id: str, action: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """``settle``, ``rate-limited`` or ``release`` a permit held under ``claim``: safe
        to repeat (the server answers a repeat as the first), so retried on no answer."""
        if action not in ("settle", "rate-limited", "release"):
            raise InvalidRequest(f"no permit action {action!r}")
        return self._claim_call(claim, f"permits/{path_segment('permit_id', permit_id)}/{action}",
                                body)  # fmt: skip

    def _call_headers(self, trace_context: str | None = None) -> dict[str, str]:
        """The key, and the trace the call belongs to: the current span's when one is
        current (the run's), else ``trace_context`` (the claimed request's), else none."""
        current = tracing.current_carrier() if tracing.active() else None
        trace = tracing.headers_of(current or trace_context)
        return {**self._headers, **trace} if trace else self._headers

    # ---------------------------------------------------------------- the loop

    def run_once(self, func: Callable[[PullContext], JSON], *, wait: float = 0.0) -> str | None:
        """Claim one request and run ``func`` on it; the outcome, or None if nothing was due.

        Outcomes: ``succeeded``, ``retry``, ``dead``, ``cancelled``, ``lease_lost``.
        ``wait``: long-poll the claim (see :meth:`claim`).

        Traced as a Celery stage's run is (:mod:`onceflow.lifecycle.spans`): the run span,
        in the trace the claim's answer names, current while ``func`` runs; every log line
        meanwhile carries the request, workspace, stage and attempt.
        """
        claim = self.claim(wait)
        if claim is None:
            return None
        request = claim.request
        stage = str(request.get("stage") or "")
        span = spans.start_run(
            claim.trace_context, request_id=claim.request_id, stage=stage,
            worker_class=str(request.get("worker_class") or self.worker_class),
            attempt=claim.attempt, workspace_id=claim.workspace_id,
            lease_seconds=claim.lease_seconds,
        )  # fmt: skip
        trail: dict[str, Any] = {"outcome": "not_recorded", "error": None}
        try:
            with spans.running(
                span, request_id=claim.request_id, workspace_id=claim.workspace_id,
                stage=stage, attempt=claim.attempt,
            ):  # fmt: skip
                trail["outcome"] = self._run_claimed(claim, func, span, trail)
                return trail["outcome"]  # type: ignore[no-any-return]
        finally:
            spans.end_run(span, trail["outcome"], trail["error"])

    def _run_claimed(
        self,
        claim: PullClaim,
        func: Callable[[PullContext], JSON],
        span: Span | None,
        trail: dict[str, Any],
    ) -> str:
        """:meth:`run_once` of a claim taken, inside its span: the outcome (``trail``
        gets what ``func`` raised)."""
        stored: Any = claim.request.get("input")
        if is_unreadable(stored):  # a value stored before the depth limit: it never will run
            error: dict[str, Any] = {
                "type": "PermanentError",
                "message": f"input cannot be read: {stored['reason']}",
            }
            return self._fail(claim, error, retryable=False)
        ctx = PullContext(self, claim)
        beat = _Heartbeat(self, ctx, span)
        beat.start()
        try:
            try:
                result = func(ctx)
                ctx.check()
            except BaseException as exc:  # the outcome table decides, SystemExit included
                trail["error"] = exc
                ran = decide(exc, retry_on=self.retry_on, max_delay=math.inf)
                if ran.kind == "lease_lost":
                    log.warning("request %s: lease lost; nothing more is written", claim.request_id)
                    return "lease_lost"
                log.warning("request %s: the work raised %s", claim.request_id, type(exc).__name__)
                outcome = self._report(claim, ran, span)
                if ran.interrupted:
                    trail["outcome"] = outcome
                    raise
                return outcome
            handoffs = ctx.handoffs
            write = spans.write_span(
                spans.COMPLETE, span, {"onceflow.request_id": claim.request_id}
            )
            if write is not None and handoffs:
                write.set_attribute("onceflow.hand_offs", len(handoffs))
            try:
                with spans.current(write):
                    self.complete(claim, result, then=handoffs)
            except LeaseLost:
                spans.end_write(write, fenced=False)
                log.warning("request %s: lease lost; nothing more is written", claim.request_id)
                return "lease_lost"
            except Exception as exc:  # e.g. the result refused (too large): the same table
                spans.end_write(write, fenced=None, error=exc)
                log.warning("request %s: completion refused: %s", claim.request_id, exc)
                ran = decide(exc, retry_on=self.retry_on, max_delay=math.inf)
                return self._report(claim, ran, span)
            spans.end_write(write, fenced=True)
            return "succeeded"
        finally:
            beat.stop()

    def run(
        self,
        func: Callable[[PullContext], JSON],
        *,
        idle_wait: float = 1.0,
        max_runs: int | None = None,
    ) -> int:
        """Claim and run requests until :meth:`stop` (or ``max_runs``); returns how many ran.

        When nothing is due, its claim long-polls: the server holds it up to
        ``idle_wait`` seconds (at most 60) and answers as soon as a request of the
        class may be claimable (its NOTIFY, a due time). Transport errors back off
        and go on. :meth:`stop` takes effect after the current claim.
        """
        if isinstance(idle_wait, bool) or not isinstance(idle_wait, int | float):
            raise InvalidRequest("idle_wait must be a number of seconds in (0, 60]")
        if not 0 < idle_wait <= 60:  # NaN fails this too
            raise InvalidRequest("idle_wait must be a number of seconds in (0, 60]")
        runs = 0
        wait = float(idle_wait)
        while not self._stop.is_set() and (max_runs is None or runs < max_runs):
            try:
                outcome = self.run_once(func, wait=wait)
            except TransportError as exc:
                log.warning("pull worker: %s", exc)
                self._stop.wait(idle_wait)
                continue
            if outcome is not None:
                runs += 1
        return runs

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current request."""
        self._stop.set()

    def close(self) -> None:
        """Close the HTTP client if this worker made it."""
        if self._owns_client:
            self._client.close()

    # The context-manager protocol (alike by shape everywhere): Python fixes its signature.
    def __enter__(self) -> PullWorker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- helpers

    def _report(self, claim: PullClaim, ran: Outcome, span: Span | None = None) -> str:
        """Send a failed run's outcome (:func:`onceflow.lifecycle.decide`). A RetryLater's
        delay and a BudgetExceeded's budget (its ``on_exceeded``, when its period turns)
        travel in the error: the server decides them by the stage's declaration
        (``on_budget``) and clamps the wait to its own longest retry delay."""
        error = ran.error or {}
        kind = error.get("type")
        retry_in = None if kind in ("RetryLater", "BudgetExceeded") else ran.retry_in
        write = spans.write_span(spans.FAIL, span, {
            "onceflow.request_id": claim.request_id, "onceflow.retryable": ran.retryable,
        })  # fmt: skip
        try:
            with spans.current(write):
                outcome = self._fail(claim, error, retryable=ran.retryable, retry_in=retry_in)
        except BaseException as exc:
            spans.end_write(write, fenced=None, error=exc)
            raise
        if outcome == "lease_lost":
            spans.end_write(write, fenced=False)
        else:
            spans.end_write(write, fenced=True, outcome=outcome)
        return outcome

    def _fail(
        self,
        claim: PullClaim,
        error: dict[str, Any],
        *,
        retryable: bool,
        retry_in: float | None = None,
    ) -> str:
        try:
            try:
                row = self.fail(claim, error, retryable=retryable, retry_in=retry_in)
            except InvalidRequest as exc:
                # The error itself is refused (over the server's payload limits): the failure
                # is recorded all the same, briefly — never left for the lease to lapse.
                brief = brief_error(error, exc)
                row = self.fail(claim, brief, retryable=retryable, retry_in=retry_in)
        except LeaseLost:
            return "lease_lost"
        status = str(row.get("status"))
        return {"queued": "retry"}.get(status, status)

    def _claim_call(self, claim: PullClaim, action: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"/v1/claims/{path_segment('request_id', claim.request_id)}/{action}"
        response = self._send(
            "POST", url, {**_claim_body(claim), **body}, retry=True,
            trace_context=claim.trace_context,
        )  # fmt: skip
        raise_for_api_error(response, request_id=claim.request_id)
        data: dict[str, Any] = response.json()
        return data

    def _send(
        self,
        method: str,
        url: str,
        body: dict[str, Any],
        *,
        retry: bool,
        extra_timeout: float = 0.0,
        keep: frozenset[int] = frozenset(),
        trace_context: str | None = None,
    ) -> httpx.Response:
        """One call; with ``retry``, transport errors, 5xx and 408/425/429 are retried with
        backoff, the server's ``Retry-After`` as a floor (at most :data:`RETRY_AFTER_CAP`).

        Every call with ``retry`` is safe to repeat: a heartbeat extends the same
        lease, and a completion that landed makes its repeat a 409 (lease lost),
        never a second write. A 429 (the key's request rate spent) was not processed:
        a completion refused so is sent again once the server says, instead of being
        given up while its claim still holds (the browser SDK does the same). A status in
        ``keep`` is answered as it is (a permit's 429: the caller asks again itself).

        Each call carries a W3C ``traceparent``: the current span's, else ``trace_context``
        (the claimed request's), so the server's span of the call joins the run's trace.
        """
        headers = self._call_headers(trace_context)
        attempts = self.retries if retry else 1
        for attempt in range(1, attempts + 1):
            floor = 0.0
            try:
                kwargs: dict[str, Any] = {}
                if extra_timeout:  # a long poll: the server holds the answer that long
                    base = self._client.timeout
                    kwargs["timeout"] = httpx.Timeout(
                        connect=base.connect,
                        read=None if base.read is None else base.read + extra_timeout,
                        write=base.write,
                        pool=base.pool,
                    )
                response = self._client.request(method, url, json=body, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                error: TransportError = TransportError(f"{type(exc).__name__} on {url}")
                error.__cause__ = exc
            else:
                status = response.status_code
                if status in keep or (status < 500 and status not in RETRYABLE_STATUSES):
                    return response
                error = TransportError(f"the server answered {status} on {url}")
                floor = retry_after_seconds(response, RETRY_AFTER_CAP)
            if attempt == attempts:
                raise error
            delay = min(2.0, 0.05 * 2 ** (attempt - 1))
            time.sleep(max(floor, delay / 2 + random.uniform(0, delay / 2)))
        raise AssertionError("unreachable")  # pragma: no cover


def _json_or_none(response: httpx.Response) -> dict[str, Any] | None:
    try:
        data = response.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def budget_exceeded(body: dict[str, Any]) -> BudgetExceeded:
    """The :class:`BudgetExceeded` a 402 ``budget_exceeded`` answer stands for."""
    retry_in = body.get("retry_in")
    return BudgetExceeded(
        str(body.get("workspace_id", "")),
        str(body.get("period", "")),
        str(body.get("reason") or body.get("detail", "")),
        on_exceeded="wait" if body.get("on_exceeded") == "wait" else "fail",
        retry_at=body.get("retry_at") if isinstance(body.get("retry_at"), str) else None,
        retry_in=float(retry_in) if isinstance(retry_in, int | float) else None,
    )


def _claim_body(claim: PullClaim) -> dict[str, Any]:
    """What names the claim in a body: its token and, when known, its request's workspace."""
    body: dict[str, Any] = {"claim_token": claim.token}
    if claim.workspace_id is not None:
        body["workspace_id"] = claim.workspace_id
    return body


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class _Heartbeat(threading.Thread):
    """Extends the claim's lease every lease/3 until stopped; flags the context when it cannot."""

    def __init__(self, worker: PullWorker, ctx: PullContext, span: Span | None = None) -> None:
        super().__init__(name=f"onceflow-pull-heartbeat-{ctx.claim.request_id[:12]}", daemon=True)
        self._worker = worker
        self._ctx = ctx
        self._span = span  # the run's: a failed heartbeat is noted on it
        self._interval = ctx.claim.lease_seconds / 3
        self._stop_event = threading.Event()

    def run(self) -> None:
        ctx = self._ctx
        while not self._stop_event.wait(self._interval):
            try:
                with spans.current(self._span):  # its server span joins the run's
                    cancel = self._worker.heartbeat(ctx.claim)
            except LeaseLost as exc:
                spans.heartbeat_failed(self._span, exc)
                ctx.mark_lease_lost()
                return
            except OnceflowError as exc:  # transport trouble: the lease may still hold
                spans.heartbeat_failed(self._span, exc)
                log.warning("request %s: heartbeat failed: %s", ctx.claim.request_id, exc)
                continue
            if cancel:
                ctx.mark_cancel_requested()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=10)
