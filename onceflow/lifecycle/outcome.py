"""What a stage body's run comes to: the outcome table every runner shares.

A pure function of what the body did (returned a result, or raised), the stage's
``retry_on`` and the backoff cap: no I/O, no clock. The Celery stage task, the standalone
:class:`~onceflow.worker.Worker`, the Python pull worker and the HTTP ``fail`` route all
decide through it, so one body gives the same rows under each.

=====================================  ====================================================
The body                               The outcome
=====================================  ====================================================
returned                               succeeded (the result, as the store takes it)
raised :class:`RetryLater` (delay)     failed, retried after ``delay`` seconds, clamped to
                                       ``[0, ONCEFLOW_BACKOFF_MAX_SECONDS]`` (a delay that
                                       is not a number, negative, or NaN: the backoff)
raised :class:`PermanentError`,        failed, dead at once (no retry)
:class:`InvalidRequest`,
:class:`OutOfScope`
raised :class:`BudgetExceeded`         the stage's ``on_budget``, else the budget's
                                       ``on_exceeded``: ``fail``: dead at once; ``wait``:
                                       failed, retried at the next period's start (its
                                       ``retry_in``, clamped as a RetryLater delay), the
                                       attempt not counted (``counts_attempt`` False)
raised :class:`Cancelled`              failed, not retried (the row ends ``cancelled``)
raised :class:`LeaseLost`              nothing recorded: another worker owns the request
ran past ``max_runtime``               failed, retried after the backoff whatever
(:class:`MaxRuntimeExceeded`; Celery's ``retry_on`` says (dead at ``max_attempts``),
``SoftTimeLimitExceeded``; or no       error type ``MaxRuntimeExceeded``; not a crash
outcome when the lease ended at the    (``crash_attempts`` unchanged)
run deadline)
raised an error marked ``retryable``   failed, retried after the backoff (e.g.
                                       :class:`LockUnavailable`)
raised an exception of ``retry_on``    failed, retried after the backoff
raised another exception               with ``retry_on`` given: dead at once; without:
                                       retried after the backoff
raised a BaseException (SystemExit,    failed, retried after the backoff — interrupted, not
KeyboardInterrupt)                     wrong; ``interrupted`` tells the runner to re-raise
                                       where the interruption must go on (a Celery process)
=====================================  ====================================================

A failed run is dead once its attempts reach the stage's ``max_attempts``: the store
decides that, on the row, in the failure's own statement. A budget wait is not a try of
the body's work: its attempt is given back in that statement (as a claim handed back
unstarted is), so a stage with few ``max_attempts`` waits for the period to turn instead
of going dead. A call that could not fit a budget even in an empty period carries no
``retry_in`` and is dead at once, whatever the stage declares.
A pull worker's report of a ``BudgetExceeded`` counts as one only when the server refused
a permit of that claim itself (see :func:`reported`); else it is an ordinary failure.

A run past ``max_runtime`` gets the same row under every runner. The Celery stage task
records it itself (Celery's soft time limit raises in the body at ``max_runtime``). A
body no one can interrupt (a standalone worker's thread, a pull worker's) keeps running,
but heartbeats stop extending its lease at the run deadline (claim time +
``max_runtime``, database clock); the sweeper then records the failure as this table
says (:data:`~onceflow.queue.sweep.OVERRAN_ERROR`) instead of rescuing a crash, and the
body's late writes are fenced off. The request runs again only after the backoff, under
a new claim: never two runs at once under live claims.

An error or result the store refuses is recorded as a brief error (:func:`brief_error`),
the retry decision kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from onceflow.errors import (
    BudgetExceeded,
    Cancelled,
    InvalidRequest,
    LeaseLost,
    MaxRuntimeExceeded,
    PermanentError,
    RetryLater,
)
from onceflow.payloads import MESSAGE_CHARS, error_payload, storable_text

#: What decides whether an exception is worth a retry: a stage's tuple of exception types,
#: a callable (the standalone worker's ``retry_on``), or None (every exception is).
RetryOn = tuple[type[BaseException], ...] | Callable[[BaseException], bool] | None

#: Error types a report over HTTP may name that are never retried (the same as raising them).
PERMANENT_TYPES = frozenset({"PermanentError", "InvalidRequest", "OutOfScope", "Cancelled"})

Kind = Literal["succeeded", "failed", "lease_lost"]

#: What a stage declares a budget refusal does (``Flow.stage(on_budget=…)``); None: what
#: the budget itself says (its ``on_exceeded``).
OnBudget = Literal["fail", "wait"] | None
ON_BUDGET: Final = ("fail", "wait")


def check_on_budget(value: object) -> OnBudget:
    """A stage's ``on_budget``: ``"fail"``, ``"wait"`` or None; else InvalidRequest."""
    if value is None or value in ON_BUDGET:
        return value
    raise InvalidRequest(f'on_budget must be "fail", "wait" or None, got {value!r}')


