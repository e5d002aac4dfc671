"""A permit whose budget's room is held by calls in flight waits for them, on real Postgres
and Redis: granted once the call in flight settles below its estimate (sync, asyncio, the
cascade), bounded by its timeout (PermitTimeout, reason budget_in_flight), stopped by its
cancel event, its heartbeat called meanwhile; a reservation that expires is charged its
estimate; a budget the period's spend leaves no room in refuses at once (BudgetExceeded)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.errors import (
    BudgetBusy,
    BudgetExceeded,
    CascadeExhausted,
    PermitCancelled,
    PermitTimeout,
)
from onceflow.spend import AsyncPermit, Cascade, Grant, LedgerHooks, Permit, Provider, Usage
from onceflow.spend import set_budget as set_a_budget
from tests.integration.spend_parts import fresh

LIMIT = 10  # tokens a day
ESTIMATE = 6  # two calls do not fit beside each other; one spent 3 and one more do


class WatchedLedger(LedgerHooks):
    """The ledger, noting each time it answers that a budget is held by calls in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy = threading.Event()
        self.lock = threading.Lock()
        self.busy_answers = 0

    def admit(self, grant: Grant) -> None:
        try:
            super().admit(grant)
        except BudgetBusy:
            with self.lock:
                self.busy_answers += 1
            self.busy.set()
            raise


@pytest.fixture()
def ws(clean_db: Engine) -> str:
    """A workspace with a day's budget of :data:`LIMIT` tokens."""
    name = f"ws-wait-{uuid.uuid4().hex[:8]}"
    set_a_budget(name, "day", limit_tokens=LIMIT, allow_new=True, database=clean_db)
    return name


def ledger_rows(engine: Engine, ws: str) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT outcome, input_tokens + output_tokens FROM spend_ledger "
                "WHERE workspace_id = :ws ORDER BY recorded_at"
            ),
            {"ws": ws},
        )
        return [(r[0], int(r[1])) for r in found]


def reservations(engine: Engine, ws: str) -> int:
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM spend_reservations WHERE workspace_id = :ws"), {"ws": ws}
        )
        return int(found.scalar_one())


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``fn`` started in a thread; the dict gets its ``value`` or its ``error``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_permit_waits_for_the_call_in_flight_and_is_granted_once_it_settles_lower(
    clean_db: Engine, redis_url: str, ws: str
) -> None:
    hooks = WatchedLedger(clean_db)
    provider = fresh(redis_url, hooks=hooks)
    beat = threading.Event()

    def second() -> float:
        with provider.permit(
            ws, ESTIMATE, timeout=30, heartbeat=beat.set, heartbeat_every=0.05
        ) as permit:
            granted = time.monotonic()
            permit.settle(Usage(3, 1))
        return granted

    with provider.permit(ws, ESTIMATE) as first:
        thread, out = in_thread(second)
        assert hooks.busy.wait(10), "the second permit was not told the budget is busy"
        assert beat.wait(10), "the waiting permit did not call its heartbeat"
        assert thread.is_alive() and not out  # still waiting: 6 in flight + 6 > 10
        settled = time.monotonic()
        first.settle(Usage(2, 1))  # 3 spent: 3 + 6 fits
    thread.join(30)
    assert "error" not in out, out.get("error")
    assert out["value"] > settled  # granted only after the first settled
    assert ledger_rows(clean_db, ws) == [("ok", 3), ("ok", 4)]
    assert reservations(clean_db, ws) == 0


def test_an_async_permit_waits_the_same_way(clean_db: Engine, redis_url: str, ws: str) -> None:
    hooks = WatchedLedger(clean_db)
    provider = fresh(redis_url, hooks=hooks)

    async def scenario() -> tuple[float, float]:
        async def second() -> float:
            async with provider.apermit(ws, ESTIMATE, timeout=30) as permit:
                granted = time.monotonic()
                await permit.settle(Usage(3, 0))
            return granted

        first: AsyncPermit
        async with provider.apermit(ws, ESTIMATE) as first:
            task = asyncio.create_task(second())
            assert await asyncio.to_thread(hooks.busy.wait, 10)
            assert not task.done()
            settled = time.monotonic()
            await first.settle(Usage(1, 2))
        return settled, await asyncio.wait_for(task, 30)

    settled, granted = asyncio.run(scenario())
    assert granted > settled
    assert ledger_rows(clean_db, ws) == [("ok", 3), ("ok", 3)]


