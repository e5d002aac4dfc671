"""The connector seam (onceflow.connector): one operation body, run by every connector.

The layer tests run on both APIs through the ``api_queue`` fixture; these cover what
only the seam does: the caller's-transaction connectors, savepoints, after-commit
callbacks, the async pool through a lost connection, and the refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from onceflow import AsyncQueue, InputMismatch, NewRequest, Queue
from onceflow.connector import (
    AfterCommit,
    AsyncPsycopgConnector,
    FetchOne,
    PsycopgConnector,
    Query,
    SQLAlchemyConnector,
    Steps,
    Transaction,
    arun,
    run,
)
from onceflow.errors import ConnectionLost, DatabaseUnavailable
from tests.conftest import libpq, table_snapshot
from tests.integration.test_db_blips import kill_backends

ASYNC_APP = "onceflow-async-blip"


@pytest.fixture()
def admin_url(services: tuple[str, str]) -> str:
    return services[0]


def test_strict_mismatch_on_the_callers_connection_rolls_back_only_the_batch(
    queue: Queue, clean_db: Engine
) -> None:
    """strict=True on a caller's connection writes the batch under a savepoint: the mismatch
    discards the batch, and the caller's own transaction goes on and commits."""
    queue.enqueue("evaluate", "w1", "j1", "main", {"x": 1})
    with clean_db.begin() as conn:
        queue.enqueue_many([NewRequest("w1", "mine", "evaluate")], connection=conn)
        with pytest.raises(InputMismatch):
            queue.enqueue_many(
                [
                    NewRequest("w1", "batch-new", "evaluate"),
                    NewRequest("w1", "j1", "evaluate", "main", {"x": 2}),
                ],
                strict=True,
                connection=conn,
            )
        queue.enqueue_many([NewRequest("w1", "after", "evaluate")], connection=conn)
    jobs = {r.job_id for r in queue.list(workspace_id="w1")}
    assert jobs == {"j1", "mine", "after"}  # the strict batch left nothing, the rest committed


def test_after_commit_runs_on_commit_only(clean_db: Engine) -> None:
    seen: list[str] = []
    one = Query("test.one", "SELECT 1 AS one")

    def steps(tag: str) -> Steps[Any]:
        row = yield FetchOne(one, {})
        yield AfterCommit(lambda: seen.append(tag))
        return row

    with clean_db.connect() as conn:
        run(SQLAlchemyConnector(conn), steps("rolled-back"))
        conn.rollback()
        run(SQLAlchemyConnector(conn), steps("committed"))
        assert seen == []  # not yet: the caller has not committed
        conn.commit()
    assert seen == ["committed"]


def test_a_failed_transaction_step_rolls_back_and_throws_into_the_operation(
    queue: Queue, clean_db: Engine
) -> None:
    insert = Query(
        "test.insert_bad",
        "UPDATE workspace_process_requests SET priority = 7 WHERE job_id = %(job)s RETURNING 1",
    )

    def body() -> Steps[None]:
        yield FetchOne(insert, {"job": "j1"})
        raise RuntimeError("after the write")

    def outer() -> Steps[str]:
        try:
            yield Transaction(body())
        except RuntimeError as exc:
            return f"caught: {exc}"
        return "not caught"

    queue.enqueue("evaluate", "w1", "j1")
    before = table_snapshot(clean_db)
    assert run(queue.connector, outer()) == "caught: after the write"
    assert table_snapshot(clean_db) == before  # the update was rolled back


def test_async_queue_refuses_a_sync_connection(clean_db: Engine) -> None:
    url = clean_db.url.render_as_string(hide_password=False)

    async def go() -> None:
        aq = AsyncQueue(url)
        try:
            with clean_db.connect() as conn, pytest.raises(TypeError, match="async connector"):
                await aq.enqueue_many([NewRequest("w1", "j1", "s")], connection=conn)
        finally:
            await aq.aclose()

    asyncio.run(go())
    assert table_snapshot(clean_db) == []