@dataclass(frozen=True, slots=True)
class Outcome:
    """What to record for one run.

    ``kind``: ``succeeded`` (``result``), ``failed`` (``error``, ``retryable``,
    ``retry_in`` — None: the store's backoff), or ``lease_lost`` (record nothing).
    ``interrupted``: the body was stopped by a BaseException, which the runner may re-raise
    once the failure is recorded. ``counts_attempt`` False: a retry that gives the run's
    attempt back (a budget wait).
    """

    kind: Kind
    result: Any = None
    error: dict[str, Any] | None = None
    retryable: bool = False
    retry_in: float | None = None
    interrupted: bool = False
    counts_attempt: bool = True

    @property
    def failed(self) -> bool:
        return self.kind == "failed"


def succeeded(result: Any) -> Outcome:
    """The body returned ``result``."""
    return Outcome("succeeded", result=result)


def lease_lost() -> Outcome:
    """The lease is gone: nothing may be written."""
    return Outcome("lease_lost")


def failed(error: dict[str, Any], *, retryable: bool, retry_in: float | None = None) -> Outcome:
    """A failed run with ``error`` as stored."""
    return Outcome("failed", error=error, retryable=retryable, retry_in=retry_in)


def decide(
    exc: BaseException, *, retry_on: RetryOn = None, max_delay: float, on_budget: OnBudget = None
) -> Outcome:
    """The outcome of a body that raised ``exc`` (the table above).

    ``retry_on`` and ``on_budget``: the stage's. ``max_delay``: the longest retry delay
    (``ONCEFLOW_BACKOFF_MAX_SECONDS``), the clamp of a :class:`RetryLater` delay.
    """
    if isinstance(exc, LeaseLost):
        return lease_lost()
    if isinstance(exc, Cancelled):
        return failed({"type": "Cancelled"}, retryable=False)
    if isinstance(exc, RetryLater):
        delay = clamp_delay(exc.delay, max_delay)
        reason = storable_text(str(exc.reason), MESSAGE_CHARS)
        error = {"type": "RetryLater", "message": reason, "delay": delay}
        return failed(error, retryable=True, retry_in=delay)
    if isinstance(exc, BudgetExceeded):
        return budget_refused(exc, on_budget, max_delay)
    if isinstance(exc, MaxRuntimeExceeded):  # retry_on has no say: an overrun is retried
        return failed(error_payload(exc), retryable=True)
    if isinstance(exc, PermanentError | InvalidRequest):  # OutOfScope is a PermanentError
        return failed(error_payload(exc), retryable=False)
    if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt, CancelledError…
        return replace(failed(error_payload(exc), retryable=True), interrupted=True)
    return failed(error_payload(exc), retryable=is_retryable(exc, retry_on))


def budget_refused(exc: BudgetExceeded, on_budget: OnBudget, max_delay: float) -> Outcome:
    """A budget refused the stage's call: ``wait`` (the stage's choice, else the budget's):
    retried at the next period's start, the attempt given back; ``fail``: dead at once.
    The error names the budget's own choice and when its period turns, as a pull worker
    reports it (:func:`reported`)."""
    error = {
        **error_payload(exc),
        "on_exceeded": exc.on_exceeded,
        "retry_at": exc.retry_at,
        "retry_in": exc.retry_in,
    }
    choice = exc.on_exceeded if on_budget is None else on_budget
    return budget_outcome(error, choice, exc.retry_in, max_delay)


