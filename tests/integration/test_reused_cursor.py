"""While onceflow has a connection checked out, its statements share one cursor
(``onceflow.db``).

What must hold: statements of one checkout (pooled or held) share it; a statement that
failed leaves it usable; a large result is never kept with it (a fresh cursor takes its
place at once, held connections included); whoever gets the connection from the pool
after onceflow (a SQLAlchemy connection, a caller's raw checkout that its threads share)
never sees it; the async pool's single statements share one, and statements a caller runs
concurrently inside one async transaction do not. Real Postgres.
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
from onceflow.errors import InvalidRequest
from tests.integration.test_db_blips import own_engine

APP = "onceflow-cursor-test"
BIG = "SELECT g, %(doc)s::jsonb AS doc FROM generate_series(1, %(n)s) g"


@pytest.fixture()
def one_conn(clean_db: Engine) -> Any:
    """An engine of its own with a pool of one: every checkout is the same connection."""
    eng = own_engine(clean_db, APP, pool_size=1)
    yield eng
    eng.dispose()


def kept(raw: Any) -> Any:
    return getattr(raw, db.REUSED_CURSOR, None)


def test_statements_of_one_checkout_share_its_cursor_pooled_and_held(one_conn: Engine) -> None:
    with raw_connection(one_conn) as raw:
        first = kept(raw)
        assert first is not None
        assert fetch_one(raw, "SELECT 1 AS one", {}) == {"one": 1}
        assert db.execute(raw, "SELECT 2", {}) == 1
        assert fetch_all(raw, "SELECT g AS n FROM generate_series(1, 3) g", {}) == [
            {"n": 1}, {"n": 2}, {"n": 3}
        ]  # fmt: skip
        assert kept(raw) is first
    with raw_connection(one_conn) as again:  # the next checkout of onceflow's: the same one
        assert again is raw and kept(again) is first
    with holding_connections():
        for _ in range(3):
            with raw_connection(one_conn) as held:
                assert fetch_one(held, "SELECT 3 AS three", {}) == {"three": 3}
                assert kept(held) is first


def test_a_failed_statement_leaves_the_cursor_usable(one_conn: Engine) -> None:
    with raw_connection(one_conn) as raw:
        cur = kept(raw)
        with pytest.raises(psycopg.errors.DivisionByZero):
            fetch_one(raw, "SELECT 1 / 0 AS x", {})
        assert fetch_one(raw, "SELECT 4 AS four", {}) == {"four": 4}
        assert kept(raw) is cur


@pytest.mark.parametrize(
    ("rows", "doc", "large"),
    [
        (1, {"pad": "x" * 100_000}, False),  # one row: the claim's own, kept
        (db.KEEP_ROWS, None, False),  # many small rows (no JSON column filled): kept
        (2, {"pad": "x"}, True),  # more than one row with a JSON column
        (db.KEEP_ROWS + 1, None, True),  # too many rows
    ],
)
def test_a_large_result_is_never_kept_with_the_cursor(
    one_conn: Engine, rows: int, doc: Any, large: bool
) -> None:
    params = {"n": rows, "doc": None if doc is None else psycopg.types.json.Jsonb(doc)}
    query = BIG if doc is not None else "SELECT g FROM generate_series(1, %(n)s) g"
    with holding_connections(), raw_connection(one_conn) as raw:
        cur = kept(raw)
        assert len(fetch_all(raw, query, params)) == rows
        if large:
            assert cur.closed and cur.pgresult is None  # the result freed now
            assert kept(raw) is not None and not kept(raw).closed  # a fresh one, still held
        else:
            assert kept(raw) is cur
        assert fetch_one(raw, "SELECT 5 AS five", {}) == {"five": 5}
        assert kept(raw) is not None


def test_the_pool_hands_the_connection_on_without_the_cursor(one_conn: Engine) -> None:
    """After onceflow's call the same connection, checked out by the caller and shared by
    its threads through on_connection, runs every statement on cursors of its own."""
    with raw_connection(one_conn) as raw:
        mine = kept(raw)
        assert fetch_one(raw, "SELECT 1 AS one", {}) == {"one": 1}
    with one_conn.connect() as sa:  # a SQLAlchemy connection: the same psycopg connection
        assert sa.connection.driver_connection is raw
        assert kept(raw) is None
        assert sa.exec_driver_sql("SELECT 6").scalar() == 6
    fairy = one_conn.raw_connection()
    try:
        conn = fairy.driver_connection
        assert conn is raw and kept(conn) is None
        conn.autocommit = True
        connector = on_connection(conn)
        query = Query("test.echo", "SELECT pg_sleep(0.001), %(i)s::int AS i")
        errors: list[BaseException] = []
        seen: list[int] = []

        def use(i: int) -> None:
            try:
                for _ in range(50):
                    seen.append(connector.fetch_one(query, {"i": i})["i"])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=use, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(seen) == sorted(i for i in range(4) for _ in range(50))
        assert kept(conn) is None
        conn.autocommit = False
    finally:
        fairy.close()
    with raw_connection(one_conn) as again:  # onceflow's next checkout: its cursor again
        assert kept(again) is mine


def test_the_async_pool_shares_a_cursor_only_between_single_statements(
    clean_db: Engine,
) -> None:
    from onceflow.connector.aio import AsyncPsycopgConnector

    url = clean_db.url.render_as_string(hide_password=False)
    one = Query("test.one", "SELECT %(i)s::int AS i")
    many = Query("test.many", BIG)
    broken = Query("test.broken", "SELECT 1 / 0 AS x")

    async def kept_now(connector: AsyncPsycopgConnector) -> Any:
        async with connector._pools.get().pool.connection() as conn:  # pool of one
            return kept(conn)

    async def go() -> None:
        connector = AsyncPsycopgConnector(url, max_size=1)
        try:
            assert await connector.fetch_one(one, {"i": 1}) == {"i": 1}
            first = await kept_now(connector)
            assert first is not None
            assert await connector.execute(one, {"i": 1}) == 1
            assert await kept_now(connector) is first
            with pytest.raises(InvalidRequest):  # a DataError
                await connector.fetch_one(broken, {})
            assert await connector.fetch_one(one, {"i": 2}) == {"i": 2}
            assert await kept_now(connector) is first
            rows = await connector.fetch_all(many, {"n": 3, "doc": '{"a": 1}'})
            assert len(rows) == 3
            assert first.closed  # its large result freed; the connection got a fresh cursor
            fresh = await kept_now(connector)
            assert fresh is not None and fresh is not first and not fresh.closed
            # Inside a transaction a caller may gather statements: each gets its own cursor.
            async with connector.transaction() as tx:
                answers = await asyncio.gather(
                    tx.fetch_all(many, {"n": 200, "doc": '{"a": 1}'}),
                    *(tx.fetch_one(one, {"i": i}) for i in range(5)),
                )
            assert len(answers[0]) == 200
            assert answers[1:] == [{"i": i} for i in range(5)]
            assert await kept_now(connector) is fresh
        finally:
            await connector.aclose()

    asyncio.run(go())


def test_a_large_result_whose_rows_fail_to_load_is_not_kept_either(one_conn: Engine) -> None:
    query = (
        "SELECT g, %(doc)s::jsonb AS doc,"
        " CASE WHEN g = 2 THEN 'infinity'::date ELSE '2026-12-05'::date END AS d"
        " FROM generate_series(1, 2) g"
    )
    with raw_connection(one_conn) as raw:
        cur = kept(raw)
        with pytest.raises(psycopg.DataError):  # psycopg cannot load an infinite date
            fetch_all(raw, query, {"doc": psycopg.types.json.Jsonb({"pad": "x" * 1000})})
        assert cur.closed and kept(raw) is not None and not kept(raw).closed
        assert fetch_one(raw, "SELECT 7 AS seven", {}) == {"seven": 7}


def test_rows_are_dicts_named_by_their_own_statement_and_follow_a_change_of_columns(
    one_conn: Engine,
) -> None:
    """The reused cursor makes tuple rows and names them with the column names kept per
    statement text: each statement gets its own names, and a text whose result has another
    number of columns (a table's ``*`` after ALTER TABLE) has its names read again."""
    with raw_connection(one_conn) as raw:
        db.execute(raw, "DROP TABLE IF EXISTS cursor_names_t", {})
        db.execute(raw, "CREATE TABLE cursor_names_t (a int)", {})
        db.execute(raw, "INSERT INTO cursor_names_t VALUES (1), (2)", {})
        star = "SELECT * FROM cursor_names_t ORDER BY a"
        try:
            assert fetch_one(raw, star, {}) == {"a": 1}
            assert fetch_one(raw, "SELECT 5 AS b, 6 AS c", {}) == {"b": 5, "c": 6}
            assert fetch_all(raw, star, {}) == [{"a": 1}, {"a": 2}]
            db.execute(raw, "ALTER TABLE cursor_names_t ADD COLUMN z text DEFAULT 'q'", {})
            assert fetch_one(raw, star, {}) == {"a": 1, "z": "q"}
            assert fetch_all(raw, star, {}) == [{"a": 1, "z": "q"}, {"a": 2, "z": "q"}]
            assert fetch_one(raw, "SELECT 1 AS a WHERE false", {}) is None
            assert fetch_all(raw, "SELECT 1 AS a WHERE false", {}) == []
            assert fetch_one(raw, "SELECT 1 AS x, 2 AS x", {}) == {"x": 2}  # as dict_row did
        finally:
            db.execute(raw, "DROP TABLE cursor_names_t", {})
        assert fetch_one(raw, "SELECT 5 AS b, 6 AS c", {}) == {"b": 5, "c": 6}


def test_the_async_pool_names_rows_by_their_statement_too(clean_db: Engine) -> None:
    from onceflow.connector.aio import AsyncPsycopgConnector

    url = clean_db.url.render_as_string(hide_password=False)
    star = Query("test.star", "SELECT * FROM cursor_names_at ORDER BY a")

    async def go() -> None:
        connector = AsyncPsycopgConnector(url, max_size=1)
        try:
            for sql in (
                "DROP TABLE IF EXISTS cursor_names_at",
                "CREATE TABLE cursor_names_at (a int)",
                "INSERT INTO cursor_names_at VALUES (1), (2)",
            ):
                await connector.execute(Query("test.ddl", sql), {})
            assert await connector.fetch_one(star, {}) == {"a": 1}
            await connector.execute(
                Query("test.ddl", "ALTER TABLE cursor_names_at ADD COLUMN z int DEFAULT 7"), {}
            )
            assert await connector.fetch_all(star, {}) == [{"a": 1, "z": 7}, {"a": 2, "z": 7}]
            none = Query("test.none", "SELECT 1 AS a WHERE false")
            assert await connector.fetch_one(none, {}) is None
            assert await connector.fetch_all(none, {}) == []
            await connector.execute(Query("test.ddl", "DROP TABLE cursor_names_at"), {})
        finally:
            await connector.aclose()

    asyncio.run(go())
