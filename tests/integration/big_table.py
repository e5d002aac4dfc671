"""Rows for the claim's query-plan tests: a table mostly of finished rows, a little work."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, text

from onceflow.db import fetch_all, raw_connection
from onceflow.queue import sql

FINISHED = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, max_attempts, max_crash_attempts, finished_at, result)
SELECT 'done-' || i, 'w' || (i % 50), 'j' || i, '', 'evaluate', true, '{}', 'h',
       CASE WHEN i % 3 = 0 THEN 'llm' ELSE 'fallback' END, 'succeeded', 5, 3, now(), '{}'
FROM generate_series(1, :finished) AS i
"""

QUEUED = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, max_attempts, max_crash_attempts, priority)
SELECT 'todo-' || i, 'w' || (i % 50), 'j' || i, '', 'evaluate', true, '{}', 'h',
       CASE WHEN i % 2 = 0 THEN 'llm' ELSE 'fallback' END, 5, 3, i % :priorities
FROM generate_series(1, :queued) AS i
"""


def fill(conn: Connection, *, finished: int, queued: int = 1000, priorities: int = 1) -> None:
    """``finished`` succeeded rows and ``queued`` queued ones over 50 workspaces and two
    worker classes (priorities 0 … ``priorities``-1), then ANALYZE."""
    conn.execute(text(FINISHED), {"finished": finished})
    conn.execute(text(QUEUED), {"queued": queued, "priorities": priorities})
    conn.execute(text("ANALYZE workspace_process_requests"))


def claim_plan(engine: Engine) -> list[Any]:
    """EXPLAIN (FORMAT JSON) of a claim of ten ``llm`` requests, the statement exactly as
    ``claim_next`` sends it (psycopg, literal LIMIT)."""
    params = {
        "worker_class": "llm", "worker_id": "w", "tokens": " ".join(["t"] * 10),
        "lease_seconds": 30.0, "max_runtime": None, "now": None, "lazy": True, "terms": None,
    }  # fmt: skip
    with raw_connection(engine) as raw:
        return fetch_all(raw, "EXPLAIN (FORMAT JSON) " + sql.claim_next_sql(10), params)
