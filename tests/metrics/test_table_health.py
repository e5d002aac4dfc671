"""The database collector's table-health gauges, read from a real Postgres's statistics
views: dead row versions, seconds since the last vacuum, and the oldest open transaction
(what stops a vacuum; README, "Autovacuum and claim_next loops")."""

from __future__ import annotations

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import Engine, text

from onceflow.db import raw_connection
from onceflow.metrics.collector import DatabaseCollector, libpq_url
from onceflow.models.requests import NewRequest
from onceflow.queue import Queue
from onceflow.settings import get_settings
from tests.acceptance.procs import wait_for
from tests.metrics.scrape import Samples, parse, total

AGE = "onceflow_database_oldest_transaction_age_seconds"


def _scrape(database_url: str) -> Samples:
    reg = CollectorRegistry()
    reg.register(DatabaseCollector(database_url))
    return parse(generate_latest(reg).decode())


def test_dead_rows_and_the_last_vacuum_follow_the_table(
    clean_db: Engine, database_url: str
) -> None:
    queue = Queue(clean_db, settings=get_settings())
    queue.enqueue_many([NewRequest("w1", f"j{i}", "s", worker_class="th") for i in range(40)])
    for claim in queue.claim_next("th", "w", limit=40):
        queue.finish(claim)  # each claim and completion leaves a dead row version
    # The statistics reach the views within a second or so of each transaction's end.
    wait_for(
        lambda: total(_scrape(database_url), "onceflow_requests_dead_rows") >= 40,
        what="the dead row versions counted",
    )
    with raw_connection(clean_db) as raw:
        raw.execute("VACUUM workspace_process_requests")  # autocommit
    after = wait_for(
        lambda: (s := _scrape(database_url)) and total(s, "onceflow_requests_dead_rows") < 40 and s,
        what="the vacuum's count",
    )
    age = after[("onceflow_requests_vacuum_age_seconds", frozenset())]
    assert 0 <= age < 60, age


def test_an_open_transaction_is_seen_until_it_ends(clean_db: Engine, database_url: str) -> None:
    with clean_db.begin() as conn:
        conn.execute(text("SELECT 1"))  # the table exists, the session is idle again
    # REPEATABLE READ keeps its snapshot until the transaction ends (what a report, a
    # pg_dump or a forgotten session does); a READ COMMITTED one idle between statements
    # holds none, and is rightly not counted.
    holder = psycopg.connect(libpq_url(database_url))  # not autocommit: BEGIN at the first
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        holder.execute("SELECT count(*) FROM workspace_process_requests").fetchone()
        seen = wait_for(
            lambda: (a := total(_scrape(database_url), AGE)) >= 1.0 and a,
            what="the held transaction's age",
        )
        assert seen >= 1.0
    finally:
        holder.rollback()
        holder.close()
    ended = total(_scrape(database_url), AGE)
    assert ended < seen, (ended, seen)
