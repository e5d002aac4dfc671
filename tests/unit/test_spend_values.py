"""Spend's values without a database: Usage and Price checked, a budget's refusal, and
BudgetExceeded in the outcome table (fail: dead; wait: retried at the next period)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from onceflow.errors import BudgetBusy, BudgetExceeded, InvalidRequest
from onceflow.lifecycle import decide
from onceflow.spend import NO_HOOKS, Budget, Grant, LedgerHooks, Price, SpendHooks, Usage
from onceflow.spend.budget import BUSY_MIN_MS, BUSY_POLL_MS, check_amount, refusal

CAP = 600.0


def test_usage_and_price_refuse_nonsense() -> None:
    assert Usage(3, 4).total_tokens == 7
    for bad in ((-1, 0), (0, -1), (True, 0), (1.0, 0), ("1", 0)):
        with pytest.raises(InvalidRequest):
            Usage(*bad)  # type: ignore[arg-type]
    price = Price(Decimal("2.5"), Decimal(10))
    assert price.cost(Usage(1_000_000, 500_000)) == Decimal("7.5")
    for value in (-1, math.nan, "NaN", "inf", True, None):
        with pytest.raises(InvalidRequest):
            Price(value, Decimal(1))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-0.01, math.nan, math.inf, "nan", "-inf", "x", True, None, []])
def test_amounts_are_finite_and_not_negative(value: object) -> None:
    with pytest.raises(InvalidRequest):
        check_amount("limit_cost", value)


def test_amounts_keep_their_decimal_value() -> None:
    assert check_amount("c", "0.10") == Decimal("0.10")
    assert check_amount("c", 0.1) == Decimal("0.1")  # as written, not the binary float


def budget(**kw: object) -> Budget:
    base: dict[str, object] = {
        "workspace_id": "w",
        "period": "day",
        "limit_cost": None,
        "limit_tokens": None,
        "on_exceeded": "fail",
        "period_starts": datetime(2026, 12, 7, tzinfo=UTC),
        "period_ends": datetime(2026, 12, 8, tzinfo=UTC),
        "period_ends_in": 3600.0,
    }
    return Budget(**{**base, **kw})  # type: ignore[arg-type]


def test_a_call_fits_while_spent_plus_in_flight_plus_its_estimate_stay_within_the_limit() -> None:
    b = budget(limit_tokens=100, spent_tokens=60, reserved_tokens=30)
    assert refusal(b, 10, None) is None  # exactly the limit
    busy = refusal(b, 11, None)  # 60 spent + 11 fits: only the 30 in flight are in the way
    assert isinstance(busy, BudgetBusy)
    assert "60 tokens spent + 30 in flight + 11 estimated > limit 100" in str(busy)
    over = refusal(b, 41, None)  # 60 spent + 41: no call in flight settling makes room
    assert isinstance(over, BudgetExceeded) and "60 tokens spent + 41 estimated" in str(over)
    money = budget(limit_cost=Decimal(1), spent_cost=Decimal("0.6"), reserved_cost=Decimal("0.4"))
    assert isinstance(refusal(money, 0, Decimal(0)), BudgetBusy)  # reached by calls in flight
    assert isinstance(refusal(money, 0, None), BudgetBusy)
    spent = budget(limit_cost=Decimal(1), spent_cost=Decimal(1))
    assert isinstance(refusal(spent, 0, None), BudgetExceeded)  # reached: even an unpriced call
    assert refusal(budget(limit_cost=Decimal(1)), 0, Decimal("0.99")) is None


def test_no_room_for_good_decides_over_room_held_in_flight() -> None:
    # Tokens held by calls in flight, money spent: the money budget refuses for good.
    both = budget(
        limit_tokens=100, reserved_tokens=95, limit_cost=Decimal(1), spent_cost=Decimal("0.9")
    )
    assert isinstance(refusal(both, 10, Decimal("0.2")), BudgetExceeded)
    assert isinstance(refusal(both, 10, Decimal("0.1")), BudgetBusy)


def test_a_busy_budget_is_asked_again_soon_or_when_a_reservation_expires() -> None:
    held = {"limit_tokens": 10, "reserved_tokens": 6}
    poll = refusal(budget(**held), 6, None)
    assert isinstance(poll, BudgetBusy) and poll.retry_in == BUSY_POLL_MS / 1000
    expiring = refusal(budget(**held, next_expiry_in=0.05), 6, None)
    assert isinstance(expiring, BudgetBusy) and expiring.retry_in == 0.05
    now = refusal(budget(**held, next_expiry_in=-1.0), 6, None)
    assert isinstance(now, BudgetBusy) and now.retry_in == BUSY_MIN_MS / 1000
    assert "next_expiry_in" not in budget(**held, next_expiry_in=1.0).as_dict()
    # Retryable if it ever reaches the outcome table (a caller of admit that does not wait).
    assert decide(poll, max_delay=CAP).retryable
    make, args = poll.__reduce__()
    assert str(make(*args)) == str(poll)


def test_budget_exceeded_in_the_outcome_table() -> None:
    full = {"limit_tokens": 10, "spent_tokens": 8}
    waits = refusal(budget(**full, on_exceeded="wait", period_ends_in=7200.0), 5, None)
    assert isinstance(waits, BudgetExceeded) and waits.waits
    assert waits.retry_at == "2026-12-08T00:00:00+00:00"
    out = decide(waits, max_delay=CAP)
    assert (out.kind, out.retryable, out.retry_in) == ("failed", True, CAP)
    assert not out.counts_attempt  # a wait gives its attempt back
    assert out.error is not None and out.error["type"] == "BudgetExceeded"
    soon = refusal(budget(**full, on_exceeded="wait", period_ends_in=30.0), 5, None)
    assert soon is not None and decide(soon, max_delay=CAP).retry_in == 30.0
    fails = refusal(budget(**full), 5, None)
    assert isinstance(fails, BudgetExceeded) and not fails.waits and fails.retry_in == 3600.0
    out = decide(fails, retry_on=(BudgetExceeded,), max_delay=CAP)
    assert (out.kind, out.retryable, out.counts_attempt) == ("failed", False, True)


def test_the_stage_declares_what_a_refusal_does_over_the_budget() -> None:
    full = {"limit_tokens": 10, "spent_tokens": 8}
    fail_budget = refusal(budget(**full), 5, None)
    wait_budget = refusal(budget(**full, on_exceeded="wait", period_ends_in=30.0), 5, None)
    assert fail_budget is not None and wait_budget is not None
    waited = decide(fail_budget, max_delay=CAP, on_budget="wait")
    assert (waited.retryable, waited.retry_in, waited.counts_attempt) == (True, CAP, False)
    failed = decide(wait_budget, max_delay=CAP, on_budget="fail")
    assert (failed.retryable, failed.retry_in, failed.counts_attempt) == (False, None, True)
    assert decide(wait_budget, max_delay=CAP, on_budget=None).retryable  # the budget's own


def test_a_call_no_period_could_hold_never_waits() -> None:
    # An estimate above the limit itself: no period turning makes room, so no wait.
    never = refusal(budget(limit_tokens=4, on_exceeded="wait"), 5, None)
    assert isinstance(never, BudgetExceeded) and never.retry_in is None and not never.waits
    out = decide(never, max_delay=CAP, on_budget="wait")
    assert (out.retryable, out.counts_attempt) == (False, True)
    dear = refusal(budget(limit_cost=Decimal("0.01")), 5, Decimal("0.02"))
    assert isinstance(dear, BudgetExceeded) and dear.retry_in is None


def test_budget_exceeded_survives_a_round_trip_through_its_reduce() -> None:
    exc = BudgetExceeded("w", "month", "over", "wait", "2027-01-01T00:00:00+00:00", 12.5)
    make, args = exc.__reduce__()
    again = make(*args)
    assert (again.workspace_id, again.period, again.retry_at, again.retry_in) == (
        "w",
        "month",
        "2027-01-01T00:00:00+00:00",
        12.5,
    )
    assert str(again) == str(exc)


def test_a_grant_never_shows_its_claim_token() -> None:
    g = Grant(workspace_id="w", provider="openai", estimate_tokens=1, claim_token="tok-secret")
    assert "tok-secret" not in repr(g) and "tok-secret" not in str(g)
    assert g.claim_token == "tok-secret"


def test_the_hooks_share_one_protocol() -> None:
    g = Grant(permit_id="p" * 32, workspace_id="w", provider="openai", estimate_tokens=10)
    NO_HOOKS.admit(g)
    NO_HOOKS.release(g)
    NO_HOOKS.settle(g, Usage(1, 1), "ok", "openai", None, None, None, None)
    assert isinstance(NO_HOOKS, SpendHooks)
    assert issubclass(LedgerHooks, SpendHooks)
