"""A claim and a completion by key keep one generic plan.

psycopg prepares a statement on its 6th run; Postgres then plans the first five executions
with their values (custom plans) and afterwards keeps one generic plan, unless the generic
plan costs more than the custom ones, in which case it plans every execution again. The
statements that find a request by ``(workspace_id, request_id)`` or, for a caller that
names it by id alone, by its id used one form for both: ``coalesce(:workspace_id, <the
workspace of the id>)``. With the workspace given, a custom plan folds the coalesce and
drops the id lookup; the generic plan keeps it, and was costed higher whenever the table's
statistics were those of an empty table (a new install, a table analyzed before a burst):
every claim and every completion was planned again, ~0.5 ms of backend CPU per stage
(bench/drain_bench.py measured a drain's Postgres CPU doubled). Now a caller with the
workspace runs a keyed form (``Query.sql_for``), whose generic plan is the custom one.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import text

from onceflow.db import make_engine, raw_connection
from onceflow.migrate import migrate
from onceflow.models.requests import NewRequest
from onceflow.queue import Queue
from onceflow.queue import sql as queue_sql
from onceflow.queue.sql import claim_next_sql


def _as_prepared(sql: str) -> str:
    """``sql`` as psycopg sends it: each named placeholder becomes ``$n`` by first use."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, sql).replace("%%", "%")


def _prepared(engine: Any) -> list[tuple[str, int, int]]:
    """(statement, generic plans, custom plans) prepared on the pool's one connection."""
    with raw_connection(engine) as raw:
        rows = raw.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        ).fetchall()
    return [(str(s), int(g), int(c)) for s, g, c in rows]


def _grown_after_empty_stats(engine: Any) -> None:
    """The table analyzed while empty, then 2,000 queued rows ``r-<i>`` in ``w<i % 50>``."""
    with engine.begin() as conn:
        conn.execute(text("ANALYZE workspace_process_requests"))  # the stats of an empty table
        conn.execute(
            text("""
            INSERT INTO workspace_process_requests
                (request_id, workspace_id, job_id, branch_path, stage, dedupe, input,
                 input_hash, worker_class, max_attempts, max_crash_attempts)
            SELECT 'r-' || i, 'w' || (i % 50), 'j' || i, '', 'evaluate', true, '{}', 'h',
                   'default', 5, 3
            FROM generate_series(1, 2000) AS i
            """)
        )


def test_claims_and_completions_by_key_are_not_planned_at_every_run(empty_database: str) -> None:
    migrate(empty_database)
    engine = make_engine(empty_database, pool_size=1)  # one connection: one set of statements
    queue = Queue(engine)
    try:
        _grown_after_empty_stats(engine)
        runs = 30  # each completion's: complete (a Claim's), then finish (a Celery stage's)
        for i in range(1, 2 * runs + 1):
            claim = queue.claim(f"r-{i}", "w1", workspace_id=f"w{i % 50}")
            assert claim is not None
            if i <= runs:
                queue.complete(claim, {"i": i})
            else:
                queue.finish(claim, {"i": i})
        plans = {
            name: next((g, c) for s, g, c in _prepared(engine) if s == _as_prepared(sql))
            for name, sql in (
                ("claim", queue_sql.CLAIM.sql),
                ("complete", queue_sql.COMPLETE_CHANGED.sql),
                ("finish", queue_sql.FINISH.sql),
            )
        }
        # Prepared at the 6th run; five custom plans, then the generic one for the rest.
        want = {"claim": (2 * runs - 10, 5), "complete": (runs - 10, 5), "finish": (runs - 10, 5)}
        assert plans == want, plans
    finally:
        engine.dispose()


