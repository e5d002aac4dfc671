"""A connection of onceflow's pool keeps one dict-row cursor (``onceflow.db``, issue 13).

What must hold: statements on one checkout (pooled or held) share it; a statement that
failed leaves it usable; a large result is not kept with the idle connection; a
connection a caller hands in never gets one (its threads may share the connection,
which psycopg allows, and a cursor, which it does not). Real Postgres.
"""

from __future__ import annotations

import asyncio
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
    return getattr(raw, db.REUSED_CURSOR, None)


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


def test_the_async_pool_keeps_one_cursor_per_connection_too(clean_db: Engine) -> None:
    from onceflow.connector.aio import AsyncPsycopgConnector
    from onceflow.errors import InvalidRequest

    url = clean_db.url.render_as_string(hide_password=False)
    one = Query("test.one", "SELECT 1 AS one")
    many = Query("test.many", "SELECT g FROM generate_series(1, %(n)s) g")
    broken = Query("test.broken", "SELECT 1 / 0 AS x")

    async def kept_now(connector: AsyncPsycopgConnector) -> Any:
        async with connector._pools.get().pool.connection() as conn:  # pool of one
            return kept(conn)

    async def go() -> None:
        connector = AsyncPsycopgConnector(url, max_size=1)
        try:
            assert await connector.fetch_one(one, {}) == {"one": 1}
            first = await kept_now(connector)
            assert first is not None
            assert await connector.execute(one, {}) == 1
            async with connector.transaction() as tx:
                assert await tx.fetch_all(one, {}) == [{"one": 1}]
            assert await kept_now(connector) is first
            with pytest.raises(InvalidRequest):  # a DataError
                await connector.fetch_one(broken, {})
            assert await connector.fetch_one(one, {}) == {"one": 1}
            assert await kept_now(connector) is first
            rows = await connector.fetch_all(many, {"n": db.KEEP_ROWS + 1})
            assert len(rows) == db.KEEP_ROWS + 1
            assert first.closed  # its large result freed; the connection got a fresh cursor
            fresh = await kept_now(connector)
            assert fresh is not None and fresh is not first and not fresh.closed
            assert await connector.fetch_one(one, {}) == {"one": 1}
        finally:
            await connector.aclose()

    asyncio.run(go())
