"""The dashboard's reads stay cheap on a big table: partial indexes, no sequential scan."""

from __future__ import annotations

import json

import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.db import fetch_all, raw_connection
from onceflow.keys import counters_key, counters_workspaces_key
from onceflow.locks import savings
from onceflow.queue import overview

pytestmark = pytest.mark.slow

_ROWS = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, max_attempts, max_crash_attempts, finished_at, result, error,
     claim_token, lease_expires_at, run_after)
SELECT :prefix || i, 'w' || (i % 50), 'j' || i, '', 'evaluate', true, '{}', 'h',
       CASE WHEN i % 3 = 0 THEN 'llm' ELSE 'fallback' END, :status, 5, 3,
       CASE WHEN :status IN ('queued', 'running') THEN NULL ELSE now() - i * interval '1 s' END,
       '{}', CASE WHEN :status = 'dead' THEN '{"type": "E", "message": "m"}'::jsonb END,
       CASE WHEN :status = 'running' THEN 't' END,
       CASE WHEN :status = 'running' THEN now() + interval '30 s' END,
       now() + (i % 2) * interval '1 hour'
FROM generate_series(1, :n) AS i
"""


def test_request_table_reads_use_partial_indexes_on_a_big_table(clean_db: Engine) -> None:
    with clean_db.begin() as conn:
        for status, n in (("succeeded", 60_000), ("queued", 500), ("running", 200), ("dead", 300)):
            conn.execute(text(_ROWS), {"prefix": status + "-", "status": status, "n": n})
        conn.execute(text("ANALYZE workspace_process_requests"))
    plans = {}
    with raw_connection(clean_db) as raw:
        raw.execute("VACUUM workspace_process_requests")  # index-only scans need the VM
        for name, query in overview.REQUEST_QUERIES.items():
            plans[name] = json.dumps(fetch_all(raw, "EXPLAIN (FORMAT JSON) " + query, {}))
    for name, plan in plans.items():
        assert '"Node Type": "Seq Scan"' not in plan, (name, plan)
        assert "Bitmap Heap Scan" not in plan or name != "depth", (name, plan)
    assert all(ix in plans["depth"] for ix in ("ix_wpr_claim", "ix_wpr_lease", "ix_wpr_dead"))
    assert plans["depth"].count('"Index Only Scan"') == 3, plans["depth"]
    assert "ix_wpr_lease" in plans["running"]
    assert '"Index Scan"' in plans["dead"] and "ix_wpr_dead" in plans["dead"]

    snap = overview.read_tables(clean_db)
    # The answers agree with the table; the lists are bounded.
    assert snap["depth"]["llm"]["evaluate"]["dead"] == 100
    due = [snap["depth"][wc]["evaluate"]["queued"] for wc in ("llm", "fallback")]
    assert sum(due) == 250  # i % 2 = 0: due now; the other half is scheduled an hour later
    assert len(snap["running"]) == overview.RUNNING_LIMIT
    assert len(snap["dead"]) == overview.DEAD_LIMIT
    assert [d["request_id"] for d in snap["dead"][:3]] == ["dead-1", "dead-2", "dead-3"]
    assert snap["dead"][0]["error"] == "E: m"


def test_savings_read_is_bounded(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    key = counters_workspaces_key()
    names = [f"dash-sv-{i:03d}" for i in range(savings.SAVINGS_WORKSPACES + 20)]
    try:
        client.delete(key)
        client.sadd(key, names[0], "bad\x00name")  # a member no workspace id can be: skipped
        client.hset(counters_key(names[0]), mapping={"computes": 2, "preflight_hits": 5})
        out = savings.read_savings(client)
        assert out["workspaces"] == [{"workspace_id": names[0], "made": 2, "saved": 5, "asked": 7}]
        # A call made without the lock is counted in both computes and computes_without_lock
        # (the protocol's counts, test_locks.py): one call made, not two.
        client.hset(counters_key(names[0]), mapping={"computes_without_lock": 1})
        out = savings.read_savings(client)
        assert out["workspaces"] == [{"workspace_id": names[0], "made": 2, "saved": 5, "asked": 7}]
        client.sadd(key, *names)
        out = savings.read_savings(client)
        assert out["workspaces_total"] == len(names) + 1 and out["truncated"]
        # At most SAVINGS_WORKSPACES members are read (the bad one, if read, is skipped).
        assert len(out["workspaces"]) >= savings.SAVINGS_WORKSPACES - 1
        assert len(out["workspaces"]) <= savings.SAVINGS_WORKSPACES
    finally:
        client.delete(key, counters_key(names[0]))