def test_a_caller_by_id_alone_runs_the_form_that_finds_the_workspace() -> None:
    """The keyed form names the workspace parameter; the other finds it from the id."""
    assert queue_sql.CLAIM.by_id is not None
    assert queue_sql.CLAIM.sql_for({"workspace_id": "w1", "request_id": "r"}) == queue_sql.CLAIM.sql
    assert (
        queue_sql.CLAIM.sql_for({"workspace_id": None, "request_id": "r"}) == queue_sql.CLAIM.by_id
    )
    assert "coalesce(CAST(%(workspace_id)s" in queue_sql.CLAIM.by_id
    assert "coalesce(CAST(%(workspace_id)s" not in queue_sql.CLAIM.sql
    keyed = [name for name, q in vars(queue_sql).items() if getattr(q, "by_id", None) is not None]
    for name in ("CLAIM", "HEARTBEAT", "COMPLETE", "COMPLETE_CHANGED", "FINISH", "FAIL",
                 "FENCE_CHECK"):  # fmt: skip
        assert name in keyed


def _generic_plan(raw: Any, sql: str, values: list[Any]) -> str:
    """The generic plan Postgres keeps for ``sql`` once prepared (PG 15: force it, EXPLAIN)."""
    raw.execute("DEALLOCATE ALL")
    raw.execute(f"PREPARE probe AS {_as_prepared(sql)}")
    raw.execute("SET plan_cache_mode = force_generic_plan")
    try:
        args = ", ".join("NULL" if v is None else f"'{v}'" for v in values)
        lines = raw.execute(f"EXPLAIN EXECUTE probe({args})").fetchall()
        return "\n".join(str(line[0]) for line in lines)
    finally:
        raw.execute("RESET plan_cache_mode")
        raw.execute("DEALLOCATE probe")


def test_a_one_row_enqueue_probes_by_key_in_its_generic_plan(empty_database: str) -> None:
    """ENQUEUE_ONE (a single enqueue, a batch or hand-off of one) reads an existing row by its
    key, also in the plan kept from an empty table's statistics (a plan that scanned the
    table would make every duplicate enqueue O(table) until the next ANALYZE)."""
    migrate(empty_database)
    engine = make_engine(empty_database, pool_size=1)
    queue = Queue(engine)
    try:
        _grown_after_empty_stats(engine)
        names = re.findall(r"%\((\w+)\)s", queue_sql.ENQUEUE_ONE.sql)
        values = {"request_id": "r-7", "workspace_id": "w7", "input": "{}", "dedupe": "true",
                  "priority": 0, "max_attempts": 5, "max_crash_attempts": 3, "delay": 0,
                  "notify": "false", "now": None}  # fmt: skip
        ordered = list(dict.fromkeys(names))
        with raw_connection(engine) as raw:
            plan = _generic_plan(
                raw, queue_sql.ENQUEUE_ONE.sql, [values.get(n, "x") for n in ordered]
            )
        assert "Seq Scan" not in plan, plan
        assert "Index" in plan, plan
        # And through the queue: a duplicate of an existing row is found, not created.
        first = queue.enqueue("evaluate", "w1", "fresh-job")
        again = queue.enqueue("evaluate", "w1", "fresh-job")
        assert (first.created, again.created, again.request_id) == (True, False, first.request_id)
    finally:
        engine.dispose()


def _removed_rows(node: dict[str, Any]) -> int:
    """Rows a plan node and its children read and then dropped by a filter or join filter."""
    here = int(node.get("Rows Removed by Filter", 0)) + int(
        node.get("Rows Removed by Join Filter", 0)
    )
    return here + sum(_removed_rows(child) for child in node.get("Plans", ()))


def _index_scans(node: dict[str, Any], index: str) -> list[dict[str, Any]]:
    found = [node] if node.get("Index Name") == index else []
    for child in node.get("Plans", ()):
        found += _index_scans(child, index)
    return found


