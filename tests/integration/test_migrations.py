"""Migrations on an empty database, drift against the models, and the claim's query plan."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text

from onceflow.db import fetch_all, make_engine, raw_connection
from onceflow.migrate import check, migrate
from onceflow.queue import sql
from tests.conftest import libpq


@pytest.fixture()
def empty_database(services: tuple[str, str]) -> Iterator[str]:
    admin = services[0]
    name = f"onceflow_mig_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
            assert version.scalar_one() == "0006"
    finally:
        engine.dispose()


@pytest.mark.slow
def test_claim_uses_its_partial_index_on_a_big_table(clean_db: Engine) -> None:
    with clean_db.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO workspace_process_requests
                (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
                 worker_class, status, max_attempts, max_crash_attempts, finished_at, result)
            SELECT 'done-' || i, 'w' || (i % 50), 'j' || i, '', 'evaluate', true, '{}', 'h',
                   CASE WHEN i % 3 = 0 THEN 'llm' ELSE 'fallback' END, 'succeeded', 5, 3,
                   now(), '{}'
            FROM generate_series(1, 100000) AS i
        """)
        )
        conn.execute(
            text("""
            INSERT INTO workspace_process_requests
                (request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
                 worker_class, max_attempts, max_crash_attempts)
            SELECT 'todo-' || i, 'w' || (i % 50), 'j' || i, '', 'evaluate', true, '{}', 'h',
                   CASE WHEN i % 2 = 0 THEN 'llm' ELSE 'fallback' END, 5, 3
            FROM generate_series(1, 1000) AS i
        """)
        )
        conn.execute(text("ANALYZE workspace_process_requests"))
    params = {
        "worker_class": "llm", "worker_id": "w", "tokens": ["t"] * 10,
        "lease_seconds": 30.0, "max_runtime": None, "now": None,
    }  # fmt: skip
    # The statement exactly as claim_next sends it (psycopg, literal LIMIT).
    with raw_connection(clean_db) as raw:
        rows = fetch_all(raw, "EXPLAIN (FORMAT JSON) " + sql.claim_next_sql(10), params)
    plan = json.dumps(rows)
    assert "ix_wpr_claim" in plan, plan
    assert "ix_wpr_lease" in plan, plan
    assert '"Node Type": "Seq Scan"' not in plan, plan