def test_async_pool_through_killed_backends(clean_db: Engine, admin_url: str) -> None:
    """Every pooled async connection killed: a read is retried once on a fresh connection and
    answers; the pool then serves live connections only."""
    url = clean_db.url.set(query={"application_name": ASYNC_APP}).render_as_string(
        hide_password=False
    )

    async def go() -> list[str]:
        aq = AsyncQueue(url, connector=AsyncPsycopgConnector(url, max_size=3))
        try:
            first = await aq.enqueue("evaluate", "w1", "j1")
            await asyncio.gather(*(aq.get(first.request_id) for _ in range(3)))  # fill the pool
            assert await asyncio.to_thread(
                kill_backends, admin_url, "application_name = %s", ASYNC_APP
            )
            got = await aq.get(first.request_id)  # one retry, on a fresh connection
            again = await asyncio.gather(*(aq.get(first.request_id) for _ in range(3)))
            return [got.job_id, *(r.job_id for r in again)]
        finally:
            await aq.aclose()

    assert asyncio.run(go()) == ["j1"] * 4


def test_a_lost_connection_in_a_non_retried_write_is_connection_lost(
    clean_db: Engine, admin_url: str
) -> None:
    url = clean_db.url.set(query={"application_name": ASYNC_APP}).render_as_string(
        hide_password=False
    )
    probe = Query("test.probe", "SELECT 1 AS one")

    async def go() -> None:
        connector = AsyncPsycopgConnector(url, max_size=1)
        try:
            assert await connector.fetch_one(probe, {}) == {"one": 1}
            await asyncio.to_thread(kill_backends, admin_url, "application_name = %s", ASYNC_APP)
            with pytest.raises(ConnectionLost):
                await connector.fetch_one(probe, {})
            assert await connector.fetch_one(probe, {}) == {"one": 1}  # the pool recovered
        finally:
            await connector.aclose()

    asyncio.run(go())


def test_counts_of_one_workspace_on_both_apis(api_queue: Queue) -> None:
    api_queue.enqueue("evaluate", "w1", "j1")
    api_queue.enqueue("evaluate", "w1", "j2", worker_class="llm")
    api_queue.enqueue("evaluate", "w2", "j3")
    assert api_queue.counts(workspace_id="w1")["default"]["queued"] == 1
    assert api_queue.counts(workspace_id="w1")["llm"]["queued"] == 1
    assert api_queue.counts()["default"]["queued"] == 2
    assert api_queue.counts(workspace_id="nobody") == {}


def test_list_filters_on_both_apis(api_queue: Queue) -> None:
    api_queue.enqueue("evaluate", "w1", "j1")
    api_queue.enqueue("score", "w1", "j1", worker_class="llm")
    api_queue.enqueue("evaluate", "w2", "j2")
    assert {r.stage for r in api_queue.list(workspace_id="w1")} == {"evaluate", "score"}
    assert [r.stage for r in api_queue.list(workspace_id="w1", worker_class="llm")] == ["score"]
    assert len(api_queue.list(status=["queued", "running"], stage="evaluate")) == 2
    assert api_queue.list(job_id="j1", status="succeeded") == []
    assert len(api_queue.list(limit=1)) == 1


def test_an_override_calling_super_stays_the_override(clean_db: Engine) -> None:
    """``operation`` caches a bound method per instance, but never over a subclass's own
    method: an override that calls ``super()`` keeps running on every call."""
    calls: list[str] = []

    class Counting(Queue):
        def get(self, request_id: str) -> Any:  # type: ignore[override]
            calls.append(request_id)
            return super().get(request_id)

    q = Counting(clean_db)
    rid = q.enqueue("evaluate", "w1", "j1").request_id
    for _ in range(3):
        assert q.get(rid).request_id == rid
    assert calls == [rid] * 3


