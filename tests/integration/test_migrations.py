"""Migrations on an empty database, drift against the models, and the claim's query plan."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from alembic import command
from sqlalchemy import Engine, text

from onceflow import ClaimRef, LeaseLost, Queue, Status
from onceflow.db import fetch_all, make_engine, raw_connection
from onceflow.migrate import alembic_config, check, migrate
from onceflow.queue import sql
from tests.integration.big_table import claim_plan, fill


def test_upgrade_head_on_empty_database_then_no_drift(empty_database: str) -> None:
    migrate(empty_database)
    migrate(empty_database)  # idempotent
    check(empty_database)  # `alembic check`: the models and the schema agree
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.connect() as conn:
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'workspace_process_requests'")
            ).scalar_one()
            assert "autovacuum_vacuum_scale_factor=0.01" in options
            version = conn.execute(text("SELECT version_num FROM onceflow_alembic_version"))
            assert version.scalar_one() == "0015"
    finally:
        engine.dispose()


ROWS_0005 = """
INSERT INTO workspace_process_requests
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, status, claim_token, claimed_by, lease_expires_at, heartbeat_at, claimed_at,
     attempts, max_attempts, max_crash_attempts, result, finished_at)
VALUES
    ('queued', 'w', 'j1', '', 's', true, '{"a": 1}', 'h1', 'default', 'queued',
     NULL, NULL, NULL, NULL, NULL, 0, 5, 3, NULL, NULL),
    ('running', 'w', 'j2', '', 's', true, '{"a": 2}', 'h2', 'default', 'running',
     'tok-0005', 'old-worker', now() + interval '30 seconds', now(), now(), 1, 5, 3, NULL, NULL),
    ('done', 'w', 'j3', '', 's', true, '{"a": 3}', 'h3', 'default', 'succeeded',
     NULL, 'old-worker', NULL, now(), now(), 1, 5, 3, '{"ok": true}', now())
"""

# Every row as JSON, without the columns 0006 and later revisions add.
ROWS_AS_0005 = """
SELECT to_jsonb(w) - 'lease_seconds' - 'run_deadline' - 'ended_run' - 'waited' - 'trace_context'
       AS row
FROM workspace_process_requests w ORDER BY request_id
"""


def test_0006_keeps_existing_rows_and_a_claim_taken_before_it_works_by_ref(
    empty_database: str,
) -> None:
    migrate(empty_database, "0005")
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(text(ROWS_0005))
            before = conn.execute(text(ROWS_AS_0005)).scalars().all()
        migrate(empty_database)
        check(empty_database)
        with engine.connect() as conn:
            assert conn.execute(text(ROWS_AS_0005)).scalars().all() == before
            added = conn.execute(
                text("SELECT count(*) FROM workspace_process_requests WHERE lease_seconds IS NULL"
                     " AND run_deadline IS NULL AND ended_run IS NULL")
            ).scalar_one()  # fmt: skip
            assert added == 3
        # The claim taken before the migration, by its bare ref: the row has no lease length
        # yet, so the heartbeat extends by the queue's default lease; then it completes.
        queue = Queue(engine)
        ref = ClaimRef("running", "tok-0005")
        with engine.connect() as conn:
            t = conn.execute(text("SELECT now()")).scalar_one()
        beat = queue.heartbeat(ref, now=t)
        assert beat.lease_expires_at == t + timedelta(seconds=queue.settings.lease_seconds)
        done = queue.complete(ref, {"ok": 2})
        assert (done.status, done.result, done.claimed_by) == (
            Status.SUCCEEDED,
            {"ok": 2},
            "old-worker",
        )
        with pytest.raises(LeaseLost):
            queue.heartbeat(ref)
        # And back: the downgrade drops the three columns, every row stays.
        with engine.connect() as conn:
            now_rows = conn.execute(text(ROWS_AS_0005)).scalars().all()
        engine.dispose()
        command.downgrade(alembic_config(empty_database), "0005")
        with engine.connect() as conn:
            assert conn.execute(text(ROWS_AS_0005)).scalars().all() == now_rows
    finally:
        engine.dispose()


# The primary key's columns, in order.
PK_COLUMNS = """
SELECT array_agg(a.attname ORDER BY k.ord) FROM pg_constraint c
JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord) ON true
JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
WHERE c.conrelid = 'workspace_process_requests'::regclass AND c.contype = 'p'
"""

# The enqueue of the release before 0007: its arbiter is the old key (request_id).
OLD_ENQUEUE = """
INSERT INTO workspace_process_requests AS w
    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
     worker_class, max_attempts, max_crash_attempts)
