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

from onceflow.context import StageContext
from onceflow.errors import InvalidRequest, LeaseLost, OnceflowError
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
    queue: Queue, ctx: StageContext, outcome: Outcome, turn: Turn = nullcontext
) -> tuple[dict[str, Any], list[Any]]:
    """Write ``outcome`` for ``ctx``'s claim: ``({"outcome": …}, hand-offs created)``.

    Outcomes: ``succeeded``, ``retry``, ``dead``, ``cancelled``, ``lease_lost``, and
    ``completion_unknown`` / ``failure_unknown`` when the database stayed away for the
    whole retry window (the row is left for the sweeper).
    """
    if outcome.kind == "lease_lost":
        return {"outcome": "lease_lost"}, []
    if outcome.kind == "failed":
        return _fail(queue, ctx, outcome, turn), []
    try:
        with turn():
            followed = queue.finish(ctx.claim, outcome.result, then=ctx.handoffs)
    except LeaseLost:
        return {"outcome": "lease_lost"}, []
    except InvalidRequest as exc:  # the result itself is refused (too large, not JSON)
        return _fail(queue, ctx, failed(error_payload(exc), retryable=False), turn), []
    except OnceflowError as exc:  # the database stayed away past the fenced write's window
        log.error("request %s: completion not recorded: %s", ctx.claim.request_id, exc)
        return {"outcome": "completion_unknown", "error": str(exc)}, []
    return {"outcome": "succeeded"}, list(followed)


def _fail(
    queue: Queue, ctx: StageContext, outcome: Outcome, turn: Turn, *, brief: bool = False
) -> dict[str, Any]:
    claim = ctx.claim
    try:
        with turn():
            row: Request = queue.fail(
                claim, outcome.error, retryable=outcome.retryable, retry_in=outcome.retry_in,
                count_attempt=outcome.counts_attempt,
            )  # fmt: skip
    except LeaseLost:
        return {"outcome": "lease_lost"}
    except InvalidRequest as exc:
        if brief:
            raise
        # The error itself cannot be stored (over a payload limit set low): the failure is
        # recorded all the same, with what can be — never left for the lease to lapse, which
        # would run the body again.
        log.error("request %s: the stage's error cannot be stored (%s)", claim.request_id, exc)
        short = replace(outcome, error=brief_error(outcome.error, exc))
        return _fail(queue, ctx, short, turn, brief=True)
    except OnceflowError as exc:
        # Retried for as long as the lease could hold; the sweeper rescues the row.
        log.error("request %s: failure not recorded: %s", claim.request_id, exc)
        return {"outcome": "failure_unknown", "error": str(exc)}
    return {"outcome": FAILED_AS.get(row.status, row.status.value), "status": row.status.value}


def record_many(
    queue: Queue, runs: Sequence[tuple[StageContext, Outcome]], turn: Turn = nullcontext
) -> list[dict[str, Any]]:
    """Write the outcomes of many claims (of one database): each as :func:`record` would.

    Successes without hand-offs go in one statement (:meth:`Queue.complete_many`),
    failures in another (:meth:`Queue.fail_many`), each row fenced by its own claim; a
    success that hands off is written alone (its follow-ups in the completion's
    transaction). A batch the store refuses as a whole (a result or error over a payload
    limit) is written again row by row, where :func:`record` fails a refused result
    permanently and shortens a refused error. ``turn`` is held around each write.

    Returns, in input order, what :func:`record` returns first: ``{"outcome": …}``, with
    ``completion_unknown`` / ``failure_unknown`` for rows the database did not confirm
    (the caller may try them again while their leases may hold), and ``not_recorded`` for
    a run whose outcome the store refuses even in brief (its lease is left to lapse).
    """
    out: list[dict[str, Any] | None] = [None] * len(runs)
    plain: list[int] = []
    failing: list[int] = []
    for i, (ctx, outcome) in enumerate(runs):
        if outcome.kind == "lease_lost":
            out[i] = {"outcome": "lease_lost"}
        elif outcome.kind == "failed":
            failing.append(i)
        elif ctx.handoffs:  # follow-ups are enqueued in the completion's transaction
            out[i] = _record_one(queue, ctx, outcome, turn)
        else:
            plain.append(i)
    if plain:
        items = [(runs[i][0].claim, runs[i][1].result) for i in plain]
        _batch(queue, runs, plain, out, turn, lambda: queue.complete_many(items), "completion")
    if failing:
        failures = [_failure(*runs[i]) for i in failing]
        _batch(queue, runs, failing, out, turn, lambda: queue.fail_many(failures), "failure")
    return [o if o is not None else {"outcome": "lease_lost"} for o in out]


def _record_one(queue: Queue, ctx: StageContext, outcome: Outcome, turn: Turn) -> dict[str, Any]:
    """:func:`record` of one run of a batch: never raises for that run alone (a brief
    error refused too, under a payload limit set absurdly low, is ``not_recorded``)."""
    try:
        return record(queue, ctx, outcome, turn)[0]
    except InvalidRequest as exc:
        log.error("request %s: the outcome cannot be stored: %s", ctx.claim.request_id, exc)
        return {"outcome": "not_recorded", "error": str(exc)}


def _failure(ctx: StageContext, outcome: Outcome) -> Failure:
    return Failure(
        ctx.claim, outcome.error, outcome.retryable, outcome.retry_in, outcome.counts_attempt
    )


def _batch(
    queue: Queue,
    runs: Sequence[tuple[StageContext, Outcome]],
    picked: list[int],
    out: list[dict[str, Any] | None],
    turn: Turn,
    write: Callable[[], Sequence[Request | LeaseLost]],
    what: str,
) -> None:
    """One batch statement for the runs ``picked``; its answers go to ``out``."""
    try:
        with turn():
            rows = write()
    except InvalidRequest as exc:  # refused as a whole: each row on its own, as record does
        log.warning("a batch of %d %s(s) was refused (%s); writing them one by one",
                    len(picked), what, exc)  # fmt: skip
        for i in picked:
            out[i] = _record_one(queue, *runs[i], turn)
        return
    except OnceflowError as exc:  # the database stayed away past the fenced write's window
        log.error("%d %s(s) not recorded: %s", len(picked), what, exc)
        for i in picked:
            out[i] = {"outcome": f"{what}_unknown", "error": str(exc)}
        return
    for i, row in zip(picked, rows, strict=True):
        if isinstance(row, LeaseLost):
            out[i] = {"outcome": "lease_lost"}
        elif runs[i][1].kind == "succeeded":
            out[i] = {"outcome": "succeeded"}
        else:
            out[i] = {"outcome": FAILED_AS.get(row.status, row.status.value),
                      "status": row.status.value}  # fmt: skip


__all__ = ["FAILED_AS", "record", "record_many"]