def test_the_wait_is_bounded_and_cancellable_and_holds_nothing(
    clean_db: Engine, redis_url: str, ws: str
) -> None:
    hooks = WatchedLedger(clean_db)
    provider = fresh(redis_url, hooks=hooks)
    hooks.admit(provider.grant_for(ws, ESTIMATE))  # a call in flight that never settles
    started = time.monotonic()
    with pytest.raises(PermitTimeout) as timed_out, provider.permit(ws, ESTIMATE, timeout=0.5):
        pytest.fail("granted beside a call in flight that holds the budget")
    waited = time.monotonic() - started
    assert 0.5 <= waited < 3.0
    assert timed_out.value.reason == "budget_in_flight" and timed_out.value.retryable
    assert hooks.busy_answers >= 2  # it asked again while it waited
    cancel = threading.Event()

    def cancelled() -> None:
        with provider.permit(ws, ESTIMATE, timeout=30, cancel=cancel):
            pytest.fail("granted beside a call in flight that holds the budget")

    hooks.busy.clear()
    thread, out = in_thread(cancelled)
    assert hooks.busy.wait(10)
    cancel.set()
    thread.join(10)
    assert isinstance(out.get("error"), PermitCancelled)
    assert reservations(clean_db, ws) == 1  # the waits reserved nothing
    assert provider.stats()["in_flight"] == 0


def test_a_reservation_given_back_lets_the_waiter_in(
    clean_db: Engine, redis_url: str, ws: str
) -> None:
    hooks = WatchedLedger(clean_db)
    provider = fresh(redis_url, hooks=hooks)
    held = provider.grant_for(ws, ESTIMATE)
    hooks.admit(held)

    def second() -> int:
        with provider.permit(ws, ESTIMATE, timeout=30) as permit:
            permit.settle(Usage(5, 0))
            return permit.granted_at_ms

    thread, out = in_thread(second)
    assert hooks.busy.wait(10)
    hooks.release(held)  # no call was made: its estimate comes back whole
    thread.join(30)
    assert "error" not in out, out.get("error")
    assert ledger_rows(clean_db, ws) == [("ok", 5)]


def test_an_expired_reservation_is_charged_and_the_waiter_then_refused(
    clean_db: Engine, redis_url: str, ws: str
) -> None:
    # The holder died: at its reservation's TTL it is charged its estimate (the call may
    # have been paid for), so 6 spent + 6 no longer fits and the waiter is refused for good.
    hooks = WatchedLedger(clean_db, reservation_ttl=1.0)
    provider = fresh(redis_url, hooks=hooks)
    hooks.admit(provider.grant_for(ws, ESTIMATE))
    started = time.monotonic()
    with pytest.raises(BudgetExceeded), provider.permit(ws, ESTIMATE, timeout=30):
        pytest.fail("granted beyond the budget")
    assert 0.5 <= time.monotonic() - started < 10  # after the TTL, well before the timeout
    assert hooks.busy_answers >= 1
    assert ledger_rows(clean_db, ws) == [("abandoned", ESTIMATE)]
    assert reservations(clean_db, ws) == 0


def test_a_budget_the_spend_leaves_no_room_in_refuses_at_once(
    clean_db: Engine, redis_url: str, ws: str
) -> None:
    hooks = WatchedLedger(clean_db)
    provider = fresh(redis_url, hooks=hooks)
    with provider.permit(ws, ESTIMATE) as spent:
        spent.settle(Usage(5, 3))  # 8 spent: 8 + 6 > 10, whatever settles
    started = time.monotonic()
    with pytest.raises(BudgetExceeded) as refused, provider.permit(ws, ESTIMATE, timeout=30):
        pytest.fail("granted beyond the budget")
    assert time.monotonic() - started < 2.0
    assert "8 tokens spent + 6 estimated > limit 10" in str(refused.value)
    assert hooks.busy_answers == 0
    assert reservations(clean_db, ws) == 0


def _cascade(clean_db: Engine, redis_url: str) -> tuple[Cascade, WatchedLedger, Provider]:
    hooks = WatchedLedger(clean_db)
    primary, fallback = fresh(redis_url, hooks=hooks), fresh(redis_url, hooks=hooks)
    return Cascade([primary, fallback]), hooks, primary


def test_the_cascade_waits_for_a_budget_held_in_flight(
    clean_db: Engine, redis_url: str, ws: str
) -> None:
    cascade, hooks, primary = _cascade(clean_db, redis_url)

    def ask(permit: Permit) -> str:
        permit.settle(Usage(2, 2))
        return permit.provider.name

    with primary.permit(ws, ESTIMATE) as first:
        with pytest.raises(CascadeExhausted, match="budget_in_flight"):
            cascade.call(ws, ask, tokens=ESTIMATE, timeout=0.3)
        hooks.busy.clear()
        thread, out = in_thread(lambda: cascade.call(ws, ask, tokens=ESTIMATE, timeout=30))
        assert hooks.busy.wait(10)
        assert thread.is_alive()
        first.settle(Usage(1, 1))
    thread.join(30)
    assert out.get("value") == primary.name, out.get("error")
    assert ledger_rows(clean_db, ws) == [("ok", 2), ("ok", 4)]
    assert reservations(clean_db, ws) == 0