VALUES (:rid, 'w', 'j9', '', 's', true, '{}', 'h9', 'default', 5, 3)
ON CONFLICT (request_id) DO NOTHING
"""


def test_0007_0008_key_requests_by_workspace_keeping_rows_ids_and_old_wake_ups(
    empty_database: str,
) -> None:
    migrate(empty_database, "0006")
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.begin() as conn:
            conn.execute(text(ROWS_0005))
            before = conn.execute(text(ROWS_AS_0005)).scalars().all()
        # 0007: a unique index on the pair beside the old key; old and new enqueues both work.
        migrate(empty_database, "0007")
        with engine.begin() as conn:
            assert conn.execute(text(PK_COLUMNS)).scalar_one() == ["request_id"]
            assert conn.execute(text(OLD_ENQUEUE), {"rid": "old-1"}).rowcount == 1
            assert conn.execute(text(OLD_ENQUEUE), {"rid": "old-1"}).rowcount == 0  # collapsed
            # This release's enqueue also writes the trace context (0013, a nullable column
            # that code of 0007 ignores): added ahead, as 0013 does (IF NOT EXISTS).
            conn.execute(
                text("ALTER TABLE workspace_process_requests ADD COLUMN trace_context text")
            )
        queue = Queue(engine)
        made = queue.enqueue("s", "w", "j1")  # this release's ON CONFLICT (workspace, id)
        assert (made.created, made.request_id) == (True, queue.enqueue("s", "w", "j1").request_id)
        assert not queue.enqueue("s", "w", "j1").created
        # 0008: the key becomes (workspace_id, request_id), taken over from 0007's index.
        migrate(empty_database)
        check(empty_database)
        with engine.connect() as conn:
            assert conn.execute(text(PK_COLUMNS)).scalar_one() == ["workspace_id", "request_id"]
            kept = (
                conn.execute(
                    text(
                        ROWS_AS_0005.replace(
                            "ORDER BY", "WHERE request_id IN ('queued', 'running', 'done') ORDER BY"
                        )
                    )
                )
                .scalars()
                .all()
            )
            assert kept == before  # every row, id and value as it was
            # Why 0007 and 0008 are two revisions: the old arbiter has no index left.
            with pytest.raises(Exception, match="no unique or exclusion constraint"):
                conn.execute(text(OLD_ENQUEUE), {"rid": "old-2"})
        # A wake-up of the release before (the request id alone) still claims and completes;
        # one naming the wrong workspace finds nothing.
        assert queue.claim("queued", "w1", workspace_id="other") is None
        claim = queue.claim("queued", "w1")
        assert claim is not None and claim.request.workspace_id == "w"
        assert queue.complete(ClaimRef("queued", claim.token), {"ok": 1}).status is Status.SUCCEEDED
        # Lookups by id alone read ix_wpr_request_id, not the table.
        with raw_connection(engine) as raw:
            raw.execute("SET enable_seqscan = off")
            by_id = {"request_id": "done", "workspace_id": None}
            plan = json.dumps(
                fetch_all(raw, "EXPLAIN (FORMAT JSON) " + sql.GET.sql_for(by_id), by_id)
            )
        assert "ix_wpr_request_id" in plan
        # And back to 0006: the old key again, every row kept.
        engine.dispose()
        command.downgrade(alembic_config(empty_database), "0006")
        with engine.connect() as conn:
            assert conn.execute(text(PK_COLUMNS)).scalar_one() == ["request_id"]
            assert conn.execute(text(OLD_ENQUEUE), {"rid": "old-3"}).rowcount == 1
    finally:
        engine.dispose()


@pytest.mark.slow
def test_claim_uses_its_partial_index_on_a_big_table(clean_db: Engine) -> None:
    with clean_db.begin() as conn:
        fill(conn, finished=100000)
    rows = claim_plan(clean_db)
    plan = json.dumps(rows)
    assert "ix_wpr_claim" in plan, plan
    assert "ix_wpr_lease" in plan, plan
    assert '"Node Type": "Seq Scan"' not in plan, plan


def test_an_enqueue_reads_no_existing_row_under_a_plan_kept_from_a_small_table(
    empty_database: str,
) -> None:
    """psycopg prepares a statement on its 6th run and Postgres keeps one generic plan for
    it until an ANALYZE: ENQUEUE's probe for rows that already existed must stay a lookup by
    key under a plan made while the table was small, not a join that hashes the whole table
    on every enqueue (it did: 2,008 rows read to enqueue one new row, 3.5 ms at 4,000 rows).
    A new database, its table analyzed while empty (as autovacuum or a VACUUM ANALYZE
    leaves a new or truncated table): that is where the hashing plan was made."""
    from onceflow.models.requests import NewRequest

    migrate(empty_database)
    engine = make_engine(
        empty_database,
        pool_size=1,
        connect_args={"options": "-c plan_cache_mode=force_generic_plan"},
    )
    queue = Queue(engine)
    try:
        with engine.begin() as conn:
            conn.execute(text("ANALYZE workspace_process_requests"))
        for i in range(8):  # prepared, planned on a near-empty table
            queue.enqueue("evaluate", "w1", f"small-{i}", input={"i": i})
        with engine.begin() as conn:  # the table grows; nothing re-plans the statement
            conn.execute(
                text("""
                INSERT INTO workspace_process_requests
                    (request_id, workspace_id, job_id, branch_path, stage, dedupe, input,
                     input_hash, worker_class, max_attempts, max_crash_attempts)
                SELECT 'grown-' || i, 'w1', 'g' || i, '', 'evaluate', true, '{}', 'h',
                       'default', 5, 3
                FROM generate_series(1, 2000) AS i
            """)
            )
        # This backend's counters of rows read from the table (pending, not yet flushed).
        reads = text(
            "SELECT seq_tup_read, coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
            " WHERE relname = 'workspace_process_requests'"
        )
        with engine.begin() as conn:
            before = conn.execute(reads).one()
            results = queue.enqueue_many(
                [NewRequest(workspace_id="w1", job_id="new", stage="evaluate", input={})],
                connection=conn,
            )
            after = conn.execute(reads).one()
        assert [r.created for r in results] == [True]
        assert (after[0] - before[0], after[1] - before[1]) == (0, 0), (before, after)
        # A duplicate still finds its row (and says it was not created).
        again = queue.enqueue("evaluate", "w1", "small-3", input={"i": 3})
        assert not again.created
    finally:
        engine.dispose()
