"""A worker key holds a claim, a retry delay and a compute lock for a bounded time only.

Against a real `onceflow api` (uvicorn), real Postgres and Redis, with a worker key — what a
browser tab holds. Before: a claim took any ``lease_seconds`` up to a day (on claim and on
heartbeat), an HTTP claim had no run deadline (heartbeats extended it, and the compute locks
with it, without end), ``fail`` postponed a retry by up to a year, and ``locks/extend`` with
``ttl_seconds=1e-9`` answered ``held: true`` while leaving the lock 1 ms to live, so the next
acquire got it (a second paid call). Now each is refused with 422 ``invalid_request`` and
changes nothing, and every HTTP claim ends at its stage's ``max_runtime`` (database clock),
where the sweeper fails the run as past its ``max_runtime`` (retried after the backoff).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.integrations.fastapi import hash_key
from onceflow.keys import lock_key
from tests.acceptance.conftest import TEST_ENV, runtime  # noqa: F401 - the fixture
from tests.acceptance.procs import api_server, wait_for
from tests.acceptance.test_http_api import auth
from tests.conftest import table_snapshot
from tests.security.bounded_stages import (
    LEASE,
    LEASED,
    SHORT,
    SHORT_LEASE,
    SHORT_RUNTIME,
    flow,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("runtime")]

APP = "tests.security.bounded_stages:flow"
API_KEY = "of_test_bounded_api_key_0123456789abcdef"
WORKER_KEY = "of_test_bounded_worker_key_0123456789ab"
WS = "w-bounded"
BACKOFF_MAX = 60
LOST_WITHIN = 30.0  # the most the run-deadline test polls for the lease to be lost


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [LEASED, SHORT]}),
        "ONCEFLOW_BACKOFF_MAX_SECONDS": str(BACKOFF_MAX),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
        "ONCEFLOW_API_RATE_LIMIT": "",
    }
    with api_server(tmp_path_factory.mktemp("bounded-api"), env, app=APP) as (url, _):
        yield url


@pytest.fixture()
def http(api: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, timeout=10) as client:
        yield client


def enqueue(http: httpx.Client, stage: str, job: str = "j", branch: str = "") -> str:
    body = {"stage": stage, "job_id": job, "branch_path": branch}
    made = http.post(f"/v1/workspaces/{WS}/requests", json=body, headers=auth(API_KEY))
    assert made.status_code == 201, made.text
    request_id: str = made.json()["request_id"]
    return request_id


def claim(http: httpx.Client, wc: str, **extra: Any) -> httpx.Response:
    body = {"worker_id": "tab", **extra}
    return http.post(f"/v1/worker-classes/{wc}/claims", json=body, headers=auth(WORKER_KEY))


def post(http: httpx.Client, path: str, **body: Any) -> httpx.Response:
    return http.post(f"/v1/claims/{path}", json=body, headers=auth(WORKER_KEY))


def refused(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 422, response.text
    answer = response.json()
    assert answer["code"] == "invalid_request", answer
    assert all(word in answer["detail"] for word in words), answer


def row(engine: Engine, request_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT * FROM workspace_process_requests WHERE request_id = :r"),
            {"r": request_id},
        ).mappings()
        return dict(found.one())


def test_a_claim_cannot_take_a_longer_lease_than_its_stage(
    http: httpx.Client, clean_db: Engine
) -> None:
    rid = enqueue(http, "leased")
    before = table_snapshot(clean_db)
    for lease in (86_400, LEASE + 0.5):  # before: 201, "86394 s left" on the dashboard
        refused(claim(http, LEASED, lease_seconds=lease), "lease_seconds", f"{LEASE:g}")
        assert table_snapshot(clean_db) == before  # nothing claimed
    # A shorter lease is the client's to take (it only shortens its own hold).
    short = claim(http, LEASED, lease_seconds=5)
    assert short.status_code == 201, short.text
    assert short.json()["lease_seconds"] == 5
    held = row(clean_db, rid)
    assert held["lease_seconds"] == 5
    assert held["lease_expires_at"] - held["claimed_at"] == timedelta(seconds=5)


def test_a_heartbeat_cannot_stretch_the_lease_past_its_stage(
    http: httpx.Client, clean_db: Engine
) -> None:
    rid = enqueue(http, "leased")
    got = claim(http, LEASED)
    assert got.status_code == 201, got.text
    assert got.json()["lease_seconds"] == LEASE  # the stage's
    token = got.json()["claim_token"]
    before = table_snapshot(clean_db)
    for lease in (86_400, LEASE + 1):
        refused(post(http, f"{rid}/heartbeat", claim_token=token, lease_seconds=lease),
                "lease_seconds", f"{LEASE:g}")  # fmt: skip
        assert table_snapshot(clean_db) == before  # the lease unchanged
    # A wrong token learns nothing about the stage: the same 409 as without a lease.
    lost = post(http, f"{rid}/heartbeat", claim_token="not-it", lease_seconds=86_400)
    assert lost.status_code == 409 and lost.json()["code"] == "lease_lost", lost.text
    ok = post(http, f"{rid}/heartbeat", claim_token=token, lease_seconds=LEASE)
    assert ok.status_code == 200, ok.text
    held = row(clean_db, rid)
    assert held["lease_expires_at"] - held["heartbeat_at"] == timedelta(seconds=LEASE)


def test_a_claim_that_heartbeats_forever_loses_its_lease_at_max_runtime(
    http: httpx.Client, clean_db: Engine
) -> None:
    rid = enqueue(http, "short_run")
    got = claim(http, SHORT)
    assert got.status_code == 201, got.text
    assert got.json()["lease_seconds"] == SHORT_LEASE
    token = got.json()["claim_token"]
    held = row(clean_db, rid)
    # The run deadline, on the database clock, set by the claim (before: NULL for HTTP claims).
    assert held["run_deadline"] == held["claimed_at"] + timedelta(seconds=SHORT_RUNTIME)
    # A tab that heartbeats every lease/4 without end: its lease is lost at the deadline.
    began = time.monotonic()
    while True:
        beat = post(http, f"{rid}/heartbeat", claim_token=token)
        if beat.status_code == 409:
            break
        assert beat.status_code == 200, beat.text
        elapsed = time.monotonic() - began
        assert elapsed < LOST_WITHIN, "heartbeats went on extending the lease past max_runtime"
        time.sleep(SHORT_LEASE / 4)  # the heartbeat interval of a tab
    assert beat.json()["code"] == "lease_lost"
    ended = row(clean_db, rid)
    assert ended["lease_expires_at"] <= ended["run_deadline"]  # never extended past it
    # A run past max_runtime is no crash: no claim takes it over at once; the sweeper fails
    # it (MaxRuntimeExceeded), to run again after the backoff.
    nothing = claim(http, SHORT, worker_id="rescuer")
    assert nothing.status_code == 204, nothing.text

    def swept() -> bool:
        flow.queue.rescue_expired(stages=["short_run"])
        return bool(row(clean_db, rid)["status"] != "running")

    wait_for(swept, what="the sweep of the run past max_runtime")
    failed = row(clean_db, rid)
    assert (failed["status"], failed["attempts"], failed["crash_attempts"]) == ("queued", 1, 0)
    assert failed["error"]["type"] == "MaxRuntimeExceeded"
    assert failed["run_after"] > failed["updated_at"]  # after the backoff


def test_a_failure_cannot_postpone_its_retry_past_the_backoff_cap(
    http: httpx.Client, clean_db: Engine
) -> None:
    rid = enqueue(http, "leased")
    token = claim(http, LEASED).json()["claim_token"]
    before = table_snapshot(clean_db)
    for retry_in in (366 * 86_400, BACKOFF_MAX + 1):  # before: queued a year away
        refused(post(http, f"{rid}/fail", claim_token=token, error={"e": 1}, retry_in=retry_in),
                "retry_in", "ONCEFLOW_BACKOFF_MAX_SECONDS")  # fmt: skip
        assert table_snapshot(clean_db) == before  # still running, same claim
    failed = post(http, f"{rid}/fail", claim_token=token, error={"e": 1}, retry_in=BACKOFF_MAX)
    assert failed.status_code == 200, failed.text
    queued = row(clean_db, rid)
    assert queued["status"] == "queued"
    assert queued["run_after"] - queued["updated_at"] == timedelta(seconds=BACKOFF_MAX)


def test_a_lock_ttl_too_short_to_hold_is_refused_and_the_lock_kept(
    http: httpx.Client, clean_db: Engine, redis_url: str
) -> None:
    # Two requests of one job: their claims' compute locks are the same cell. (Locks live in
    # Redis, which no fixture empties: a job of this run only.)
    job = f"j-{secrets.token_hex(4)}"
    first, second = enqueue(http, "leased", job, "a"), enqueue(http, "leased", job, "b")
    claims = {c["request_id"]: c["claim_token"] for c in (claim(http, LEASED).json(),
                                                           claim(http, LEASED).json())}  # fmt: skip
    held = post(http, f"{first}/locks", claim_token=claims[first], task="eval:c", ttl_seconds=30)
    assert held.status_code == 201, held.text
    lock_token = held.json()["lock_token"]
    store = redis_lib.Redis.from_url(redis_url)
    key = lock_key(WS, job, "eval:c")
    value = store.get(key)
    before = table_snapshot(clean_db)
    for ttl in (1e-9, 0.5):  # before: {"held": true} with 1 ms left
        extend = post(http, f"{first}/locks/extend", claim_token=claims[first], task="eval:c",
                      lock_token=lock_token, ttl_seconds=ttl)  # fmt: skip
        refused(extend)
        assert extend.json()["errors"][0]["loc"] == ["body", "ttl_seconds"]
        assert store.get(key) == value and store.pttl(key) > 25_000  # the lock untouched
    # So the other claim finds the cell taken: no second paid call.
    other = post(http, f"{second}/locks", claim_token=claims[second], task="eval:c")
    assert other.status_code == 200 and other.json()["locked"] is True, other.text
    # A lock that would lapse at once is not taken either.
    brief = post(http, f"{second}/locks", claim_token=claims[second], task="eval:d",
                 ttl_seconds=0.01)  # fmt: skip
    refused(brief)
    assert store.exists(lock_key(WS, job, "eval:d")) == 0
    assert table_snapshot(clean_db) == before
    done = post(http, f"{first}/locks/release", claim_token=claims[first], task="eval:c",
                lock_token=lock_token, outcome="abandoned")  # fmt: skip
    assert done.status_code == 200 and done.json()["released"] is True, done.text
