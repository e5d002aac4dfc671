"""The request routes are ``async def`` on the AsyncQueue: one waiting on the database holds
no thread of the server's pool, so it cannot starve the other routes.

The app runs in this test's event loop (httpx's ASGI transport, the app's own lifespan)
with anyio's default thread limiter cut to one token: with sync routes, the one request
stuck on a row lock held the only thread and every other route waited behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import anyio.to_thread
import httpx
import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import Connection, Engine

from onceflow.connector import conninfo
from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
from onceflow.settings import get_settings
from onceflow.tasks import Flow, StageContext

KEY = "of_test_event_loop_key_0123456789abcdef"
PULL = "t-loop-pull"  # a pull-worker class: no Celery wake-up to send
# How long the other route may take before the test gives up: a deadline for a condition
# (it answers while the enqueue waits), not a speed requirement.
DEADLINE = 20.0


class In(BaseModel):
    value: int = 0


@pytest.fixture()
def flow(clean_db: Engine) -> Flow:
    flow = Flow(settings=get_settings(), pull_worker_classes=(PULL,))

    @flow.stage("loop-noop", input=In, worker_class=PULL)
    def noop(ctx: StageContext, data: In) -> dict[str, int]:
        return {"value": data.value}

    return flow


@pytest.fixture()
def holder(flow: Flow, clean_db: Engine) -> Iterator[Connection]:
    """An open transaction that inserted (not committed) the row the HTTP enqueue will make:
    that enqueue's INSERT waits on the row's unique key until this rolls back."""
    with clean_db.connect() as conn:
        conn.begin()
        item = flow.new_request("loop-noop", "w1", "held", "", {"value": 1})
        [result] = flow.queue.enqueue_many([item], connection=conn)
        assert result.created
        try:
            yield conn
        finally:
            conn.rollback()


async def waiting_on_a_lock(url: str) -> bool:
    """Whether some backend of the test database waits on a lock (the held enqueue)."""
    async with await psycopg.AsyncConnection.connect(conninfo(url), autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = await cur.fetchone()
        return bool(row and row[0])


def test_an_enqueue_waiting_on_the_database_does_not_hold_up_other_routes(
    flow: Flow, holder: Connection, database_url: str
) -> None:
    app = create_app(flow, auth=KeyAuth({hash_key(KEY): ["w1", "w2"]}), settings=flow.settings)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def scenario() -> None:
        # One thread for every sync route, blocking call and dependency of this loop.
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as http,
        ):
            body = {"stage": "loop-noop", "job_id": "held", "input": {"value": 1}}
            held = asyncio.create_task(http.post("/v1/workspaces/w1/requests", json=body))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while not await waiting_on_a_lock(database_url):
                assert not held.done(), (held.result().status_code, held.result().text)
                assert loop.time() < deadline, "the enqueue never waited on the held row"
                await asyncio.sleep(0.02)

            other = asyncio.create_task(http.get("/v1/workspaces/w2/counts"))
            listed = asyncio.create_task(http.get("/v1/workspaces/w2/requests"))
            done, _ = await asyncio.wait({other, listed}, timeout=DEADLINE)
            answered = other in done and listed in done
            # Let the held enqueue through whatever happened: the loop must end cleanly.
            await asyncio.to_thread(holder.rollback)
            created = await held
            await asyncio.gather(other, listed)
            assert answered, "counts/list of another workspace waited for the held enqueue"
            assert other.result().status_code == 200, other.result().text
            assert other.result().json() == {"workspace_id": "w2", "counts": {}, "total": 0}
            assert listed.result().json() == {"requests": []}
            # The held row was rolled back: the waiting INSERT then created it.
            assert created.status_code == 201, created.text
            assert created.json()["created"] is True

    asyncio.run(scenario())
