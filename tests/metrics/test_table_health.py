"""The database collector's table-health gauges, read from a real Postgres's statistics
views: dead row versions, seconds since the last vacuum, and the oldest open transaction
(what stops a vacuum; docs/how-to/operate.md, "Autovacuum and claim_next loops")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import Engine, text

from onceflow.db import make_engine, raw_connection
from onceflow.metrics.collector import DatabaseCollector, _health_families, libpq_url
from onceflow.models.requests import NewRequest
from onceflow.queue import Queue
from onceflow.settings import get_settings
from tests.acceptance.procs import wait_for
from tests.metrics.scrape import Samples, parse, total

AGE = "onceflow_database_oldest_transaction_age_seconds"
DEAD = "onceflow_requests_dead_rows"
VACUUM_AGE = "onceflow_requests_vacuum_age_seconds"

# The table, or its partitions: what autovacuum would vacuum.
_STORAGE = """
SELECT c.oid::regclass::text FROM pg_class c
WHERE c.oid = 'workspace_process_requests'::regclass AND c.relkind = 'r'
   OR c.oid IN (SELECT inhrelid FROM pg_inherits
                WHERE inhparent = 'workspace_process_requests'::regclass)
"""


@pytest.fixture()
def scrape(database_url: str) -> Iterator[CollectorRegistry]:
    """One collector (one connection of its own) for the test's scrapes."""
    reg = CollectorRegistry()
    collector = DatabaseCollector(database_url)
    reg.register(collector)
    yield reg
    collector.close()


def _read(reg: CollectorRegistry) -> Samples:
    return parse(generate_latest(reg).decode())


@pytest.fixture()
def no_autovacuum(clean_db: Engine) -> Iterator[None]:
    """Autovacuum off on the table while the test counts its dead rows (a server that runs it
    every 10 s, as the embedded one does, could clean them between two scrapes)."""
    with clean_db.begin() as conn:
        tables = [str(t) for t in conn.execute(text(_STORAGE)).scalars()]
        for t in tables:
            conn.execute(text(f"ALTER TABLE {t} SET (autovacuum_enabled = off)"))
    try:
        yield
    finally:
        with clean_db.begin() as conn:
            for t in tables:
                conn.execute(text(f"ALTER TABLE {t} RESET (autovacuum_enabled)"))


def test_dead_rows_and_the_last_vacuum_follow_the_table(
    clean_db: Engine, database_url: str, scrape: CollectorRegistry, no_autovacuum: None
) -> None:
    engine = make_engine(database_url, pool_size=1)  # one connection: its statistics flushed
    queue = Queue(engine, settings=get_settings())

    def churn(tag: str, n: int) -> None:
        queue.enqueue_many(
            [NewRequest("w1", f"{tag}{i}", "s", worker_class="th") for i in range(n)]
        )
        for claim in queue.claim_next("th", "w", limit=n):
            queue.finish(claim)  # each claim and completion leaves a dead row version
        with raw_connection(engine) as raw:  # the pool's one connection: report now
            raw.execute("SELECT pg_stat_force_next_flush()")

    try:
        churn("a", 40)
        wait_for(lambda: total(_read(scrape), DEAD) >= 40, what="the dead row versions counted")

        def vacuumed_now() -> Any:
            # Vacuumed again at each look: a transaction of another test's process still
            # open in this database (a snapshot older than the churn) keeps one VACUUM from
            # removing the dead versions; the next one, once it ended, does.
            with raw_connection(clean_db) as raw:
                raw.execute("VACUUM workspace_process_requests")  # autocommit
            s = _read(scrape)
            return total(s, DEAD) == 0 and s

        vacuumed = wait_for(vacuumed_now, what="the vacuum's count")
        assert vacuumed[(VACUUM_AGE, frozenset())] == 0  # nothing to clean: nothing overdue
        churn("b", 10)
        again = wait_for(
            lambda: (s := _read(scrape)) and total(s, DEAD) >= 10 and s, what="new dead rows"
        )
        assert 0 < again[(VACUUM_AGE, frozenset())] < 60  # since the VACUUM above
    finally:
        engine.dispose()


def test_an_open_transaction_is_seen_until_it_ends(
    clean_db: Engine, database_url: str, scrape: CollectorRegistry
) -> None:
    with clean_db.begin() as conn:
        conn.execute(text("SELECT 1"))  # the table exists, the session is idle again
    # REPEATABLE READ keeps its snapshot until the transaction ends (what a report, a
    # pg_dump or a forgotten session does); a READ COMMITTED one idle between statements,
    # having written nothing, holds none, and is rightly not counted.
    idle_rc = psycopg.connect(libpq_url(database_url))
    holder = psycopg.connect(libpq_url(database_url))  # not autocommit: BEGIN at the first
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        idle_rc.execute("SELECT count(*) FROM workspace_process_requests").fetchone()
        holder.execute("SELECT count(*) FROM workspace_process_requests").fetchone()
        seen = wait_for(
            lambda: (a := total(_read(scrape), AGE)) >= 1.0 and a,
            what="the held transaction's age",
        )
        holder.rollback()
        # Only the idle READ COMMITTED transaction is left open: not counted.
        assert total(_read(scrape), AGE) < seen
    finally:
        holder.close()
        idle_rc.close()


def test_shards_merge_summed_and_largest() -> None:
    """Several databases (shards): dead rows summed, the ages the largest; no vacuum age
    while any shard cannot give one."""
    fams = {f.name: f for f in _health_families([
        {"dead_rows": 5.0, "vacuum_age": 30.0, "oldest_xact_age": 2.0},
        {"dead_rows": 7.0, "vacuum_age": 90.0, "oldest_xact_age": 0.0},
    ])}  # fmt: skip
    assert [s.value for s in fams[DEAD].samples] == [12.0]
    assert [s.value for s in fams[VACUUM_AGE].samples] == [90.0]
    assert [s.value for s in fams[AGE].samples] == [2.0]
    partial = {f.name: f for f in _health_families([
        {"dead_rows": 5.0, "vacuum_age": None, "oldest_xact_age": 0.0},
        {"dead_rows": 0.0, "vacuum_age": 0.0, "oldest_xact_age": 0.0},
    ])}  # fmt: skip
    assert partial[VACUUM_AGE].samples == []
