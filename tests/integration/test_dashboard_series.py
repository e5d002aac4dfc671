"""The sweeper's rollup on a real table: bucket counts equal the rows', a repeated rollup
counts nothing twice, rescues and savings add up once, spend by minute, pruning, the
series read, and its statements' plans (no sequential scan of the requests or the ledger)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.db import fetch_all, raw_connection
from onceflow.errors import InvalidRequest
from onceflow.ids import RequestId
from onceflow.models import Dispatch, SweepResult
from onceflow.models.scopes import WorkspaceScope
from onceflow.queue import series

pytestmark = pytest.mark.slow

# Rows of the last 150 s: created 0.5 s apart; claimed half a second after creation
# (pickup 0.5 s) unless still queued; finished 0.2 s after the claim. `queued` rows with a
# claim were claimed, failed and queued again (run_after moved past the claim).
_RECENT = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, max_attempts, max_crash_attempts, claim_token, lease_expires_at,
     created_at, updated_at, run_after, claimed_at, finished_at)
SELECT 'r' || i, 'w' || (i % 5), 'j' || i, '', 'stage' || (i % 2), true, '{}', 'h',
       CASE WHEN i % 3 = 0 THEN 'llm' ELSE 'cpu' END, s.status, 5, 3,
       CASE WHEN s.status = 'running' THEN 't' END,
       CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END,
       t.at, t.at,
       CASE WHEN s.status = 'queued' AND i % 16 = 3 THEN t.at + interval '1 minute'
            ELSE t.at END,
       CASE WHEN s.status = 'queued' AND i % 16 = 11 THEN NULL
            WHEN s.status = 'cancelled' THEN NULL
            ELSE t.at + interval '0.5 seconds' END,
       CASE WHEN s.status IN ('succeeded', 'dead') THEN t.at + interval '0.7 seconds'
            WHEN s.status = 'cancelled' THEN t.at + interval '0.1 seconds' END
FROM generate_series(1, :n) AS i,
     LATERAL (SELECT (ARRAY['succeeded', 'succeeded', 'succeeded', 'queued', 'running',
                            'dead', 'cancelled', 'succeeded'])[i % 8 + 1] AS status) s,
     LATERAL (SELECT now() - interval '1 second' - i * interval '0.5 seconds' AS at) t
"""
# History: finished two days ago (outside every window; its rows must not be read).
_OLD = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, max_attempts, max_crash_attempts, created_at, updated_at,
     run_after, claimed_at, finished_at)
SELECT 'old' || i, 'w' || (i % 50), 'j' || i, '', 'stage0', true, '{}', 'h', 'cpu',
       'succeeded', 5, 3, t.at, t.at, t.at, t.at, t.at
FROM generate_series(1, :n) AS i,
     LATERAL (SELECT now() - interval '2 days' - i * interval '1 second' AS at) t
"""
_LEDGER = """
INSERT INTO spend_ledger
    (workspace_id, permit_id, provider, input_tokens, output_tokens, cost, saved_cost,
     outcome, recorded_at)
SELECT 'w' || (i % 3), 'p' || i, CASE WHEN i % 2 = 0 THEN 'openai' ELSE 'anthropic' END,
       10 * i, i, 0.001 * i, CASE WHEN i % 4 = 0 THEN 0.5 END,
       CASE WHEN i % 4 = 0 THEN 'cache_hit' ELSE 'ok' END, now() - i * interval '3 seconds'
