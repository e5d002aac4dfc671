"""Writing one run's :class:`~onceflow.lifecycle.outcome.Outcome` to the queue.

One write per outcome, retried at one level only: the queue's fenced write rides out a
database blip for as long as the claim's lease may hold (:meth:`Queue.fail`,
:meth:`Queue.finish`); a run whose write still fails is left as it is — the database
alone decides whether the lease holds, and the sweeper rescues a lapsed one.

A result the store refuses (too large, too deep, not JSON) fails the run permanently
with the refusal as its error; an error the store refuses is recorded as a brief one
(:func:`~onceflow.lifecycle.outcome.brief_error`), the retry decision kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from onceflow.context import StageContext
from onceflow.errors import InvalidRequest, LeaseLost, OnceflowError
from onceflow.lifecycle.outcome import Outcome, brief_error, failed
from onceflow.models.requests import Request
from onceflow.models.status import Status
from onceflow.payloads import error_payload
from onceflow.queue import Queue

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
                claim, outcome.error, retryable=outcome.retryable, retry_in=outcome.retry_in
            )
    except LeaseLost:
        return {"outcome": "lease_lost"}
    except InvalidRequest as exc:
        if brief:
            raise
        # The error itself cannot be stored (over a payload limit set low): the failure is
        # recorded all the same, with what can be — never left for the lease to lapse, which
        # would run the body again.
        log.error("request %s: the stage's error cannot be stored (%s)", claim.request_id, exc)
        short = failed(
            brief_error(outcome.error, exc), retryable=outcome.retryable, retry_in=outcome.retry_in
        )
        return _fail(queue, ctx, short, turn, brief=True)
    except OnceflowError as exc:
        # Retried for as long as the lease could hold; the sweeper rescues the row.
        log.error("request %s: failure not recorded: %s", claim.request_id, exc)
        return {"outcome": "failure_unknown", "error": str(exc)}
    return {"outcome": FAILED_AS.get(row.status, row.status.value), "status": row.status.value}


__all__ = ["FAILED_AS", "record"]
