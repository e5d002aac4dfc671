"""Hash partitioning by workspace (``ONCEFLOW_PARTITIONS``): a new database's layout, the
refusal to convert an existing one, the claim's plan over the partitions, and where rows land.

The queue and op-log suites themselves run on this layout with ``ONCEFLOW_TEST_PARTITIONS=8``
(tests/conftest.py; .ci/run runs them so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, Engine, text

from onceflow import InvalidRequest, PartitionLayoutMismatch, Queue
from onceflow.cache import CacheKey, ResultCache
from onceflow.db import make_engine
from onceflow.metrics import sql as metrics_sql
from onceflow.migrate import alembic_config, check, migrate
from onceflow.migrations.partitioning import WORKSPACE_TABLES
from onceflow.oplog import OpLog
from onceflow.settings import get_settings
from onceflow.spend import Grant, LedgerHooks, Usage, set_budget
from tests.integration.big_table import claim_plan, fill

N = 8


@pytest.fixture()
def partitioned(empty_database: str) -> Iterator[Engine]:
    """A new database migrated with ``partitions=8``: an engine on it."""
    migrate(empty_database, partitions=N)
    engine = make_engine(empty_database, pool_size=2)
    try:
        yield engine
    finally:
        engine.dispose()


def schema(url: str) -> list[tuple[Any, ...]]:
    """Every relation of the database (name, kind, partition or not, options) and the
    migration version: what a refused migrate must leave as it was."""
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            rels = conn.execute(
                text(
                    "SELECT relname, relkind, relispartition, reloptions FROM pg_class "
                    "WHERE relnamespace = 'public'::regnamespace ORDER BY relname"
                )
            ).all()
            version = conn.execute(
                text(
                    "SELECT version_num FROM onceflow_alembic_version "
                    "WHERE to_regclass('onceflow_alembic_version') IS NOT NULL"
                )
                if rels
                else text("SELECT NULL")
            ).all()
        return [tuple(r) for r in rels] + [tuple(r) for r in version]
    finally:
        engine.dispose()


def layout(conn: Connection) -> dict[str, tuple[str, list[str], int]]:
    """table → (strategy, partition key columns, partition count) per partitioned table."""
    rows = conn.execute(
        text("""
        SELECT c.relname, p.partstrat,
               ARRAY(SELECT a.attname FROM unnest(p.partattrs::int2[]) AS k(n)
                     JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.n),
               (SELECT count(*) FROM pg_inherits i WHERE i.inhparent = c.oid)
        FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid
        WHERE c.relnamespace = 'public'::regnamespace
    """)
    )
    return {name: (strat, list(cols), int(n)) for name, strat, cols, n in rows}


def primary_key(conn: Connection, table: str) -> list[str]:
    return list(
        conn.execute(
            text("""
            SELECT a.attname FROM pg_constraint c
            JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord) ON true
            JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
            WHERE c.conrelid = to_regclass(:t) AND c.contype = 'p' ORDER BY k.ord
        """),
            {"t": table},
        ).scalars()
    )


def test_a_new_database_migrated_with_8_partitions(empty_database: str) -> None:
    migrate(empty_database, partitions=N)
    check(empty_database)  # `alembic check`: the models and the parents agree
    before = schema(empty_database)
    migrate(empty_database, partitions=N)  # again: nothing to do
    migrate(empty_database)  # unset: follows the database's layout
    assert schema(empty_database) == before
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.connect() as conn:
            assert layout(conn) == {t: ("h", ["workspace_id"], N) for t in WORKSPACE_TABLES}
            bounds = conn.execute(
                text("""
                SELECT p.relname, pg_get_expr(p.relpartbound, p.oid)
                FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
                WHERE i.inhparent = 'workspace_process_requests'::regclass
            """)
            ).all()
            assert sorted(bounds) == sorted(
                (
                    f"workspace_process_requests_p{i}",
                    f"FOR VALUES WITH (modulus {N}, remainder {i})",
                )
                for i in range(N)
            )
            assert primary_key(conn, "workspace_process_requests") == ["workspace_id", "request_id"]
            # The sweeps and the version table stay plain tables.
            kinds = dict(
                conn.execute(
                    text(
                        "SELECT relname, relkind FROM pg_class WHERE relname IN "
                        "('onceflow_sweeps', 'onceflow_alembic_version')"
                    )
                ).all()
            )
            assert kinds == {"onceflow_sweeps": "r", "onceflow_alembic_version": "r"}
            # Every index of the requests table is a partitioned index on the parent, valid.
            indexes = dict(
                conn.execute(
                    text("""
                    SELECT c.relname, c.relkind::text || ':' || i.indisvalid::text FROM pg_index i
                    JOIN pg_class c ON c.oid = i.indexrelid
                    WHERE i.indrelid = 'workspace_process_requests'::regclass
                """)
                ).all()
            )
            assert indexes == {
                name: "I:true"
                for name in (
                    "pk_workspace_process_requests", "ix_wpr_claim", "ix_wpr_lease",
                    "ix_wpr_dead", "ix_wpr_request_id", "ix_wpr_workspace", "ix_wpr_finished",
                    "ix_wpr_created", "ix_wpr_job",
                )
            }  # fmt: skip
            # The eager autovacuum settings sit on each partition (a parent takes none).
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = :p"),
                {"p": "workspace_process_requests_p3"},
            ).scalar_one()
            assert "autovacuum_vacuum_scale_factor=0.01" in options
            version = conn.execute(text("SELECT version_num FROM onceflow_alembic_version"))
            assert version.scalar_one() == "0015"
    finally:
        engine.dispose()
    # Every downgrade works on the partitioned layout too, and the way up again.
    command.downgrade(alembic_config(empty_database), "base")
    left = {r[0] for r in schema(empty_database) if len(r) > 1}
    assert left == {"onceflow_alembic_version", "onceflow_alembic_version_pkc"}
    migrate(empty_database, partitions=N)
    check(empty_database)
    assert schema(empty_database) == before


def test_partitions_asked_for_on_existing_tables_are_refused_and_change_nothing(
    empty_database: str,
) -> None:
    migrate(empty_database, revision="0002")  # plain: requests and compute locks exist
    before = schema(empty_database)
    with pytest.raises(PartitionLayoutMismatch) as refused:
        migrate(empty_database, partitions=N)
    message = str(refused.value)
    assert "partitions=8" in message and "not partitioned" in message, message
    assert "docs/sharding.md 5.2" in message, message
    assert refused.value.found == {"workspace_process_requests": 0, "compute_locks": 0}
    assert schema(empty_database) == before
    migrate(empty_database)  # unset: the rest is created plain, as the tables that exist
    with pytest.raises(PartitionLayoutMismatch):
        migrate(empty_database, partitions=N)
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.connect() as conn:
            assert layout(conn) == {}
    finally:
        engine.dispose()


def test_another_partition_count_is_refused_and_a_bad_count_too(empty_database: str) -> None:
    for bad in (0, 1, 257):
        with pytest.raises(InvalidRequest, match=r"partitions must be 2\.\.256"):
            migrate(empty_database, partitions=bad)
    assert schema(empty_database) == [(None,)]  # nothing created
    migrate(empty_database, partitions=N)
    before = schema(empty_database)
    with pytest.raises(PartitionLayoutMismatch, match="in 8 hash partitions"):
        migrate(empty_database, partitions=4)
    assert schema(empty_database) == before


def test_onceflow_migrate_honours_onceflow_partitions(empty_database: str) -> None:
    def cli(partitions: str) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "ONCEFLOW_DATABASE_URL": empty_database,
            "ONCEFLOW_PARTITIONS": partitions,
        }
        return subprocess.run(
            [sys.executable, "-m", "onceflow.cli", "migrate"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip

    done = cli("4")
    assert done.returncode == 0, done.stderr
    engine = make_engine(empty_database, pool_size=1)
    try:
        with engine.connect() as conn:
            assert {n for _s, _c, n in layout(conn).values()} == {4}
            assert set(layout(conn)) == set(WORKSPACE_TABLES)
    finally:
        engine.dispose()
    assert cli("4").returncode == 0  # idempotent
    before = schema(empty_database)
    refused = cli("16")
    assert refused.returncode != 0
    assert "PartitionLayoutMismatch" in refused.stderr and "5.2" in refused.stderr, refused.stderr
    assert schema(empty_database) == before


def _nodes(plan: Any) -> Iterator[dict[str, Any]]:
    if isinstance(plan, dict):
        if "Node Type" in plan:
            yield plan
        for value in plan.values():
            yield from _nodes(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from _nodes(value)


@pytest.mark.slow
def test_claim_over_many_workspaces_merges_the_partitions_partial_indexes(
    partitioned: Engine,
) -> None:
    with partitioned.begin() as conn:
        fill(conn, finished=40000, priorities=7)
        # Each partition's index → the parent index it is attached to.
        parent_of = dict(
            conn.execute(
                text("""
                SELECT c.relname, p.relname FROM pg_inherits i
                JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
                WHERE p.relname IN ('ix_wpr_claim', 'ix_wpr_lease')
            """)
            ).all()
        )
    rows = claim_plan(partitioned)
    plan = json.dumps(rows)
    nodes = list(_nodes(rows[0]["QUERY PLAN"]))
    types = {n["Node Type"] for n in nodes}
    assert "Seq Scan" not in types, plan
    assert types & {"Merge Append", "Append"}, plan
    used = {parent_of[n["Index Name"]] for n in nodes if n.get("Index Name") in parent_of}
    assert used == {"ix_wpr_claim", "ix_wpr_lease"}, plan
    claim_scans = {
        n["Relation Name"]
        for n in nodes
        if parent_of.get(n.get("Index Name", "")) == "ix_wpr_claim"
    }
    assert claim_scans == {f"workspace_process_requests_p{i}" for i in range(N)}, plan
    # And the claim itself: the best 10 of the class, across workspaces and partitions.
    claims = Queue(partitioned, settings=get_settings()).claim_next("llm", "worker-1", 10)
    assert len(claims) == 10
    assert {c.request.priority for c in claims} == {6}  # ~70 queued rows have the top one
    with partitioned.connect() as conn:
        held = conn.execute(
            text("""
            SELECT count(DISTINCT workspace_id), count(DISTINCT tableoid)
            FROM workspace_process_requests WHERE status = 'running'
        """)
        ).one()
    assert held[0] == len({c.request.workspace_id for c in claims}) > 1
    assert held[1] > 1  # from more than one partition


def test_rows_land_in_their_workspaces_partition_the_same_in_every_table(
    partitioned: Engine, redis_url: str
) -> None:
    workspaces = [f"ws-{i}" for i in range(40)]
    queue = Queue(partitioned, settings=get_settings())
    oplog = OpLog(partitioned, get_settings())
    for ws in workspaces:
        queued = queue.enqueue("evaluate", ws, "job-1", input={"ws": ws})
        queue.cancel(queued.request_id, workspace_id=ws)  # a row of its history
        oplog.apply_op(ws, "cells", {"type": "cell.set", "column": "a", "value": 1})
        # spend: a budget, a call in flight (a reservation), a settled call (a ledger row)
        set_budget(ws, "day", limit_tokens=1000, database=partitioned)
        hooks = LedgerHooks(partitioned)
        hooks.admit(Grant(workspace_id=ws, provider="llm", estimate_tokens=10))
        settled = Grant(workspace_id=ws, provider="llm", estimate_tokens=10)
        hooks.settle(settled, Usage(1, 1), "ok", "llm", None, None, None, None)
        # the result cache: a workspace-scope entry
        ResultCache(partitioned).put(ws, CacheKey("workspace", "prompt", 60), '"answer"')
    with partitioned.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO compute_locks (workspace_id, job_id, task, token, expires_at) "
                "SELECT ws, 'job-1', 'fit', 't', now() + interval '1 minute' "
                "FROM unnest(CAST(:ws AS text[])) ws"
            ),
            {"ws": workspaces},
        )
    where: dict[str, dict[str, set[int]]] = {}
    with partitioned.connect() as conn:
        for table in WORKSPACE_TABLES:
            rows = conn.execute(
                text(f"SELECT workspace_id, tableoid::regclass::text FROM {table}")  # noqa: S608
            ).all()
            assert {ws for ws, _ in rows} == set(workspaces), table
            for ws, part in rows:
                assert part.startswith(f"{table}_p"), part
                where.setdefault(ws, {}).setdefault(table, set()).add(int(part.rsplit("p", 1)[1]))
        for ws, tables in where.items():
            # One partition per workspace, the same remainder in every table (co-located),
            # and the one Postgres's own hash assigns.
            assert len({frozenset(parts) for parts in tables.values()}) == 1, (ws, tables)
            (remainder,) = tables["workspace_process_requests"]
            assert conn.execute(
                text(
                    "SELECT satisfies_hash_partition("
                    "'workspace_process_requests'::regclass, :n, :r, CAST(:ws AS text))"
                ),
                {"n": N, "r": remainder, "ws": ws},
            ).scalar_one()
        used = {next(iter(t["workspace_process_requests"])) for t in where.values()}
        assert used == set(range(N))  # 40 workspaces spread over all 8 partitions

        # The estimated rows: the partitions' own statistics, summed; the parent has none.
        for i in range(N):
            conn.execute(text(f"ANALYZE workspace_process_requests_p{i}"))
        parent = conn.execute(
            text("SELECT reltuples FROM pg_class WHERE relname = 'workspace_process_requests'")
        ).scalar_one()
        assert parent == -1
        estimate = conn.execute(metrics_sql.ESTIMATED_ROWS.clause).scalar_one()
        assert estimate == len(workspaces)


def test_a_request_ending_in_a_partition_wakes_its_waiter(partitioned: Engine) -> None:
    """The trigger that sends ``onceflow_done`` sits on the parent, so on every partition."""
    import psycopg

    from tests.conftest import libpq

    queue = Queue(partitioned, settings=get_settings())
    made = [queue.enqueue("s", f"ws-{i}", "j") for i in range(N)]  # over the partitions
    url = libpq(partitioned.url.render_as_string(hide_password=False))
    with psycopg.connect(url, autocommit=True) as listen:
        listen.execute("UPDATE workspace_process_requests SET waited = true")  # as waits do
        listen.execute("LISTEN onceflow_done")
        for r in made:
            claim = queue.claim(r.request_id, "w", workspace_id=r.workspace_id)
            assert claim is not None
            queue.complete(claim, None)
        seen = [n.payload for n in listen.notifies(timeout=10, stop_after=N)]
    assert sorted(seen) == sorted(r.request_id for r in made)
    assert len({r.workspace_id for r in made}) == N
    assert queue.wait(made[0].request_id, timeout=5).status.value == "succeeded"