FROM generate_series(1, :n) AS i
"""

EXPECTED = """
WITH ev AS (
    SELECT date_trunc('minute', created_at) AS bucket, worker_class, stage, 'enqueued' AS kind
    FROM workspace_process_requests WHERE created_at > now() - interval '5 minutes'
    UNION ALL
    SELECT date_trunc('minute', claimed_at), worker_class, stage, 'claimed'
    FROM workspace_process_requests WHERE claimed_at > now() - interval '5 minutes'
    UNION ALL
    SELECT date_trunc('minute', finished_at), worker_class, stage, status
    FROM workspace_process_requests WHERE finished_at > now() - interval '5 minutes'
)
SELECT bucket, worker_class, stage, kind, count(*) AS n FROM ev GROUP BY 1, 2, 3, 4
"""


def _expected(engine: Engine) -> dict[tuple[Any, str, str, str], int]:
    with engine.connect() as conn:
        return {(b, wc, st, kind): n for b, wc, st, kind, n in conn.execute(text(EXPECTED))}


def _rollup(engine: Engine) -> dict[tuple[Any, str, str, str], int]:
    out = {}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM onceflow_series")).mappings().all()
    for r in rows:
        for kind in ("enqueued", "claimed", "succeeded", "dead", "cancelled"):
            if r[kind]:
                out[(r["bucket"], r["worker_class"], r["stage"], kind)] = r[kind]
    return out


def _table(engine: Engine, name: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT * FROM {name} ORDER BY 1, 2, 3")).mappings()  # noqa: S608
        return [dict(r) for r in rows]


@pytest.fixture()
def filled(clean_db: Engine) -> Engine:
    with clean_db.begin() as conn:
        conn.execute(text(_RECENT), {"n": 300})
        conn.execute(text(_OLD), {"n": 100})
        conn.execute(text(_LEDGER), {"n": 40})
    return clean_db


def test_bucket_counts_equal_the_rows_and_a_rerun_changes_nothing(filled: Engine) -> None:
    series.write_rollup(filled)
    expected = _expected(filled)
    assert sum(n for k, n in expected.items() if k[3] == "enqueued") == 300
    assert _rollup(filled) == expected
    with filled.connect() as conn:
        pickup = conn.execute(text(
            "SELECT sum(pickup_count), sum(pickup_sum), max(pickup_max), sum(claimed) "
            "FROM onceflow_series"
        )).one()  # fmt: skip
        claimed_still = conn.execute(text(
            "SELECT count(*) FROM workspace_process_requests "
            "WHERE claimed_at > now() - interval '5 minutes' AND status <> 'queued'"
        )).scalar_one()  # fmt: skip
    # Latency of the claims still on their row (0.5 s each); the requeued ones counted only.
    assert pickup[0] == claimed_still and pickup[3] > claimed_still
    assert pickup[1] == pytest.approx(0.5 * claimed_still) and pickup[2] == pytest.approx(0.5)
    before = {n: _table(filled, n) for n in ("onceflow_series", "onceflow_series_spend")}
    series.write_rollup(filled)  # the same minutes again: recomputed, nothing doubled
    assert {n: _table(filled, n) for n in before} == before

    # A row claimed again in another minute: its claim moves (the minutes are recomputed).
    with filled.begin() as conn:
        conn.execute(text(
            "UPDATE workspace_process_requests SET claimed_at = now(), status = 'running', "
            "claim_token = 't', lease_expires_at = now() + interval '1 hour', "
            "finished_at = NULL WHERE request_id = 'r290'"
        ))  # fmt: skip
    series.write_rollup(filled)
    assert _rollup(filled) == _expected(filled)


def test_a_sweeps_rollup_reads_the_rows_once_a_minute(filled: Engine) -> None:
    first = series.write_rollup(filled, once_a_minute=True)
    with filled.begin() as conn:  # a row enqueued after it: the minute is not read again
        conn.execute(text(_RECENT.replace("'r' ||", "'later' ||")), {"n": 1})
    reads: list[str] = []
    rescue = SweepResult(
        rescued=[RequestId("r1")],
        quarantined=[],
        to_dispatch=[Dispatch(RequestId("r1"), "stage1", "cpu", "w1")],
    )
    again = series.write_rollup(
        filled, once_a_minute=True, result=rescue, savings=lambda: reads.append("redis")
    )
    with filled.connect() as conn:
        enqueued, rescued = conn.execute(
            text("SELECT sum(enqueued), sum(rescued) FROM onceflow_series")
        ).one()
    if first is not None and again is None:  # both in one minute (else: the next minute's)
        assert (enqueued, rescued) == (300, 1)  # the rescue is kept, the rows not re-read
        assert reads == []  # Redis is read only when the rollup is written
    assert series.write_rollup(filled) is not None  # a rollup asked for directly: always
    with filled.connect() as conn:
        assert conn.execute(text("SELECT sum(enqueued) FROM onceflow_series")).scalar_one() == 301


def test_the_depth_sample_and_rescues(filled: Engine) -> None:
    rescue = SweepResult(
        rescued=[RequestId("r1")], quarantined=[],
        to_dispatch=[Dispatch(RequestId("r1"), "stage1", "cpu", "w1"),
                     Dispatch(RequestId("r2"), "stage0", "cpu", "w2")],  # a wake-up, no rescue
    )  # fmt: skip
    series.write_rollup(filled, result=rescue)
    series.write_rollup(filled)  # a sweep that rescued nothing adds nothing
    with filled.connect() as conn:
        cur = conn.execute(text("SELECT date_trunc('minute', now())")).scalar_one()
        rows = conn.execute(
            text("SELECT * FROM onceflow_series WHERE bucket = :b"), {"b": cur}
        ).mappings().all()  # fmt: skip
        depth = conn.execute(text(
            "SELECT worker_class, stage, count(*) FILTER (WHERE status = 'queued' "
            "AND run_after <= now()), count(*) FILTER (WHERE status = 'running') "
            "FROM workspace_process_requests WHERE status IN ('queued', 'running') GROUP BY 1, 2"
        )).all()  # fmt: skip
    if datetime.now(UTC) - cur < timedelta(seconds=58):  # not across a minute's end
        assert sum(r["rescued"] for r in rows) == 1
        [hit] = [r for r in rows if r["rescued"]]
        assert (hit["worker_class"], hit["stage"]) == ("cpu", "stage1")
        sampled = {(r["worker_class"], r["stage"]): (r["queued"], r["running"]) for r in rows}
        for wc, stage, queued, running in depth:
            assert sampled[(wc, stage)] == (queued, running)


def test_spend_by_minute_and_savings_deltas(filled: Engine) -> None:
    series.write_rollup(filled)
    with filled.connect() as conn:
        expected = conn.execute(text(
            "SELECT date_trunc('minute', recorded_at), workspace_id, provider, count(*), "
            "sum(input_tokens), sum(output_tokens), sum(cost), sum(saved_cost) "
            "FROM spend_ledger GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
        )).all()  # fmt: skip
    got = [tuple(r.values()) for r in _table(filled, "onceflow_series_spend")]
    assert got == [tuple(r) for r in expected] and len(got) > 3

    def totals(made: int, saved: int, *, truncated: bool = False) -> dict[str, Any]:
        ws = [{"workspace_id": "a", "made": made, "saved": saved, "asked": made + saved}]
        return {"workspaces": ws, "truncated": truncated}

    def summed() -> tuple[int, int]:
        with filled.connect() as conn:
            made, saved = conn.execute(text(
                "SELECT COALESCE(sum(made), 0), COALESCE(sum(saved), 0) "
                "FROM onceflow_series_savings"
            )).one()  # fmt: skip
        return int(made), int(saved)

    series.write_rollup(filled, savings=totals(2, 3))
    assert summed() == (0, 0)  # the first totals: since when, nobody knows
    series.write_rollup(filled, savings=totals(5, 4))
    assert summed() == (3, 1)
    series.write_rollup(filled, savings=totals(5, 4))  # the same totals again: nothing
    assert summed() == (3, 1)
    series.write_rollup(filled, savings=totals(1, 1))  # Redis flushed: counts 0, then on
    series.write_rollup(filled, savings=totals(2, 1))
    assert summed() == (4, 1)
    new = totals(2, 1)
    new["workspaces"].append({"workspace_id": "b", "made": 7, "saved": 0, "asked": 7})
    series.write_rollup(filled, savings={**new, "truncated": True})  # b may be old: skipped
    assert summed() == (4, 1)


def test_rollup_rows_are_pruned_by_retention(filled: Engine) -> None:
    with filled.begin() as conn:
        for age in ("2 hours", "9 days"):
            at = {"age": age}
            conn.execute(text(
                "INSERT INTO onceflow_series (bucket, worker_class, stage, enqueued) VALUES "
                "(date_trunc('minute', now()) - CAST(:age AS interval), 'old', 's', 1)"
            ), at)  # fmt: skip
            conn.execute(text(
                "INSERT INTO onceflow_series_spend (bucket, workspace_id, provider, calls) "
                "VALUES (date_trunc('minute', now()) - CAST(:age AS interval), 'w', 'p', 1)"
            ), at)  # fmt: skip
    series.write_rollup(filled)  # requests kept for ever: the rollup keeps 8 days
    old = "SELECT count(*) FROM {} WHERE bucket < now() - interval '1 hour'"
    with filled.connect() as conn:
        assert conn.execute(text(old.format("onceflow_series"))).scalar_one() == 1
        assert conn.execute(text(old.format("onceflow_series_spend"))).scalar_one() == 1
    # Requests kept an hour: the rollup still keeps 8 days (the week chart).
    series.write_rollup(filled, retention_seconds=3600)
    with filled.connect() as conn:
        assert conn.execute(text(old.format("onceflow_series"))).scalar_one() == 1
        assert conn.execute(text(old.format("onceflow_series_spend"))).scalar_one() == 1
    with filled.begin() as conn:
        conn.execute(text(
            "UPDATE onceflow_series SET bucket = bucket - interval '10 days' "
            "WHERE worker_class = 'old'"
        ))  # fmt: skip
    series.write_rollup(filled, retention_seconds=30 * 86_400)  # kept longer: kept
    with filled.connect() as conn:
        assert conn.execute(text(old.format("onceflow_series"))).scalar_one() == 1
    series.write_rollup(filled, retention_seconds=3600)
    with filled.connect() as conn:
        assert conn.execute(text(old.format("onceflow_series"))).scalar_one() == 0


def test_read_series_buckets_equal_the_rollup(filled: Engine) -> None:
    with filled.begin() as conn:
        conn.execute(text(
            "INSERT INTO spend_budgets (workspace_id, period, limit_cost) VALUES ('w1', 'day', 5)"
        ))  # fmt: skip
    series.write_rollup(filled, savings={"workspaces": [], "truncated": False})
    out = series.read_series(filled, "hour")
    assert out["step_seconds"] == 60 and len(out["buckets"]) == 60
    times = [datetime.fromisoformat(b["t"]) for b in out["buckets"]]
    assert times == sorted(times) and times[1] - times[0] == timedelta(minutes=1)
    expected = _expected(filled)
    for kind in ("enqueued", "claimed", "succeeded", "dead", "cancelled"):
        assert sum(b[kind] for b in out["buckets"]) == sum(
            n for k, n in expected.items() if k[3] == kind
        ), kind
    llm = series.read_series(filled, "hour", worker_class="llm")
    assert sum(b["enqueued"] for b in llm["buckets"]) == 100  # i % 3 = 0 of 300
    assert llm["worker_class"] == "llm"
    with_pickups = [b for b in out["buckets"] if b["pickup"]["count"]]
    assert with_pickups and all(b["pickup"]["mean_seconds"] == pytest.approx(0.5)
                                for b in with_pickups)  # fmt: skip
    assert any(b["queued_max"] is not None for b in out["buckets"])
    spend = out["spend"]
    assert {p["provider"] for p in spend["by_provider"]} == {"openai", "anthropic"}
    total = sum(Decimal(p["cost"]) for s in spend["by_provider"] for p in s["points"])
    assert total == sum(Decimal("0.001") * i for i in range(1, 41))
    assert [w["workspace_id"] for w in spend["by_workspace"]] == ["w1", "w0", "w2"]  # by cost
    assert out["budgets"] == [{"workspace_id": "w1", "period": "day", "limit_cost": "5",
                               "limit_tokens": None, "on_exceeded": "fail"}]  # fmt: skip
    # A reader limited to some workspaces: their spend and budgets only; the rest is the same.
    scoped = series.read_series(filled, "hour", scope=WorkspaceScope.parse(["w0", "w2*"]))
    assert [w["workspace_id"] for w in scoped["spend"]["by_workspace"]] == ["w0", "w2"]
    assert scoped["budgets"] == []  # w1's budget is not of its workspaces
    assert (
        scoped["buckets"] == out["buckets"]
        and scoped["spend"]["by_provider"] == (spend["by_provider"])
    )
    only_w1 = series.read_series(filled, "hour", scope=WorkspaceScope.parse(["w1"]))
    assert [b["workspace_id"] for b in only_w1["budgets"]] == ["w1"]
    assert (
        series.read_series(filled, "hour", scope=WorkspaceScope.parse(["w_*"]))["spend"][
            "by_workspace"
        ]
        == []
    )  # an id's _ is not a wildcard
    day = series.read_series(filled, "day")
    assert day["step_seconds"] == 900 and len(day["buckets"]) == 96
    assert sum(b["enqueued"] for b in day["buckets"]) == 300
    week = series.read_series(filled, "week")
    assert week["step_seconds"] == 7200 and len(week["buckets"]) == 84
    assert sum(b["enqueued"] for b in week["buckets"]) == 300
    json.dumps(week)  # JSON as it is
    with pytest.raises(InvalidRequest, match="range must be one of hour, day, week"):
        series.read_series(filled, "year")
    with pytest.raises(InvalidRequest):
        series.read_series(filled, "hour", worker_class="")


def test_the_rollup_reads_indexes_on_a_big_table(clean_db: Engine) -> None:
    with clean_db.begin() as conn:
        conn.execute(text(_OLD), {"n": 20_000})
        conn.execute(text(_RECENT), {"n": 200})
        spread = _LEDGER.replace("(i % 3)", "(i % 40)")  # rows in every partition, if any
        conn.execute(text(spread.replace("now() -", "now() - interval '2 days' -")), {"n": 20_000})
        conn.execute(text(_LEDGER.replace("'p' ||", "'q' ||")), {"n": 50})
        conn.execute(text("ANALYZE workspace_process_requests"))
        conn.execute(text("ANALYZE spend_ledger"))
    with raw_connection(clean_db) as raw:
        window = fetch_all(raw, series.WINDOW, {"now": None})[0]
        params = {"cur": window["cur"], "start": window["start"], "stop": window["stop"]}
        for name in ("COUNTS", "SPEND"):
            plan = json.dumps(
                fetch_all(raw, "EXPLAIN (FORMAT JSON) " + getattr(series, name), params)
            )
            assert '"Node Type": "Seq Scan"' not in plan, (name, plan)
        reads = {"from": window["start"], "to": window["stop"], "step": 60,
                 "worker_class": None, "stage": None}  # fmt: skip
        for name in ("READ_COUNTS", "READ_GAUGES", "READ_SPEND_WORKSPACES"):
            plan = json.dumps(fetch_all(raw, "EXPLAIN (FORMAT JSON) " + getattr(series, name),
                                        reads))  # fmt: skip
            assert "Seq Scan" not in plan or "onceflow_series" in plan, (name, plan)


def _rescue() -> SweepResult:
    return SweepResult(
        rescued=[RequestId("r1")],
        quarantined=[],
        to_dispatch=[Dispatch(RequestId("r1"), "stage1", "cpu", "w1")],
    )


def _rescued(engine: Engine) -> int:
    with engine.connect() as conn:
        found = conn.execute(text("SELECT sum(rescued) FROM onceflow_series")).scalar_one()
    return int(found or 0)


def test_a_rollup_that_fails_keeps_the_sweeps_rescues(filled: Engine) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("Redis read failed mid-rollup")

    with pytest.raises(RuntimeError):
        series.write_rollup(filled, result=_rescue(), savings=broken)
    assert _rescued(filled) == 1  # committed before the recompute, which rolled back
    with filled.connect() as conn:
        assert conn.execute(text("SELECT sum(enqueued) FROM onceflow_series")).scalar_one() == 0


def test_a_rollup_skips_while_another_writer_holds_its_lock(filled: Engine) -> None:
    """A second writer (another Flow sweeping the database) neither waits nor writes; the
    rescues it brings are added all the same."""
    import threading

    with filled.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(CAST(:k AS bigint))"), {"k": 0x6F6E6365})
        try:
            done: list[Any] = []
            writer = threading.Thread(
                target=lambda: done.append(series.write_rollup(filled, result=_rescue())),
                daemon=True,
            )
            writer.start()
            writer.join(timeout=30)
            assert done == [None]  # returned (did not wait for the lock), wrote nothing
        finally:
            holder.execute(text("SELECT pg_advisory_unlock(CAST(:k AS bigint))"), {"k": 0x6F6E6365})
            holder.commit()
    assert _rescued(filled) == 1
    with filled.connect() as conn:
        assert conn.execute(text("SELECT sum(enqueued) FROM onceflow_series")).scalar_one() == 0
    assert series.write_rollup(filled) is not None  # the lock free: written
