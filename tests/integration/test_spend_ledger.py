"""The cost ledger and budgets on real Postgres: budgets enforced at admit (also by
processes admitting at once), reservations and their expiry, settles written once and in
the claim's fence, spend reads, and bad input refused with nothing written."""

from __future__ import annotations

import json
import multiprocessing
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.errors import BudgetBusy, BudgetExceeded, InvalidRequest, UnknownWorkspace
from onceflow.lifecycle.outcome import decide
from onceflow.queue import Queue
from onceflow.settings import get_settings
from onceflow.spend import (
    Grant,
    LedgerHooks,
    Usage,
    budgets,
    clear_budget,
    set_budget,
    spend,
)
from tests.conftest import table_snapshot
from tests.integration.spend_admitter import admit_many

WS = "ws-spend"


def grant(tokens: int = 100, cost: str | None = "0.01", ws: str = WS, **kw: Any) -> Grant:
    return Grant(
        workspace_id=ws,
        provider=kw.pop("provider", "openai"),
        estimate_tokens=tokens,
        estimate_cost=None if cost is None else Decimal(cost),
        **kw,
    )


def rows(engine: Engine, table: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        result = conn.execute(text(f"SELECT * FROM {table} ORDER BY permit_id"))  # noqa: S608
        return [dict(r._mapping) for r in result]


@pytest.fixture()
def known(clean_db: Engine) -> Queue:
    """A workspace with a request (so it exists for a budget)."""
    queue = Queue(clean_db, settings=get_settings())
    queue.enqueue("summarize", WS, "job-1")
    return queue


def settle(
    hooks: LedgerHooks, g: Grant, usage: Usage | None, outcome: str = "ok", cost: str | None = None
) -> None:
    hooks.settle(g, usage, outcome, g.provider, "gpt-x", None if cost is None else Decimal(cost))


# ---------------------------------------------------------------------------- budgets


def test_a_token_budget_admits_until_spent_plus_in_flight_reach_it(
    clean_db: Engine, known: Queue
) -> None:
    set_budget(WS, "day", limit_tokens=1000, database=clean_db)
    hooks = LedgerHooks(clean_db)
    first, second = grant(400), grant(400)
    hooks.admit(first)
    hooks.admit(second)  # 800 reserved
    with pytest.raises(BudgetBusy) as busy:
        hooks.admit(grant(300))  # 800 in flight + 300 > 1000: held, not spent
    assert busy.value.period == "day" and 0 < busy.value.retry_in <= 0.25
    with pytest.raises(BudgetExceeded) as refused:
        hooks.admit(grant(1001))  # more than the limit itself
    assert not refused.value.waits
    assert len(rows(clean_db, "spend_reservations")) == 2  # the refused calls reserved nothing
    settle(hooks, first, Usage(50, 50))  # actual 100: 400 reserved → 100 spent
    hooks.admit(grant(300))  # 100 spent + 400 in flight + 300 = 800
    (b,) = budgets(WS, database=clean_db)
    assert (b.spent_tokens, b.reserved_tokens, b.in_flight) == (100, 700, 2)
    hooks.release(second)
    (b,) = budgets(WS, database=clean_db)
    assert (b.reserved_tokens, b.in_flight) == (300, 1)


def test_a_money_budget_that_waits_retries_at_the_next_period(
    clean_db: Engine, known: Queue
) -> None:
    set_budget(WS, "month", limit_cost="0.05", on_exceeded="wait", database=clean_db)
    hooks = LedgerHooks(clean_db)
    g = grant(10, "0.04")
    hooks.admit(g)
    settle(hooks, g, Usage(10, 10), cost="0.04")
    with pytest.raises(BudgetExceeded) as refused:
        hooks.admit(grant(10, "0.02"))
    exc = refused.value
    assert exc.waits and exc.retry_at is not None and exc.retry_in is not None
    start = datetime.fromisoformat(exc.retry_at)
    assert (start.day, start.hour, start.minute) == (1, 0, 0) and start.utcoffset() == timedelta(0)
    assert 0 < exc.retry_in <= 31 * 86400
    # The outcome table: retried (not dead), after the delay clamped to the backoff maximum.
    outcome = decide(exc, max_delay=3600)
    assert outcome.retryable and outcome.retry_in == min(exc.retry_in, 3600)
    assert outcome.error is not None and outcome.error["type"] == "BudgetExceeded"
    # The same budget set to fail: dead at once.
    set_budget(WS, "month", limit_cost="0.05", on_exceeded="fail", database=clean_db)
    with pytest.raises(BudgetExceeded) as failing:
        hooks.admit(grant(10, "0.02"))
    assert not decide(failing.value, max_delay=3600).retryable


def test_an_expired_reservation_is_charged_its_estimate_and_a_late_settle_replaces_it(
    clean_db: Engine, known: Queue
) -> None:
    set_budget(WS, "day", limit_tokens=1000, database=clean_db)
    hooks = LedgerHooks(clean_db)
    crashed = grant(600, "0.06", stage="summarize")
    hooks.admit(crashed)
    with clean_db.begin() as conn:  # the client died: its reservation's TTL has passed
        conn.execute(text("UPDATE spend_reservations SET expires_at = now() - interval '1 s'"))
    with pytest.raises(BudgetExceeded):
        hooks.admit(grant(500))  # the expired 600 is charged, not forgotten
    hooks.admit(grant(400))  # the next admit reaped it: 600 spent + 400
    (abandoned,) = [r for r in rows(clean_db, "spend_ledger") if r["outcome"] == "abandoned"]
    assert abandoned["permit_id"] == crashed.permit_id
    assert (abandoned["input_tokens"], abandoned["cost"]) == (600, Decimal("0.06"))
    settle(hooks, crashed, Usage(100, 20), cost="0.01")  # it was alive after all
    (row,) = [r for r in rows(clean_db, "spend_ledger") if r["permit_id"] == crashed.permit_id]
    assert (row["outcome"], row["input_tokens"], row["output_tokens"]) == ("ok", 100, 20)


def test_budgets_are_refused_for_bad_input_and_unknown_workspaces(
    clean_db: Engine, known: Queue
) -> None:
    set_budget(WS, "day", limit_cost=1, database=clean_db)
    before = table_snapshot(clean_db)
    bad: list[dict[str, Any]] = [
        {"limit_cost": -1},
        {"limit_cost": float("nan")},
        {"limit_cost": "NaN"},
        {"limit_cost": "inf"},
        {"limit_cost": True},
        {"limit_tokens": -5},
        {"limit_tokens": 1.5},
        {},
        {"limit_tokens": 10, "on_exceeded": "explode"},
    ]
    for kwargs in bad:
        with pytest.raises(InvalidRequest):
            set_budget(WS, "day", database=clean_db, **kwargs)
    with pytest.raises(InvalidRequest, match="period"):
        set_budget(WS, "week", limit_tokens=10, database=clean_db)
    with pytest.raises(UnknownWorkspace, match="no-such-ws"):
        set_budget("no-such-ws", "day", limit_tokens=10, database=clean_db)
    assert table_snapshot(clean_db) == before
    made = set_budget("new-ws", "day", limit_tokens=10, allow_new=True, database=clean_db)
    assert made.limit_tokens == 10
    assert clear_budget("new-ws", database=clean_db) == ["day"]
    assert clear_budget("new-ws", database=clean_db) == []


def test_bad_grants_and_settles_are_refused_and_write_nothing(
    clean_db: Engine, known: Queue
) -> None:
    hooks = LedgerHooks(clean_db)
    before = table_snapshot(clean_db)
    with pytest.raises(InvalidRequest):
        grant(-1)
    for g in (grant(10, "-0.5"), grant(10, "NaN"), grant(10, ws=""), grant(10, stage="\x00")):
        with pytest.raises(InvalidRequest):
            hooks.admit(g)
    ok = grant(10)
    with pytest.raises(InvalidRequest, match="outcome"):
        hooks.settle(ok, Usage(1, 1), "great", "openai", None, None)
    with pytest.raises(InvalidRequest, match="cost"):
        hooks.settle(ok, Usage(1, 1), "ok", "openai", None, Decimal("-1"))
    with pytest.raises(InvalidRequest, match="time zone"):
        hooks.settle(ok, Usage(1, 1), "ok", "openai", None, None, datetime(2026, 1, 1))
    for args in ((-1, 0), (1, True), (1.5, 2)):
        with pytest.raises(InvalidRequest):
            Usage(*args)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        LedgerHooks(clean_db, reservation_ttl=float("nan"))
    assert table_snapshot(clean_db) == before


def test_processes_admitting_at_once_never_pass_the_last_unit_of_a_budget(
    clean_db: Engine, known: Queue, database_url: str
) -> None:
    limit, processes, each = 25, 4, 12  # 48 asks for 25 units
    set_budget(WS, "day", limit_tokens=limit, database=clean_db)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=admit_many, args=(database_url, WS, each, 1, barrier, out))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    admitted = sum(a for a, _ in results)
    assert admitted == limit
    assert sum(r for _, r in results) == processes * each - limit
    assert len(rows(clean_db, "spend_reservations")) == limit


