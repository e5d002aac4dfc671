"""The pull-worker lock routes use the app's settings (``create_app(flow, settings=S)``), not
the environment's: the lock lives on S's Redis — where the app's event streams listen, so a
waiter hears the release — its TTL is capped by S, and S chooses Redis or SQL.

The app runs in this test's event loop (httpx's ASGI transport, the app's own lifespan) on
the real Postgres and Redis; the environment's ``ONCEFLOW_REDIS_URL`` names a port where
nothing listens. Before the fix the routes took their backend from the environment: the
lock answered 503 (no Redis there), and with a live one the locks, their announcements and
their TTL cap would have been another server's and another configuration's.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis as redis_lib
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
from onceflow.keys import lock_key, workspace_channel
from onceflow.settings import Settings, get_settings
from onceflow.tasks import Flow, StageContext
from tests.acceptance.procs import free_port
from tests.conftest import env

API_KEY = "of_test_lock_settings_api_0123456789ab"
WORKER_KEY = "of_test_lock_settings_wkr_0123456789ab"
PULL = "t-lockset-pull"  # a pull-worker class: no Celery wake-up to send
WS = "w-lockset"
TASK = "eval:fit"
TTL_CAP = 7.0  # the app's ONCEFLOW_LOCK_TTL_SECONDS; the environment's is the default 60


class In(BaseModel):
    value: int = 0


@pytest.fixture()
def environment_redis_nowhere(redis_url: str, clean_db: Engine) -> Iterator[str]:
    """The environment's ONCEFLOW_REDIS_URL names a port where nothing listens."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    try:
        with env(ONCEFLOW_REDIS_URL=nowhere):
            get_settings.cache_clear()
            assert get_settings().redis_url == nowhere
            yield nowhere
    finally:
        get_settings.cache_clear()


def app_on(settings: Settings) -> Any:
    flow = Flow(settings=settings, pull_worker_classes=(PULL,))

    @flow.stage("lockset-noop", input=In, worker_class=PULL)
    def noop(ctx: StageContext, data: In) -> dict[str, int]:
        return {"value": data.value}

    auth = KeyAuth({hash_key(API_KEY): [WS]}, {hash_key(WORKER_KEY): [PULL]})
    return create_app(flow, auth=auth, settings=settings)


async def claim_two_of_one_job(http: httpx.AsyncClient, job: str) -> list[tuple[str, str]]:
    """Two claimed requests of one job (two branches): two holders of one cell."""
    held = []
    for branch in ("a", "b"):
        body = {"stage": "lockset-noop", "job_id": job, "branch_path": branch, "input": {}}
        enqueued = await http.post(f"/v1/workspaces/{WS}/requests", json=body,
                                   headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        assert enqueued.status_code == 201, enqueued.text
        claimed = await http.post(f"/v1/worker-classes/{PULL}/claims", json={"worker_id": branch})
        assert claimed.status_code == 201, claimed.text
        held.append((claimed.json()["request_id"], claimed.json()["claim_token"]))
    return held


def run(app: Any, scenario: Any) -> None:
    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {WORKER_KEY}"}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as http,
        ):
            await scenario(http)

    asyncio.run(main())


