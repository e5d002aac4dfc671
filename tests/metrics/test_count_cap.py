"""The live counts read at most a cap of index entries per status; past it they say so."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import Engine, text

from onceflow.metrics.collector import DatabaseCollector
from onceflow.queue.overview import read_tables
from tests.metrics.scrape import parse, total

_ROWS = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, max_attempts, max_crash_attempts, run_after, finished_at)
SELECT 'cap-' || i, 'w', 'j' || i, '', 's', true, '{}', 'h', 'cc',
       CASE WHEN i <= 40 THEN 'queued' ELSE 'dead' END, 5, 3, now() - interval '1 minute',
       CASE WHEN i > 40 THEN now() END
FROM generate_series(1, 45) AS i
"""


def _scrape(database_url: str, cap: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    reg = CollectorRegistry()
    reg.register(DatabaseCollector(database_url, count_cap=cap))
    return parse(generate_latest(reg).decode())


def test_counts_past_the_cap_are_flagged_lower_bounds(clean_db: Engine, database_url: str) -> None:
    with clean_db.begin() as conn:
        conn.execute(text(_ROWS))  # 40 queued (due), 5 dead
    capped = _scrape(database_url, cap=10)
    assert total(capped, "onceflow_requests", status="queued", worker_class="cc") == 10
    assert total(capped, "onceflow_requests_lower_bound", status="queued") == 1
    assert total(capped, "onceflow_requests", status="dead", worker_class="cc") == 5  # exact
    assert total(capped, "onceflow_requests_lower_bound", status="dead") == 0
    exact = _scrape(database_url, cap=1000)
    assert total(exact, "onceflow_requests", status="queued", worker_class="cc") == 40
    assert total(exact, "onceflow_requests_lower_bound", status="queued") == 0
    # The dashboard's read: the same cap, the same flag.
    snap = read_tables(clean_db, count_cap=10)
    assert snap["depth"]["cc"]["s"]["queued"] == 10
    assert snap["depth_lower_bound"] == ["queued", "scheduled"]
    assert read_tables(clean_db)["depth_lower_bound"] == []
