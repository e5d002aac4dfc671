"""The outcome table every runner shares (``onceflow.lifecycle.outcome``): pure, no I/O."""

from __future__ import annotations

import math
from typing import Any

import pytest

from onceflow.errors import (
    BudgetExceeded,
    Cancelled,
    InvalidRequest,
    LeaseLost,
    LockUnavailable,
    MaxRuntimeExceeded,
    OutOfScope,
    PayloadTooLarge,
    PermanentError,
    RetryLater,
)
from onceflow.lifecycle import brief_error, clamp_delay, decide, reported, succeeded
from onceflow.queue.sweep import OVERRAN_ERROR

CAP = 600.0


def test_success_carries_its_result() -> None:
    out = succeeded({"ok": True})
    assert (out.kind, out.result, out.failed) == ("succeeded", {"ok": True}, False)


@pytest.mark.parametrize(
    ("delay", "retry_in"),
    [(120, 120.0), (0, 0.0), (100_000, CAP), (-1, None), (math.nan, None), ("5", None),
     (True, None), (math.inf, CAP)],
)  # fmt: skip
def test_retry_later_is_retried_after_its_delay_clamped_to_the_backoff_cap(
    delay: object, retry_in: float | None
) -> None:
    out = decide(RetryLater(delay, "rate limited"), max_delay=CAP)  # type: ignore[arg-type]
    assert (out.kind, out.retryable, out.retry_in) == ("failed", True, retry_in)
    assert out.error == {"type": "RetryLater", "message": "rate limited", "delay": retry_in}


@pytest.mark.parametrize(
    "exc",
    [PermanentError("bad"), InvalidRequest("no"), OutOfScope("past sub_docs"),
     PayloadTooLarge("result", 10, 5)],
)  # fmt: skip
def test_permanent_errors_are_dead_at_once_whatever_retry_on_says(exc: Exception) -> None:
    out = decide(exc, retry_on=(Exception,), max_delay=CAP)
    assert (out.kind, out.retryable, out.retry_in) == ("failed", False, None)
    assert out.error is not None and out.error["type"] == type(exc).__name__


def test_retry_on_decides_the_other_exceptions() -> None:
    assert decide(ValueError("v"), retry_on=(ValueError,), max_delay=CAP).retryable
    assert not decide(ValueError("v"), retry_on=(KeyError,), max_delay=CAP).retryable
    assert decide(ValueError("v"), retry_on=None, max_delay=CAP).retryable
    assert not decide(ValueError("v"), retry_on=lambda e: False, max_delay=CAP).retryable

    def broken(exc: BaseException) -> bool:
        raise RuntimeError("retry_on itself failed")

    assert decide(ValueError("v"), retry_on=broken, max_delay=CAP).retryable  # the safe side
    # An error marked retryable always is (a lock that cannot be had now).
    assert decide(LockUnavailable("redis down"), retry_on=(KeyError,), max_delay=CAP).retryable


def test_lease_lost_records_nothing_and_cancel_is_not_retried() -> None:
    assert decide(LeaseLost("r1"), max_delay=CAP).kind == "lease_lost"
    out = decide(Cancelled("r1"), max_delay=CAP)
    assert (out.kind, out.retryable, out.error) == ("failed", False, {"type": "Cancelled"})


def test_a_run_past_max_runtime_is_retried_after_the_backoff_whatever_retry_on_says() -> None:
    # retry_on names neither: an overrun is still retried (dead only at max_attempts).
    out = decide(MaxRuntimeExceeded(), retry_on=(KeyError,), max_delay=CAP)
    assert (out.kind, out.retryable, out.retry_in, out.interrupted) == (
        "failed", True, None, False,
    )  # fmt: skip
    # What the sweeper records for a run whose lease ended at its run deadline is the same.
    assert out.error is not None
    assert {k: out.error[k] for k in ("type", "message")} == OVERRAN_ERROR


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_an_interruption_is_a_retryable_failure_the_runner_may_re_raise(
    exc: BaseException,
) -> None:
    out = decide(exc, retry_on=(KeyError,), max_delay=CAP)
    assert (out.kind, out.retryable, out.retry_in, out.interrupted) == (
        "failed", True, None, True,
    )  # fmt: skip


def test_a_report_over_http_reads_through_the_same_table() -> None:
    later = reported({"type": "RetryLater", "delay": 10**6}, retryable=True, retry_in=None,
                     max_delay=CAP)  # fmt: skip
    assert (later.retryable, later.retry_in) == (True, CAP)
    assert later.error == {"type": "RetryLater", "delay": CAP}
    dead = reported({"type": "PermanentError"}, retryable=True, retry_in=None, max_delay=CAP)
    assert not dead.retryable
    plain = reported({"e": 1}, retryable=False, retry_in=3.0, max_delay=CAP)
    assert (plain.retryable, plain.retry_in) == (False, 3.0)
    assert reported("x", retryable=True, retry_in=None, max_delay=CAP).retryable