@pytest.mark.parametrize("plan_mode", ["force_generic_plan", "force_custom_plan"])
def test_a_claim_does_not_read_the_requests_in_flight(empty_database: str, plan_mode: str) -> None:
    """claim_next looks for lapsed leases through ix_wpr_lease bounded by the time: with
    300 requests of its class in flight (live leases), its plan reads none of them. Before,
    the bound was a join filter against the `n` CTE: every claim read every running row of
    its class (O(in flight) backend time per claim; a Worker with many slow calls in flight
    paid it at every claim)."""
    migrate(empty_database)
    engine = make_engine(empty_database, pool_size=1)
    queue = Queue(engine)
    in_flight = 300
    try:
        queue.enqueue_many(
            [NewRequest("w1", f"j{i}", "s", worker_class="wc-busy") for i in range(in_flight + 5)]
        )
        claimed = queue.claim_next("wc-busy", "w", limit=in_flight, lease_seconds=600)
        assert len(claimed) == in_flight
        with engine.begin() as conn:
            conn.execute(text("ANALYZE workspace_process_requests"))
        sql = claim_next_sql(1)
        names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql)))
        values = {"worker_class": "wc-busy", "worker_id": "w2", "tokens": "t", "now": None,
                  "lease_seconds": 30, "max_runtime": 60, "lazy": "false",
                  "terms": None}  # fmt: skip
        args = ", ".join("NULL" if values[n] is None else f"'{values[n]}'" for n in names)
        with raw_connection(engine) as raw:
            raw.execute(f"PREPARE probe AS {_as_prepared(sql)}")
            raw.execute(f"SET plan_cache_mode = {plan_mode}")
            try:
                with raw.transaction(force_rollback=True):
                    row = raw.execute(
                        f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE probe({args})"
                    ).fetchone()
            finally:
                raw.execute("RESET plan_cache_mode")
                raw.execute("DEALLOCATE probe")
        assert row is not None
        plan = row[0][0]["Plan"]
        assert plan["Actual Rows"] == 1  # it claimed one of the five queued
        [lease_scan] = _index_scans(plan, "ix_wpr_lease")
        assert "lease_expires_at" in lease_scan["Index Cond"], lease_scan
        assert lease_scan["Actual Rows"] == 0, lease_scan
        assert _removed_rows(plan) < in_flight, plan
    finally:
        engine.dispose()


def _rows_read(node: dict[str, Any]) -> int:
    """Rows the plan's scans of the table returned, over all their loops."""
    here = 0
    if node.get("Relation Name") == "workspace_process_requests":
        here = int(node["Actual Rows"]) * int(node.get("Actual Loops", 1))
    return here + sum(_rows_read(child) for child in node.get("Plans", ()))


@pytest.mark.parametrize("plan_mode", ["force_generic_plan", "force_custom_plan"])
def test_a_wait_reads_the_front_of_its_indexes_not_the_queue(
    empty_database: str, plan_mode: str
) -> None:
    """NEXT_WORK (each wait_for_work) with 300 delayed requests of a class at three
    priorities and 300 in flight reads a handful of index entries, not the class's rows
    (it read all 600 before: O(queued + in flight) per wait)."""
    migrate(empty_database)
    engine = make_engine(empty_database, pool_size=1)
    queue = Queue(engine)
    try:
        queue.enqueue_many(
            [
                NewRequest(
                    "w1",
                    f"d{i}",
                    "s",
                    worker_class="wc-w",
                    priority=i % 3,
                    run_after_seconds=600 + i,
                )
                for i in range(300)
            ]
        )
        queue.enqueue_many(
            [NewRequest("w1", f"r{i}", "s", worker_class="wc-w") for i in range(300)]
        )
        assert len(queue.claim_next("wc-w", "w", limit=300, lease_seconds=900)) == 300
        sql = queue_sql.NEXT_WORK.sql
        with raw_connection(engine) as raw:
            raw.execute("VACUUM ANALYZE workspace_process_requests")  # autocommit
            raw.execute(f"PREPARE probe AS {_as_prepared(sql)}")
            raw.execute(f"SET plan_cache_mode = {plan_mode}")
            try:
                row = raw.execute(
                    "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE probe('{wc-w}')"
                ).fetchone()
                answer = raw.execute("EXECUTE probe('{wc-w}')").fetchone()
            finally:
                raw.execute("RESET plan_cache_mode")
                raw.execute("DEALLOCATE probe")
        assert row is not None and answer is not None
        assert 590 < answer[0] <= 600  # the earliest delayed row (i = 0, priority 0)
        plan = row[0][0]["Plan"]
        assert _rows_read(plan) <= 10, plan
    finally:
        engine.dispose()
