"""A connection of onceflow's pool keeps one dict-row cursor (``onceflow.db``, issue 13).

What must hold: statements on one checkout (pooled or held) share it; a statement that
failed leaves it usable; a large result is not kept with the idle connection; a
connection a caller hands in never gets one (its threads may share the connection,
which psycopg allows, and a cursor, which it does not). Real Postgres.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from onceflow import db
from onceflow.connector import on_connection
from onceflow.connector.steps import Query
from onceflow.db import fetch_all, fetch_one, holding_connections, raw_connection
from tests.integration.test_db_blips import own_engine

APP = "onceflow-cursor-test"


@pytest.fixture()
def own(clean_db: Engine) -> Any:
    eng = own_engine(clean_db, APP, pool_size=1)
    yield eng
    eng.dispose()


def kept(raw: psycopg.Connection[Any]) -> Any:
    return getattr(raw, db._CURSOR, None)


def test_statements_of_one_connection_share_its_cursor_pooled_and_held(own: Engine) -> None:
    with raw_connection(own) as raw:
        first = kept(raw)
        assert fetch_one(raw, "SELECT 1 AS one", {}) == {"one": 1}
        assert db.execute(raw, "SELECT 2", {}) == 1
        assert fetch_all(raw, "SELECT g AS n FROM generate_series(1, 3) g", {}) == [
            {"n": 1}, {"n": 2}, {"n": 3}
        ]  # fmt: skip
        assert kept(raw) is first is not None
    with raw_connection(own) as again:  # pool of one: the same connection, the same cursor
        assert again is raw and kept(again) is first
    with holding_connections():
        for _ in range(3):
            with raw_connection(own) as held:
                assert fetch_one(held, "SELECT 3 AS three", {}) == {"three": 3}
                assert kept(held) is first


def test_a_failed_statement_leaves_the_cursor_usable(own: Engine) -> None:
    with raw_connection(own) as raw:
        cur = kept(raw)
        with pytest.raises(psycopg.errors.DivisionByZero):
            fetch_one(raw, "SELECT 1 / 0 AS x", {})
        assert fetch_one(raw, "SELECT 4 AS four", {}) == {"four": 4}
        assert kept(raw) is cur


def test_a_large_result_is_not_kept_with_the_idle_connection(own: Engine) -> None:
    many = db.KEEP_ROWS + 1
    with raw_connection(own) as raw:
        cur = kept(raw)
        rows = fetch_all(raw, "SELECT g FROM generate_series(1, %(n)s) g", {"n": many})
        assert len(rows) == many
        assert cur.closed and kept(raw) is None  # its result freed now
        assert fetch_one(raw, "SELECT 5 AS five", {}) == {"five": 5}  # a cursor of its own
        assert kept(raw) is None
    with raw_connection(own) as again:  # the next checkout gets a fresh one
        assert kept(again) is not None and kept(again) is not cur
        assert db.execute(again, "SELECT g FROM generate_series(1, %(n)s) g", {"n": many}) == many
        assert kept(again) is None


def test_a_callers_connection_gets_no_cursor_and_may_be_shared_by_threads(
    clean_db: Engine,
) -> None:
    url = clean_db.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        connector = on_connection(conn)
        query = Query("test.sleep_then", "SELECT pg_sleep(0.01), %(i)s AS i")
        errors: list[BaseException] = []
        seen: list[int] = []

        def use(i: int) -> None:
            try:
                for _ in range(20):
                    seen.append(connector.fetch_one(query, {"i": i})["i"])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=use, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(seen) == sorted(i for i in range(4) for _ in range(20))
        assert kept(conn) is None