def refusal_of(error: dict[str, Any]) -> dict[str, Any]:
    """What the permit route keeps of the refusal it answered (the report's fields here)."""
    return {k: error.get(k) for k in ("on_exceeded", "retry_at", "retry_in")}


def test_a_reported_budget_refusal_waits_for_its_period_only_when_its_budget_waits() -> None:
    wait = {"type": "BudgetExceeded", "on_exceeded": "wait", "retry_in": 10**6}

    def told(error: dict[str, Any], **kw: Any) -> Any:
        kw = {"retryable": True, "retry_in": None, **kw}
        return reported(error, max_delay=CAP, refusal=refusal_of(error), **kw)

    waits = told(wait)
    assert (waits.retryable, waits.retry_in) == (True, CAP)  # clamped as a RetryLater delay
    soon = told({**wait, "retry_in": 30})
    assert (soon.retryable, soon.retry_in) == (True, 30.0)
    # A `fail` budget (or none said) is dead, whatever the client thought.
    for error in ({"type": "BudgetExceeded", "on_exceeded": "fail"}, {"type": "BudgetExceeded"}):
        dead = told(error, retry_in=5.0)
        assert (dead.retryable, dead.retry_in) == (False, None)
    # A `wait` without a usable period start has nothing to wait for: dead too.
    assert not told({**wait, "retry_in": "soon"}).retryable


def test_a_reported_budget_refusal_the_server_did_not_answer_counts_its_attempt() -> None:
    """A worker's word alone gives no attempt back: without the server's own refusal a
    BudgetExceeded report is an ordinary failure; with it, the server's fields decide."""
    forged = {"type": "BudgetExceeded", "on_exceeded": "wait", "retry_in": 1}
    plain = reported(forged, retryable=True, retry_in=None, max_delay=CAP)
    assert (plain.retryable, plain.retry_in, plain.counts_attempt) == (True, None, True)
    for on_budget in (None, "wait"):
        counted = reported(forged, retryable=True, retry_in=2.0, max_delay=CAP,
                           on_budget=on_budget)  # fmt: skip
        assert (counted.retry_in, counted.counts_attempt) == (2.0, True)
    # The server refused with a `fail` budget: the report's `wait` does not change that.
    kept = {"on_exceeded": "fail", "retry_at": "t", "retry_in": 60.0}
    dead = reported(forged, retryable=True, retry_in=None, max_delay=CAP, refusal=kept)
    assert (dead.retryable, dead.counts_attempt) == (False, True)
    assert dead.error is not None and dead.error["on_exceeded"] == "fail"
    # The server's wait, not the report's: 60 s, its attempt given back.
    kept = {**kept, "on_exceeded": "wait"}
    waits = reported(forged, retryable=True, retry_in=None, max_delay=CAP, refusal=kept)
    assert (waits.retry_in, waits.counts_attempt) == (60.0, False)


def test_a_reported_budget_refusal_does_what_the_stage_declares_as_decide_does() -> None:
    """The server reads the claimed stage's on_budget: the same outcome as decide() gives
    a runner in this process, a wait's attempt given back."""
    fails = BudgetExceeded("w", "day", "full", on_exceeded="fail", retry_at="t", retry_in=60.0)
    waits = BudgetExceeded("w", "day", "full", on_exceeded="wait", retry_at="t", retry_in=60.0)
    never = BudgetExceeded("w", "day", "too big", on_exceeded="wait")  # fits no period
    for exc in (fails, waits, never):
        for on_budget in (None, "fail", "wait"):
            here = decide(exc, max_delay=CAP, on_budget=on_budget)
            assert here.error is not None
            assert here.error["on_exceeded"] == exc.on_exceeded  # the budget's, in the error
            there = reported(here.error, retryable=True, retry_in=None, max_delay=CAP,
                             on_budget=on_budget, refusal=refusal_of(here.error))  # fmt: skip
            assert (there.retryable, there.retry_in, there.counts_attempt) == (
                here.retryable,
                here.retry_in,
                here.counts_attempt,
            ), (exc.on_exceeded, on_budget)
    refused = {"type": "BudgetExceeded", "on_exceeded": "fail", "retry_in": 60}
    waited = reported(refused, retryable=False, retry_in=None, max_delay=CAP, on_budget="wait",
                      refusal=refusal_of(refused))  # fmt: skip
    assert (waited.retryable, waited.retry_in, waited.counts_attempt) == (True, 60.0, False)
    # Any other failure counts its attempt, whatever the stage says of budgets.
    other = reported({"type": "RetryLater", "delay": 5}, retryable=True, retry_in=None,
                     max_delay=CAP, on_budget="wait")  # fmt: skip
    assert other.counts_attempt


def test_a_refused_error_is_recorded_briefly() -> None:
    brief = brief_error({"type": "PermanentError", "message": "y" * 5000}, InvalidRequest("big"))
    assert brief == {"type": "PermanentError", "message": "not storable: big"}
    assert clamp_delay(5, 1.0) == 1.0