# ---------------------------------------------------------------------------- the ledger


def test_a_settle_is_written_once_and_a_repeat_writes_nothing(
    clean_db: Engine, known: Queue
) -> None:
    hooks = LedgerHooks(clean_db)
    g = grant(100, "0.01", stage="summarize", request_id="r-1", cell_key="cell:1")
    hooks.admit(g)
    started = datetime.now(UTC)
    hooks.settle(g, Usage(70, 30), "ok", "openai", "gpt-x", Decimal("0.002"), started, None)
    hooks.settle(g, Usage(70, 30), "ok", "openai", "gpt-x", Decimal("0.002"), started, None)
    hooks.settle(g, Usage(1, 1), "failed", "openai", "gpt-x", None)  # a late different one
    (row,) = rows(clean_db, "spend_ledger")
    assert row["permit_id"] == g.permit_id
    assert (row["input_tokens"], row["output_tokens"], row["cost"]) == (70, 30, Decimal("0.002"))
    assert (row["stage"], row["request_id"], row["cell_key"], row["model"]) == (
        "summarize",
        "r-1",
        "cell:1",
        "gpt-x",
    )
    assert row["fenced"] is None  # no claim
    assert rows(clean_db, "spend_reservations") == []


def test_a_settle_under_a_claim_is_written_in_its_fence_and_kept_when_the_lease_is_lost(
    clean_db: Engine, known: Queue
) -> None:
    request = known.enqueue("summarize", WS, "job-2")
    claim = known.claim(request.request_id, "worker-1")
    assert claim is not None
    hooks = LedgerHooks(clean_db)
    live = grant(10, request_id=request.request_id, claim_token=claim.token)
    hooks.admit(live)
    settle(hooks, live, Usage(5, 5))
    stale = grant(10, request_id=request.request_id, claim_token="not-the-token")
    hooks.admit(stale)
    settle(hooks, stale, Usage(5, 5))
    fenced = {r["permit_id"]: r["fenced"] for r in rows(clean_db, "spend_ledger")}
    assert fenced == {live.permit_id: True, stale.permit_id: False}


