"""The queue's own recording (in this process, on the real database) and the collector's plan."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from onceflow.db import fetch_all, raw_connection
from onceflow.errors import LeaseLost
from onceflow.locks.counters import COUNTER_NAMES
from onceflow.metrics import METRIC_NAMES, definitions, registry
from onceflow.metrics import sql as metrics_sql
from onceflow.models.requests import NewRequest
from onceflow.oplog import OpLog
from onceflow.queue import Queue
from onceflow.queue.batch import Failure
from tests.acceptance.procs import wait_for


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_every_name_is_defined_once_and_exposed(clean_db: Engine, database_url: str) -> None:
    assert definitions.LOCK_OUTCOMES == COUNTER_NAMES
    from prometheus_client import generate_latest

    body = generate_latest(registry(database_url)).decode()
    typed = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")}
    # The text format names counters with _total, histograms by their base name.
    # (Single-process mode adds prometheus_client's *_created gauges; multiprocess mode not.)
    ours = {n for n in typed if n.startswith("onceflow_") and not n.endswith("_created")}
    assert ours == METRIC_NAMES


def test_zombie_writes_and_lease_takeovers_are_counted(queue: Queue, engine: Engine) -> None:
    items = [NewRequest("w", f"j{i}", "s", worker_class="zc") for i in range(6)]
    queue.enqueue_many(items)
    claims = queue.claim_next("zc", "w1", limit=6, lease_seconds=0.05)
    assert len(claims) == 6
    expiry = max(c.lease_expires_at for c in claims)

    def lapsed() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(text("SELECT now() > :t"), {"t": expiry}).scalar())

    wait_for(lapsed, what="the leases to lapse on the database clock")
    before = {op: value("onceflow_zombie_writes_rejected_total", operation=op)
              for op in definitions.ZOMBIE_OPERATIONS}  # fmt: skip
    with pytest.raises(LeaseLost):
        queue.complete(claims[0], {})
    with pytest.raises(LeaseLost):
        queue.complete(claims[1], {}, then=[NewRequest("w", "next", "s", worker_class="zc")])
    with pytest.raises(LeaseLost):
        queue.fail(claims[2], {"e": 1})
    with pytest.raises(LeaseLost):
        queue.heartbeat(claims[3])
    assert isinstance(queue.release([claims[4]])[0], LeaseLost)
    assert isinstance(queue.fail_many([Failure(claims[5], {"e": 1})])[0], LeaseLost)
    with pytest.raises(LeaseLost):
        OpLog(engine).apply_op("w", "doc", {"type": "cell.set", "column": "c", "value": 1},
                               fence=claims[0])  # fmt: skip
    after = {op: value("onceflow_zombie_writes_rejected_total", operation=op)
             for op in definitions.ZOMBIE_OPERATIONS}  # fmt: skip
    assert {op: after[op] - before[op] for op in after} == {
        "complete": 1, "hand_off": 1, "fail": 2, "heartbeat": 1, "release": 1, "op": 1,
    }  # fmt: skip

    # Another worker takes over the lapsed leases: one by id, the rest in a batch.
    taken = value("onceflow_leases_reclaimed_total", worker_class="zc")
    retried = value("onceflow_attempts_total", worker_class="zc", stage="s", outcome="retried")
    picked = value("onceflow_pickup_latency_seconds_count", worker_class="zc", stage="s")
    assert queue.claim(claims[0].request_id, "w2") is not None
    queue.enqueue("s", "w", "fresh", worker_class="zc")
    assert len(queue.claim_next("zc", "w2", limit=10)) == 6  # 5 lapsed + the fresh one
    assert value("onceflow_leases_reclaimed_total", worker_class="zc") - taken == 6
    retried_now = value("onceflow_attempts_total", worker_class="zc", stage="s", outcome="retried")
    assert retried_now - retried == 6
    # Only the fresh one came from the queue: the only new pickup latency.
    assert (
        value("onceflow_pickup_latency_seconds_count", worker_class="zc", stage="s") - picked == 1
    )


def _fill(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO workspace_process_requests
                (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
                 worker_class, status, max_attempts, max_crash_attempts, finished_at, result)
            SELECT 'done-' || i, 'w', 'j' || i, '', 'evaluate', true, '{}', 'h',
                   CASE WHEN i % 3 = 0 THEN 'llm' ELSE 'fallback' END, 'succeeded', 5, 3,
                   now(), '{}'
            FROM generate_series(1, 100000) AS i
        """)
        )
        conn.execute(
            text("""
            INSERT INTO workspace_process_requests
                (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
                 worker_class, status, max_attempts, max_crash_attempts, run_after,
                 lease_expires_at, claim_token, claimed_by, finished_at)
            SELECT 'live-' || i, 'w', 'l' || i, '', 's' || (i % 4), true, '{}', 'h',
                   CASE WHEN i % 2 = 0 THEN 'llm' ELSE 'fallback' END,
                   (ARRAY['queued', 'queued', 'running', 'dead'])[i % 4 + 1], 5, 3,
                   now() + make_interval(secs => (i % 3) - 1),
                   CASE WHEN i % 4 = 2 THEN now() + interval '1 minute' END,
                   CASE WHEN i % 4 = 2 THEN 't' || i END, CASE WHEN i % 4 = 2 THEN 'x' END,
                   CASE WHEN i % 4 = 3 THEN now() END
            FROM generate_series(1, 1000) AS i
        """)
        )
    with raw_connection(engine) as raw:
        raw.execute("VACUUM ANALYZE workspace_process_requests")


def test_live_counts_read_only_the_partial_indexes(clean_db: Engine) -> None:
    _fill(clean_db)
    with raw_connection(clean_db) as raw:
        plan = json.dumps(fetch_all(raw, "EXPLAIN (FORMAT JSON) " + metrics_sql.Q_LIVE_COUNTS, {}))
        rows = fetch_all(raw, metrics_sql.Q_LIVE_COUNTS, {})
        truth = fetch_all(raw, """
            SELECT worker_class, stage, CASE WHEN status = 'queued' AND run_after > now()
                   THEN 'scheduled' ELSE status END AS status, count(*) AS n
            FROM workspace_process_requests WHERE status <> 'succeeded'
            GROUP BY 1, 2, 3""", {})  # fmt: skip
    for index in ("ix_wpr_claim", "ix_wpr_lease", "ix_wpr_dead"):
        assert index in plan, plan
    assert '"Node Type": "Seq Scan"' not in plan, plan
    assert '"Node Type": "Bitmap Heap Scan"' not in plan, plan
    assert plan.count('"Node Type": "Index Only Scan"') == 3, plan
    counted: dict[tuple[str, str, str], Any] = {}
    for r in rows:
        for status in ("queued", "scheduled", "running", "dead"):
            if r[status]:
                key = (r["worker_class"], r["stage"], status)
                counted[key] = counted.get(key, 0) + r[status]
    assert counted == {(t["worker_class"], t["stage"], t["status"]): t["n"] for t in truth}
