"""Writing runs' :class:`~onceflow.lifecycle.outcome.Outcome` to the queue.

:func:`record` writes one run's outcome (the Celery stage task, the HTTP routes);
:func:`record_many` writes many in a few round trips (the standalone worker's completer:
one statement for the successes, one for the failures — group commit). Both end the same
way for the same outcome. Each write is retried at one level only: the queue's fenced
write rides out a database blip for as long as the claim's lease may hold
(:meth:`Queue.fail`, :meth:`Queue.finish` and their batch forms); a run whose write
still fails is reported as not recorded (``*_unknown``) — the database alone decides
whether the lease holds, and the sweeper rescues a lapsed one.

A result the store refuses (too large, too deep, not JSON) fails the run permanently
with the refusal as its error; an error the store refuses is recorded as a brief one
(:func:`~onceflow.lifecycle.outcome.brief_error`), the retry decision kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from onceflow.context import StageContext
from onceflow.errors import InvalidRequest, LeaseLost, OnceflowError
from onceflow.lifecycle import spans
from onceflow.lifecycle.outcome import Outcome, brief_error, failed
from onceflow.models.requests import Request
from onceflow.models.status import Status
from onceflow.payloads import error_payload
from onceflow.queue import Failure, Queue

log = logging.getLogger("onceflow.lifecycle")

#: Holds the claim's turn while its outcome is written (no heartbeat for it meanwhile).
Turn = Callable[[], AbstractContextManager[Any]]

#: The outcome names a runner reports, by the row's status after a failure.
FAILED_AS = {Status.QUEUED: "retry", Status.DEAD: "dead", Status.CANCELLED: "cancelled"}


def record(
    queue: Queue,
    ctx: StageContext,
    outcome: Outcome,
    turn: Turn = nullcontext,
    span: Span | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """Write ``outcome`` for ``ctx``'s claim: ``({"outcome": …}, hand-offs created)``.

    Outcomes: ``succeeded``, ``retry``, ``dead``, ``cancelled``, ``lease_lost``, and
    ``completion_unknown`` / ``failure_unknown`` when the database stayed away for the
    whole retry window (the row is left for the sweeper).

    Traced under ``span``, the run's (:mod:`onceflow.lifecycle.spans`; None: not traced):
    an ``onceflow.complete`` or ``onceflow.fail`` span, and ``onceflow.hand_off`` under the
    completion when it hands off — current while the follow-ups are written, so their rows
    keep its trace.
    """
    if outcome.kind == "lease_lost":
        return {"outcome": "lease_lost"}, []
    if outcome.kind == "failed":
        return _fail(queue, ctx, outcome, turn, span), []
    rid = ctx.claim.request_id
    handoffs = ctx.handoffs
    write = spans.write_span(spans.COMPLETE, span, {"onceflow.request_id": rid})
    handing = None
    if write is not None and handoffs:
        attributes: dict[str, AttributeValue] = {
            "onceflow.request_id": rid, "onceflow.hand_offs": len(handoffs),
        }  # fmt: skip
        handing = spans.write_span(spans.HAND_OFF, write, attributes, kind=SpanKind.PRODUCER)
    try:
        with turn(), spans.current(handing):
            followed = queue.finish(
                ctx.claim, outcome.result, then=handoffs, locks=ctx.lock_outcomes
            )
    except LeaseLost:
        spans.end_write(handing, fenced=False)
        spans.end_write(write, fenced=False)
        return {"outcome": "lease_lost"}, []
    except InvalidRequest as exc:  # the result itself is refused (too large, not JSON)
        spans.end_write(handing, fenced=None, error=exc)
        spans.end_write(write, fenced=None, error=exc)
        return _fail(queue, ctx, failed(error_payload(exc), retryable=False), turn, span), []
    except OnceflowError as exc:  # the database stayed away past the fenced write's window
        spans.end_write(handing, fenced=None, error=exc)
        spans.end_write(write, fenced=None, error=exc)
        log.error("request %s: completion not recorded: %s", rid, exc)
        return {"outcome": "completion_unknown", "error": str(exc)}, []
    except BaseException as exc:  # interrupted (a soft time limit, an exit): spans end too
        spans.end_write(handing, fenced=None, error=exc)
        spans.end_write(write, fenced=None, error=exc)
        raise
    if handing is not None:
        spans.end_write(handing, fenced=True, created=sum(1 for f in followed if f.created))
    spans.end_write(write, fenced=True)
    return {"outcome": "succeeded"}, list(followed)


def _fail(
    queue: Queue,
    ctx: StageContext,
    outcome: Outcome,
    turn: Turn,
    span: Span | None,
    *,
    brief: bool = False,
) -> dict[str, Any]:
    claim = ctx.claim
    write = spans.write_span(spans.FAIL, span, {
        "onceflow.request_id": claim.request_id, "onceflow.retryable": outcome.retryable,
    })  # fmt: skip
    try:
        with turn():
            row: Request = queue.fail(
                claim, outcome.error, retryable=outcome.retryable, retry_in=outcome.retry_in,
                count_attempt=outcome.counts_attempt, locks=ctx.lock_outcomes,
            )  # fmt: skip
    except LeaseLost:
        spans.end_write(write, fenced=False)
        return {"outcome": "lease_lost"}
    except InvalidRequest as exc:
        spans.end_write(write, fenced=None, error=exc)
        if brief:
            raise
        # The error itself cannot be stored (over a payload limit set low): the failure is
        # recorded all the same, with what can be — never left for the lease to lapse, which
        # would run the body again.
        log.error("request %s: the stage's error cannot be stored (%s)", claim.request_id, exc)
        short = replace(outcome, error=brief_error(outcome.error, exc))
        return _fail(queue, ctx, short, turn, span, brief=True)
    except OnceflowError as exc:
        spans.end_write(write, fenced=None, error=exc)
        # Retried for as long as the lease could hold; the sweeper rescues the row.
        log.error("request %s: failure not recorded: %s", claim.request_id, exc)
        return {"outcome": "failure_unknown", "error": str(exc)}
    except BaseException as exc:
        spans.end_write(write, fenced=None, error=exc)
        raise
    ended = FAILED_AS.get(row.status, row.status.value)
    spans.end_write(write, fenced=True, outcome=ended)
    return {"outcome": ended, "status": row.status.value}


def record_many(
    queue: Queue,
    runs: Sequence[tuple[StageContext, Outcome]],
    turn: Turn = nullcontext,
    run_spans: Sequence[Span | None] | None = None,
) -> list[dict[str, Any]]:
    """Write the outcomes of many claims (of one database): each as :func:`record` would.

    Successes without hand-offs go in one statement (:meth:`Queue.complete_many`),
    failures in another (:meth:`Queue.fail_many`), each row fenced by its own claim and
    with its compute-lock outcomes for its history row; a success that hands off is
    written alone (its follow-ups in the completion's transaction). A batch the store
    refuses as a whole (a result or error over a payload limit) is written again row by
    row, where :func:`record` fails a refused result permanently and shortens a refused
    error. ``turn`` is held around each write.

    Returns, in input order, what :func:`record` returns first: ``{"outcome": …}``, with
    ``completion_unknown`` / ``failure_unknown`` for rows the database did not confirm
    (the caller may try them again while their leases may hold), and ``not_recorded`` for
    a run whose outcome the store refuses even in brief (its lease is left to lapse).

    ``run_spans``: the runs' spans, in input order: each row's write is traced under its
    run's span, as :func:`record` traces it (a batch statement gives each row its own
    span, of the statement's duration).
    """
    parents: Sequence[Span | None] = run_spans or [None] * len(runs)
    out: list[dict[str, Any] | None] = [None] * len(runs)
    plain: list[int] = []
    failing: list[int] = []
    for i, (ctx, outcome) in enumerate(runs):
        if outcome.kind == "lease_lost":
            out[i] = {"outcome": "lease_lost"}
        elif outcome.kind == "failed":
            failing.append(i)
        elif ctx.handoffs:  # follow-ups are enqueued in the completion's transaction
            out[i] = _record_one(queue, ctx, outcome, turn, parents[i])
        else:
            plain.append(i)
    if plain:
        items = [(runs[i][0].claim, runs[i][1].result, runs[i][0].lock_outcomes) for i in plain]
        complete = lambda: queue.complete_many(items)  # noqa: E731
        _batch(queue, runs, plain, out, turn, complete, "completion", parents)
    if failing:
        failures = [_failure(*runs[i]) for i in failing]
        fail = lambda: queue.fail_many(failures)  # noqa: E731
        _batch(queue, runs, failing, out, turn, fail, "failure", parents)
    return [o if o is not None else {"outcome": "lease_lost"} for o in out]


def _record_one(
    queue: Queue, ctx: StageContext, outcome: Outcome, turn: Turn, span: Span | None
) -> dict[str, Any]:
    """:func:`record` of one run of a batch: never raises for that run alone (a brief
    error refused too, under a payload limit set absurdly low, is ``not_recorded``)."""
    try:
        return record(queue, ctx, outcome, turn, span)[0]
    except InvalidRequest as exc:
        log.error("request %s: the outcome cannot be stored: %s", ctx.claim.request_id, exc)
        return {"outcome": "not_recorded", "error": str(exc)}


def _failure(ctx: StageContext, outcome: Outcome) -> Failure:
    return Failure(
        ctx.claim, outcome.error, outcome.retryable, outcome.retry_in, outcome.counts_attempt,
        ctx.lock_outcomes,
    )  # fmt: skip


def _batch(
    queue: Queue,
    runs: Sequence[tuple[StageContext, Outcome]],
    picked: list[int],
    out: list[dict[str, Any] | None],
    turn: Turn,
    write: Callable[[], Sequence[Request | LeaseLost]],
    what: str,
    parents: Sequence[Span | None],
) -> None:
    """One batch statement for the runs ``picked``; its answers go to ``out``."""
    writes = _batch_spans(runs, picked, what, parents)
    try:
        with turn():
            rows = write()
    except InvalidRequest as exc:  # refused as a whole: each row on its own, as record does
        for w in writes:
            spans.end_write(w, fenced=None, error=exc)
        log.warning("a batch of %d %s(s) was refused (%s); writing them one by one",
                    len(picked), what, exc)  # fmt: skip
        for i in picked:
            out[i] = _record_one(queue, *runs[i], turn, parents[i])
        return
    except OnceflowError as exc:  # the database stayed away past the fenced write's window
        for w in writes:
            spans.end_write(w, fenced=None, error=exc)
        log.error("%d %s(s) not recorded: %s", len(picked), what, exc)
        for i in picked:
            out[i] = {"outcome": f"{what}_unknown", "error": str(exc)}
        return
    for k, (i, row) in enumerate(zip(picked, rows, strict=True)):
        w = writes[k] if writes else None
        if isinstance(row, LeaseLost):
            out[i] = {"outcome": "lease_lost"}
            spans.end_write(w, fenced=False)
        elif runs[i][1].kind == "succeeded":
            out[i] = {"outcome": "succeeded"}
            spans.end_write(w, fenced=True)
        else:
            ended = FAILED_AS.get(row.status, row.status.value)
            out[i] = {"outcome": ended, "status": row.status.value}
            spans.end_write(w, fenced=True, outcome=ended)


def _batch_spans(
    runs: Sequence[tuple[StageContext, Outcome]],
    picked: list[int],
    what: str,
    parents: Sequence[Span | None],
) -> list[Span | None]:
    """Each picked row's write span, under its run's (empty when tracing is off or the
    runs have no spans)."""
    if not any(parents[i] is not None for i in picked):
        return []
    name = spans.COMPLETE if what == "completion" else spans.FAIL
    out: list[Span | None] = []
    for i in picked:
        ctx, outcome = runs[i]
        attributes: dict[str, AttributeValue] = {"onceflow.request_id": ctx.claim.request_id}
        if outcome.failed:
            attributes["onceflow.retryable"] = outcome.retryable
        out.append(spans.write_span(name, parents[i], attributes))
    return out


__all__ = ["FAILED_AS", "record", "record_many"]
