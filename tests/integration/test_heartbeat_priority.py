"""A heartbeat is never queued behind long polls in the API process.

The app runs in this test's event loop (httpx's ASGI transport, the app's own lifespan)
on the real database. Many long-poll claims sleep in the worker class's line; the
server's thread pool is cut to one thread, held by a blocking call for the whole test.
A heartbeat must still be answered: the long polls hold no thread and no database
connection while they sleep, and the heartbeat's route needs no thread either.
"""

from __future__ import annotations

import asyncio
import threading

import anyio.to_thread
import httpx
import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import Engine

from onceflow.connector import conninfo
from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
from onceflow.integrations.fastapi.services import OnceflowServices
from onceflow.settings import get_settings
from onceflow.tasks import Flow, StageContext

WORKER_KEY = "of_test_beat_priority_worker_0123456789"
PULL = "t-beat-pull"
WAITERS = 60
# How long the heartbeat may take before the test gives up: a deadline for a condition
# (it answers while the thread is held), not a speed requirement.
DEADLINE = 20.0


class In(BaseModel):
    value: int = 0


@pytest.fixture()
def flow(clean_db: Engine) -> Flow:
    settings = get_settings().model_copy(update={"api_rate_limit": "", "notify": True})
    flow = Flow(settings=settings, pull_worker_classes=(PULL,))

    @flow.stage("beat-noop", input=In, worker_class=PULL)
    def noop(ctx: StageContext, data: In) -> dict[str, int]:
        return {"value": data.value}

    return flow


async def backends(url: str) -> int:
    """Connections to the test database, this one aside."""
    async with await psycopg.AsyncConnection.connect(conninfo(url), autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


def test_a_heartbeat_is_answered_while_long_polls_sleep_and_the_thread_pool_is_full(
    flow: Flow, database_url: str
) -> None:
    app = create_app(flow, auth=KeyAuth(worker_keys={hash_key(WORKER_KEY): [PULL]}),
                     settings=flow.settings)  # fmt: skip
    headers = {"Authorization": f"Bearer {WORKER_KEY}"}
    release = threading.Event()

    async def scenario() -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = 1
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=transport, base_url="http://t", headers=headers, timeout=120
            ) as http,
        ):
            svc: OnceflowServices = app.state.onceflow
            item = flow.new_request("beat-noop", "w1", "beat", "", {"value": 1})
            await asyncio.to_thread(flow.queue.enqueue_many, [item])
            claimed = await http.post(f"/v1/worker-classes/{PULL}/claims",
                                      json={"worker_id": "leader", "wait": 0})  # fmt: skip
            assert claimed.status_code == 201, claimed.text
            claim = claimed.json()

            polls = [
                asyncio.create_task(
                    http.post(
                        f"/v1/worker-classes/{PULL}/claims",
                        json={"worker_id": f"tab-{n}", "wait": 60},
                    )
                )
                for n in range(WAITERS)
            ]
            line = await svc.claim_lines().line(PULL)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while len(line.sleeping) < WAITERS or line.busy:
                assert loop.time() < deadline, "the long polls never all slept"
                await asyncio.sleep(0.01)
            # The only thread of the pool is taken by a blocking call (a slow sync route).
            held = asyncio.ensure_future(anyio.to_thread.run_sync(release.wait))
            while limiter.borrowed_tokens < 1:
                assert loop.time() < deadline, "the blocking call never took the thread"
                await asyncio.sleep(0.01)
            try:
                beat = asyncio.ensure_future(
                    http.post(
                        f"/v1/claims/{claim['request_id']}/heartbeat",
                        json={"claim_token": claim["claim_token"], "workspace_id": "w1"},
                    )
                )
                done, _ = await asyncio.wait({beat}, timeout=DEADLINE)
                answered = beat in done
            finally:
                release.set()
                await held
            assert answered, "the heartbeat waited for a thread or behind the long polls"
            assert beat.result().status_code == 200, beat.result().text
            assert len(line.sleeping) == WAITERS  # nobody was woken by the heartbeat
            # Sleeping long polls hold no database connection: the pools' few, not one each.
            assert await backends(database_url) < WAITERS // 2
            for p in polls:
                p.cancel()
            await asyncio.gather(*polls, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