def test_spend_is_read_by_workspace_stage_and_provider(clean_db: Engine, known: Queue) -> None:
    hooks = LedgerHooks(clean_db)
    calls = [
        (WS, "summarize", "openai", Usage(100, 10), "0.10"),
        (WS, "summarize", "openai", Usage(200, 20), "0.20"),
        (WS, "translate", "anthropic", Usage(50, 5), "0.05"),
        ("ws-other", "summarize", "openai", Usage(1, 1), "0.01"),
    ]
    for ws, stage, provider, usage, cost in calls:
        g = grant(10, ws=ws, stage=stage, provider=provider)
        hooks.settle(g, usage, "ok", provider, None, Decimal(cost))
    report = spend(clean_db, workspace_id=WS)
    assert [
        (r["workspace"], r["stage"], r["provider"], r["calls"], r["cost"]) for r in report["rows"]
    ] == [
        (WS, "summarize", "openai", 2, "0.30"),
        (WS, "translate", "anthropic", 1, "0.05"),
    ]
    assert report["total"] == {"calls": 3, "input_tokens": 350, "output_tokens": 35, "cost": "0.35"}
    by_provider = spend(clean_db, by=["provider"])
    assert {r["provider"]: r["cost"] for r in by_provider["rows"]} == {
        "openai": "0.31",
        "anthropic": "0.05",
    }
    future = datetime.now(UTC) + timedelta(hours=1)
    assert spend(clean_db, since=future)["rows"] == []
    with pytest.raises(InvalidRequest, match="group"):
        spend(clean_db, by=["colour"])