def _savepoint_rolled_back(seen: list[str]) -> Steps[None]:
    one = Query("test.one", "SELECT 1 AS one")

    def inner() -> Steps[None]:
        yield AfterCommit(lambda: seen.append("inner"))
        yield FetchOne(one, {})
        raise ValueError("the savepoint fails")

    def kept() -> Steps[None]:
        yield AfterCommit(lambda: seen.append("kept"))

    def outer() -> Steps[None]:
        with contextlib.suppress(ValueError):
            yield Transaction(inner())
        yield Transaction(kept())
        yield AfterCommit(lambda: seen.append("outer"))

    yield Transaction(outer())


def test_after_commit_of_a_rolled_back_savepoint_is_dropped(clean_db: Engine) -> None:
    """A savepoint rolled back takes its after-commit callbacks with it; a released one's
    run with the outer commit (pooled connector, and the caller's SQLAlchemy connection)."""
    seen: list[str] = []
    run(PsycopgConnector(clean_db), _savepoint_rolled_back(seen))
    assert seen == ["kept", "outer"]
    seen.clear()
    with clean_db.connect() as conn:
        run(SQLAlchemyConnector(conn), _savepoint_rolled_back(seen))
        assert seen == []
        conn.commit()
    assert seen == ["kept", "outer"]
    seen.clear()
    url = clean_db.url.render_as_string(hide_password=False)

    async def on_async_pool() -> None:
        connector = AsyncPsycopgConnector(url)
        try:
            await arun(connector, _savepoint_rolled_back(seen))
        finally:
            await connector.aclose()

    asyncio.run(on_async_pool())
    assert seen == ["kept", "outer"]


def _backends(admin_url: str, app: str) -> int:
    with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
        ).fetchone()
    return int(row[0]) if row else 0


def test_asyncio_run_per_call_keeps_one_pool_at_most(clean_db: Engine, admin_url: str) -> None:
    """``asyncio.run`` per call (a Celery task, a script): a closed loop's pool goes, and its
    connections with it (a loop-keyed weak table kept every pool: the pool holds its loop)."""
    app = "onceflow-async-loops"
    url = clean_db.url.set(query={"application_name": app}).render_as_string(hide_password=False)
    probe = Query("test.probe", "SELECT 1 AS one")
    connector = AsyncPsycopgConnector(url)
    for _ in range(4):
        assert asyncio.run(connector.fetch_one(probe, {})) == {"one": 1}
    gc.collect()
    assert len(connector._pools) <= 1, f"{len(connector._pools)} pools kept"
    deadline = time.monotonic() + 10  # a closed socket's backend exits a moment later
    while (kept := _backends(admin_url, app)) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kept <= 1, f"{kept} backends kept open"
    asyncio.run(connector.aclose())  # on a new loop: drops the closed loop's pool too
    assert len(connector._pools) == 0


def test_a_refused_connection_says_so_at_once() -> None:
    """Nothing listens: the async connector raises DatabaseUnavailable naming the cause
    (as the sync side does), not the pool's "couldn't get a connection" after its timeout."""
    probe = Query("test.probe", "SELECT 1 AS one")

    async def go() -> None:
        connector = AsyncPsycopgConnector(f"postgresql://root@127.0.0.1:{_closed_port()}/x")
        try:
            with pytest.raises(DatabaseUnavailable, match="refused"):
                await connector.fetch_one(probe, {})
            with pytest.raises(DatabaseUnavailable, match="refused"):  # and again, pool warm
                await connector.fetch_one(probe, {})
        finally:
            await connector.aclose()

    asyncio.run(go())


def test_a_silent_server_still_gets_the_pool_timeout() -> None:
    """A server that accepts the TCP connection and never answers is slow, not refusing:
    the caller waits the pool's timeout and is told so."""
    probe = Query("test.probe", "SELECT 1 AS one")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]

        async def go() -> None:
            connector = AsyncPsycopgConnector(f"postgresql://root@127.0.0.1:{port}/x", timeout=1)
            try:
                with pytest.raises(DatabaseUnavailable, match="couldn't get a connection"):
                    await connector.fetch_one(probe, {})
            finally:
                silent.close()  # the pool's pending attempt fails now: closing needs no wait
                await connector.aclose()

        asyncio.run(go())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # bound, never listening: a connect is refused