def budget_outcome(
    error: dict[str, Any], choice: object, retry_in: object, max_delay: float
) -> Outcome:
    """A budget's refusal, ``choice`` made (the stage's ``on_budget``, else the budget's
    ``on_exceeded``): a ``wait`` with a period to wait for (``retry_in``) is retried then,
    clamped as a RetryLater delay, its attempt given back; anything else is dead at once."""
    due = clamp_delay(retry_in, max_delay) if choice == "wait" else None
    if due is None:
        return failed(error, retryable=False)
    return replace(failed(error, retryable=True, retry_in=due), counts_attempt=False)


def is_retryable(exc: BaseException, retry_on: RetryOn) -> bool:
    """Whether an exception the table does not name is worth a retry under ``retry_on``.

    An error marked ``retryable`` (e.g. :class:`LockUnavailable`) always is; a callable
    ``retry_on`` that raises counts as "yes" (a retry is the safe side).
    """
    if getattr(exc, "retryable", False) is True:
        return True
    if retry_on is None:
        return True
    if isinstance(retry_on, tuple):
        return isinstance(exc, retry_on)
    try:
        return bool(retry_on(exc))
    except Exception:
        return True


def clamp_delay(delay: object, most: float) -> float | None:
    """A :class:`RetryLater` delay as the queue takes it: at most ``most`` seconds; None
    (the backoff) for a delay that is not a finite non-negative number."""
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        return None
    if math.isnan(delay) or delay < 0:
        return None
    return float(min(delay, most))


def reported(
    error: Any,
    *,
    retryable: bool,
    retry_in: float | None,
    max_delay: float,
    on_budget: OnBudget = None,
    refusal: Mapping[str, Any] | None = None,
) -> Outcome:
    """The outcome of a failure a pull worker reports over HTTP (the ``fail`` route).

    The same table, read from the report: an error whose ``type`` is a permanent one is
    never retried; a ``RetryLater`` error without ``retry_in`` is retried after its
    ``delay`` (clamped); a ``BudgetExceeded`` error is a budget's refusal only when the
    server answered the claim's permit with one (``refusal``: its ``on_exceeded``,
    ``retry_at`` and ``retry_in``, written over the report's): it then does what the
    stage's ``on_budget`` says, else what the budget's ``on_exceeded`` says, as
    :func:`decide` does — a wait is retried after the refusal's ``retry_in`` (clamped),
    its attempt given back; a fail (or no choice said) is dead at once. Without a
    ``refusal`` it is an ordinary failure, its attempt counted: a worker's word alone
    gives no attempt back. A client that sent no ``type`` keeps its own ``retryable``.
    """
    kind = error.get("type") if isinstance(error, dict) else None
    if kind in PERMANENT_TYPES:
        return Outcome("failed", error=error, retryable=False, retry_in=None)
    if kind == "BudgetExceeded" and isinstance(error, dict) and refusal is not None:
        error = {**error, **{k: refusal.get(k) for k in ("on_exceeded", "retry_at", "retry_in")}}
        choice = error["on_exceeded"] if on_budget is None else on_budget
        return budget_outcome(error, choice, error["retry_in"], max_delay)
    if kind == "RetryLater" and retry_in is None and isinstance(error, dict):
        retry_in = clamp_delay(error.get("delay"), max_delay)
        error = {**error, "delay": retry_in}
        return Outcome("failed", error=error, retryable=True, retry_in=retry_in)
    return Outcome("failed", error=error, retryable=retryable, retry_in=retry_in)


def brief_error(error: Any, refusal: BaseException) -> dict[str, Any]:
    """What is recorded when the store refuses ``error`` (over a payload limit set low):
    its type and a short message saying why — never a run left for its lease to lapse."""
    kind = error.get("type", "Error") if isinstance(error, dict) else "Error"
    return {
        "type": storable_text(str(kind), 200),
        "message": storable_text(f"not storable: {refusal}", 200),
    }


__all__ = [
    "ON_BUDGET",
    "PERMANENT_TYPES",
    "OnBudget",
    "Outcome",
    "RetryOn",
    "brief_error",
    "budget_outcome",
    "budget_refused",
    "check_on_budget",
    "clamp_delay",
    "decide",
    "failed",
    "is_retryable",
    "lease_lost",
    "reported",
    "succeeded",
]