# ---------------------------------------------------------------------------- the CLI


def test_the_cli_sets_shows_and_clears_budgets_and_reads_spend(
    clean_db: Engine, known: Queue
) -> None:
    from tests.integration.test_cli import onceflow

    made = onceflow(
        "budget", "set", WS, "--period", "day", "--cost", "2.5", "--on-exceeded", "wait"
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["limit_cost"] == "2.5"
    before = table_snapshot(clean_db)
    for bad in (["--cost", "NaN"], ["--cost", "-1"], ["--tokens", "-3"], []):
        refused = onceflow("budget", "set", WS, "--period", "day", *bad)
        assert refused.returncode == 1 and "InvalidRequest" in refused.stderr, refused.stderr
    unknown = onceflow("budget", "set", "ws-nobody", "--period", "day", "--tokens", "5")
    assert unknown.returncode == 1 and "UnknownWorkspace" in unknown.stderr
    assert table_snapshot(clean_db) == before
    hooks = LedgerHooks(clean_db)
    g = grant(10, stage="summarize")
    hooks.admit(g)
    settle(hooks, g, Usage(40, 2), cost="0.5")
    shown = json.loads(onceflow("budget", "show", WS, "--json").stdout)["budgets"]
    assert [(b["period"], b["spent_cost"], b["spent_tokens"]) for b in shown] == [
        ("day", "0.5", 42)
    ]
    report = json.loads(onceflow("spend", "--by", "provider", "--json").stdout)
    assert report["rows"][0]["provider"] == "openai" and report["total"]["cost"] == "0.5"
    table = onceflow("spend", "--workspace", WS)
    assert "summarize" in table.stdout and "total: 1 calls" in table.stdout
    bad_time = onceflow("spend", "--since", "yesterday")
    assert bad_time.returncode == 1 and "ISO 8601" in bad_time.stderr
    cleared = json.loads(onceflow("budget", "clear", WS).stdout)
    assert cleared["cleared"] == ["day"]


def test_the_providers_outcomes_are_recorded_in_the_ledgers_names(
    clean_db: Engine, known: Queue
) -> None:
    hooks = LedgerHooks(clean_db)
    failed, unsettled, limited = grant(30, "0.3"), grant(40, "0.4"), grant(50, "0.5")
    for g in (failed, unsettled, limited):
        hooks.admit(g)
    hooks.settle(failed, None, "error", "openai", None, None)
    hooks.settle(unsettled, None, "unsettled", "openai", None, None)  # charged its estimate
    hooks.settle(limited, None, "rate_limited", "openai", None, None)
    got = {
        r["permit_id"]: (r["outcome"], r["input_tokens"], r["cost"])
        for r in rows(clean_db, "spend_ledger")
    }
    assert got == {
        failed.permit_id: ("failed", 0, None),
        unsettled.permit_id: ("abandoned", 40, Decimal("0.4")),
        limited.permit_id: ("rate_limited", 0, None),
    }
    assert rows(clean_db, "spend_reservations") == []