def test_pull_locks_live_on_the_apps_redis_with_its_ttl_cap(
    environment_redis_nowhere: str, redis_url: str, database_url: str
) -> None:
    settings = Settings(redis_url=redis_url, database_url=database_url, lock_ttl_seconds=TTL_CAP)
    job = f"j-{secrets.token_hex(4)}"
    r = redis_lib.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    pubsub.subscribe(workspace_channel(WS))  # where the app's event streams listen
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]

    async def scenario(http: httpx.AsyncClient) -> None:
        (rid_a, tok_a), (rid_b, tok_b) = await claim_two_of_one_job(http, job)

        async def lock(rid: str, token: str, action: str = "", **body: Any) -> httpx.Response:
            path = f"/v1/claims/{rid}/locks" + (f"/{action}" if action else "")
            return await http.post(path, json={"claim_token": token, "task": TASK, **body})

        first = await lock(rid_a, tok_a, ttl_seconds=3600)
        # Before: 503, the lock sought on the environment's Redis.
        assert first.status_code == 201, first.text
        assert first.json()["ttl_ms"] == TTL_CAP * 1000  # the app's cap, not the environment's
        assert 0 < r.pttl(lock_key(WS, job, TASK)) <= TTL_CAP * 1000  # on the app's Redis
        waiter = await lock(rid_b, tok_b)
        assert waiter.status_code == 200 and waiter.json()["locked"] is True, waiter.text
        lock_token = first.json()["lock_token"]
        extended = await lock(rid_a, tok_a, "extend", lock_token=lock_token, ttl_seconds=3600)
        assert extended.json() == {"held": True}
        assert 0 < r.pttl(lock_key(WS, job, TASK)) <= TTL_CAP * 1000
        released = await lock(rid_a, tok_a, "release", lock_token=lock_token, outcome="computed")
        assert released.json() == {"released": True}
        # The waiter hears the release where the app's event streams listen.
        kinds = []
        deadline = time.monotonic() + 10
        while "lock_released" not in kinds and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.5)
            if message and message["type"] == "message":
                kinds.append(json.loads(message["data"])["kind"])
        assert "lock_released" in kinds
        retaken = await lock(rid_b, tok_b)
        assert retaken.status_code == 201, retaken.text
        await lock(rid_b, tok_b, "release", lock_token=retaken.json()["lock_token"],
                   outcome="abandoned")  # fmt: skip

    try:
        run(app_on(settings), scenario)
    finally:
        pubsub.close()


def test_pull_locks_use_the_sql_backend_when_the_apps_settings_choose_it(
    environment_redis_nowhere: str, redis_url: str, database_url: str, clean_db: Engine
) -> None:
    settings = Settings(redis_url=redis_url, database_url=database_url, lock_backend="sql")
    job = f"j-{secrets.token_hex(4)}"
    r = redis_lib.Redis.from_url(redis_url)

    async def scenario(http: httpx.AsyncClient) -> None:
        (rid, token), _ = await claim_two_of_one_job(http, job)
        got = await http.post(f"/v1/claims/{rid}/locks", json={"claim_token": token, "task": TASK})
        # Before: 503, the environment's lock backend (Redis, where nothing listens).
        assert got.status_code == 201, got.text
        with clean_db.connect() as conn:
            rows = conn.execute(
                text("SELECT workspace_id, job_id, task FROM compute_locks WHERE job_id = :j"),
                {"j": job},
            ).all()
        assert [tuple(row) for row in rows] == [(WS, job, TASK)]
        assert not r.exists(lock_key(WS, job, TASK))
        released = await http.post(f"/v1/claims/{rid}/locks/release", json={
            "claim_token": token, "task": TASK, "lock_token": got.json()["lock_token"],
            "outcome": "abandoned",
        })  # fmt: skip
        assert released.json() == {"released": True}

    run(app_on(settings), scenario)


def test_lock_backends_are_shared_by_settings_of_one_url_and_lock_options(
    redis_url: str, database_url: str
) -> None:
    from onceflow.locks import get_async_backend, get_backend

    def make(**options: Any) -> Settings:
        return Settings(redis_url=redis_url, database_url=database_url, **options)

    one, same, shorter = make(), make(), make(lock_ttl_seconds=TTL_CAP)
    assert get_backend(one) is get_backend(same)
    assert get_backend(shorter) is not get_backend(one)
    assert get_backend(shorter).settings.lock_ttl_seconds == TTL_CAP

    async def per_loop() -> None:
        assert get_async_backend(one) is get_async_backend(same)
        assert get_async_backend(shorter) is not get_async_backend(one)
        assert get_async_backend(shorter).settings.lock_ttl_seconds == TTL_CAP

    asyncio.run(per_loop())
