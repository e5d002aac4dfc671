"""The HTTP API on a real uvicorn server (``onceflow api``), real Postgres, Redis and Celery.

One server process serves the whole module (keys from the environment, hashed);
the Celery worker for ``t-default`` is shared too. Each test starts from an empty
table and clean broker queues (the ``runtime`` fixture).
"""

from __future__ import annotations

import json
import queue as queue_mod
import secrets
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis as redis_lib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from onceflow import LeaseLost
from onceflow.demo import procs
from onceflow.errors import AccessDenied, OpIdConflict
from onceflow.integrations.fastapi import hash_key
from onceflow.integrations.pull import PullContext, PullWorker
from onceflow.keys import counters_key, lock_key, queue_name, workspace_channel
from onceflow.models.ops import NodeInsert
from onceflow.oplog import OpLog, TransportError, WorkspaceClient, new_op_id
from onceflow.oplog.http import HttpTransport
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.openapi_strategies import (
    SchemaStrategies,
    any_json,
    nasty_text,
    operations,
    path_value,
)
from tests.acceptance.procs import APP, ROOT, api_server, free_port, wait_for

pytestmark = pytest.mark.slow

API_KEY = "of_test_api_key_w1_0123456789abcdef"  # workspaces w1, w-sse
OTHER_KEY = "of_test_api_key_w2_0123456789abcdef"  # workspace w2
WORKER_KEY = "of_test_worker_key_pull_0123456789ab"  # worker class t-pull
BODY_LIMIT = 64 * 1024
PULL = "t-pull"
HYP = "t-hyp"
TABLES = ("workspace_process_requests", "workspace_sub_docs", "workspace_sub_doc_ops")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """A real `onceflow api` process; its base URL."""
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps(
            {hash_key(API_KEY): ["w1", "w-sse"], hash_key(OTHER_KEY): ["w2"]}
        ),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
        "ONCEFLOW_API_MAX_BODY_BYTES": str(BODY_LIMIT),
        "ONCEFLOW_API_SSE_KEEPALIVE_SECONDS": "0.5",
        "ONCEFLOW_API_BODY_TIMEOUT_SECONDS": "2",
        # The Hypothesis pass sends many 401s from one address, and many requests a key may
        # not make (403s, which use the key's budget): no lock-out and no per-key limit here
        # (tests/security/test_sse_and_rate_limits.py and test_pull_rate_limit.py test them).
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
        "ONCEFLOW_API_RATE_LIMIT": "",
    }
    with api_server(tmp_path_factory.mktemp("api"), env) as (url, proc):
        yield url
    # Secrets are never logged: neither keys nor claim tokens.
    log_text = proc.log()
    for secret in (API_KEY, OTHER_KEY, WORKER_KEY, *_TOKENS_SEEN):
        assert secret not in log_text


_TOKENS_SEEN: list[str] = []


@pytest.fixture(scope="module")
def celery_worker(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[procs.Proc]:
    """A real Celery worker for the t-default class, shared by the module."""
    env = {**TEST_ENV, "PYTHONPATH": str(ROOT)}
    worker = procs.start_worker(
        tmp_path_factory.mktemp("worker"), APP, "t-default", env=env, cwd=ROOT, name="http"
    )
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture()
def client(api: str, runtime: Any, redis_url: str) -> Iterator[httpx.Client]:
    """An HTTP client of the server, on an empty table; the pull queues cleaned after."""
    with httpx.Client(base_url=api, timeout=10) as http:
        yield http
    r = redis_lib.Redis.from_url(redis_url)
    r.delete(queue_name(PULL), queue_name(HYP))


def snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the three tables."""
    out = {}
    with engine.connect() as conn:
        for table in TABLES:
            query = text(f"SELECT * FROM {table} ORDER BY 1, 2")  # noqa: S608 - our own names
            out[table] = [tuple(row) for row in conn.execute(query)]
    return out


def enqueue(http: httpx.Client, ws: str, key: str, **body: Any) -> httpx.Response:
    return http.post(f"/v1/workspaces/{ws}/requests", json=body, headers=auth(key))


def status_of(http: httpx.Client, ws: str, rid: str) -> str:
    response = http.get(f"/v1/workspaces/{ws}/requests/{rid}", headers=auth(API_KEY))
    assert response.status_code == 200, response.text
    status: str = response.json()["status"]
    return status


# ------------------------------------------------------------------ enqueue


def test_enqueue_over_http_runs_the_stage(client: httpx.Client, celery_worker: Any) -> None:
    first = enqueue(client, "w1", API_KEY, stage="noop", job_id="j1", input={"value": 7})
    assert first.status_code == 201, first.text
    rid = first.json()["request_id"]
    assert first.json() == {
        "request_id": rid, "created": True, "status": "queued", "input_mismatch": False
    }  # fmt: skip
    assert first.headers["location"] == f"/v1/workspaces/w1/requests/{rid}"
    again = enqueue(client, "w1", API_KEY, stage="noop", job_id="j1", input={"value": 7})
    assert again.status_code == 200
    assert again.json()["created"] is False and again.json()["request_id"] == rid

    wait_for(lambda: status_of(client, "w1", rid) == "succeeded", what="the stage to succeed")
    row = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()
    assert row["result"]["value"] == 7 and row["attempts"] == 1
    listed = client.get("/v1/workspaces/w1/requests?status=succeeded", headers=auth(API_KEY))
    assert [r["request_id"] for r in listed.json()["requests"]] == [rid]
    counts = client.get("/v1/workspaces/w1/counts", headers=auth(API_KEY)).json()
    assert counts["total"] == 1 and counts["counts"]["t-default"]["succeeded"] == 1


def test_16_concurrent_http_enqueues_one_row_one_created(
    client: httpx.Client, api: str, engine: Engine
) -> None:
    barrier = threading.Barrier(16)
    answers: list[tuple[int, dict[str, Any]]] = []

    def one() -> None:
        with httpx.Client(base_url=api, timeout=30) as own:
            barrier.wait()
            body = {"stage": "noop", "job_id": "j16", "input": {"value": 1}, "worker_class": HYP}
            response = own.post("/v1/workspaces/w1/requests", json=body, headers=auth(API_KEY))
            answers.append((response.status_code, response.json()))

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(code for code, _ in answers) == [200] * 15 + [201]
    assert sum(body["created"] for _, body in answers) == 1
    assert len({body["request_id"] for _, body in answers}) == 1
    with engine.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM workspace_process_requests")).scalar()
    assert n == 1


# ------------------------------------------------------------- pull workers


def test_pull_worker_serves_its_class_while_celery_serves_another(
    client: httpx.Client, api: str, celery_worker: Any
) -> None:
    pulled = [
        enqueue(client, "w1", API_KEY, stage="noop", job_id=f"p{i}", input={"value": i},
                worker_class=PULL).json()["request_id"]
        for i in range(4)
    ]  # fmt: skip
    celery = [
        enqueue(client, "w1", API_KEY, stage="noop", job_id=f"c{i}", input={"value": i})
        for i in range(4)
    ]
    celery_ids = [r.json()["request_id"] for r in celery]
    seen: list[str] = []
    failed_once: set[str] = set()

    def work(ctx: PullContext) -> dict[str, Any]:
        rid = ctx.claim.request_id
        _TOKENS_SEEN.append(ctx.claim.token)
        if ctx.request["job_id"] == "p0" and rid not in failed_once:
            failed_once.add(rid)
            raise RuntimeError("first attempt fails")  # retried with backoff
        seen.append(rid)
        job = ctx.request["job_id"]
        ctx.apply_op(f"job:{job}", {"type": "cell.set", "column": "pull", "value": 1}, key="c")
        if job == "p1":
            ctx.then("noop", {"value": 99}, branch_path="after-pull")  # served by Celery
        return {"by": "pull", "value": ctx.input["value"]}

    with PullWorker(api, WORKER_KEY, PULL, lease_seconds=5) as worker:
        outcomes: list[str | None] = []
        wait_for(
            lambda: outcomes.append(worker.run_once(work)) or outcomes.count("succeeded") == 4,
            what="the pull worker to finish its four requests",
        )
    assert "retry" in outcomes
    assert sorted(seen) == sorted(pulled)  # only its class, each once to success
    for rid in pulled:
        row = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()
        assert row["status"] == "succeeded" and row["result"]["by"] == "pull"
        assert row["claimed_by"].startswith("pull:")
    for rid in celery_ids:
        wait_for(lambda rid=rid: status_of(client, "w1", rid) == "succeeded", what="celery")
        row = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()
        assert not row["claimed_by"].startswith("pull:")
    doc = client.get("/v1/workspaces/w1/sub-docs/job:p2", headers=auth(API_KEY)).json()
    assert doc["clock"] == 1 and doc["state"]["cells"] == {"pull": 1}
    hand_off = client.get(
        "/v1/workspaces/w1/requests?job_id=p1&stage=noop", headers=auth(API_KEY)
    ).json()["requests"]
    follow = [r for r in hand_off if r["branch_path"] == "after-pull"]
    assert len(follow) == 1 and follow[0]["worker_class"] == "t-default"
    wait_for(lambda: status_of(client, "w1", follow[0]["request_id"]) == "succeeded",
             what="the hand-off to run on Celery")  # fmt: skip


def test_zombie_pull_worker_late_complete_is_rejected(
    client: httpx.Client, api: str, engine: Engine
) -> None:
    rid = enqueue(
        client, "w1", API_KEY, stage="noop", job_id="jz", input={"value": 1}, worker_class=PULL
    ).json()["request_id"]
    with (
        PullWorker(api, WORKER_KEY, PULL, lease_seconds=1, worker_id="zombie") as zombie,
        PullWorker(api, WORKER_KEY, PULL, lease_seconds=30, worker_id="successor") as successor,
    ):
        old = zombie.claim()
        assert old is not None and old.attempt == 1
        _TOKENS_SEEN.append(old.token)
        # No heartbeat: the lease lapses on the database clock, then the successor claims.
        new = wait_for(successor.claim, what="the lapsed lease to be claimed again")
        assert new.request_id == rid and new.attempt == 2
        _TOKENS_SEEN.append(new.token)

        before = snapshot(engine)
        late = client.post(
            f"/v1/claims/{rid}/complete",
            json={"claim_token": old.token, "result": {"by": "zombie"}},
            headers=auth(WORKER_KEY),
        )
        assert late.status_code == 409 and late.json()["code"] == "lease_lost"
        with pytest.raises(LeaseLost):
            zombie.heartbeat(old)
        with pytest.raises(LeaseLost):
            zombie.apply_op(old, "job:jz", {"type": "cell.set", "column": "z", "value": 1}, key="z")
        with pytest.raises(LeaseLost):
            zombie.fail(old, {"type": "Zombie"})
        assert snapshot(engine) == before  # nothing changed

        successor.complete(new, {"by": "successor"})
    row = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()
    assert row["status"] == "succeeded" and row["result"] == {"by": "successor"}


def test_long_poll_claim_returns_a_request_enqueued_during_the_wait(
    client: httpx.Client, engine: Engine
) -> None:
    """``wait``: the claim waits (LISTEN, no polling) and returns what was enqueued meanwhile."""
    from tests.integration.test_wait_for_work import checked_since, db_now

    answers: list[httpx.Response] = []
    since = db_now(engine)
    body = {"worker_id": "long", "wait": 30}
    poll = threading.Thread(
        target=lambda: answers.append(
            client.post(
                f"/v1/worker-classes/{PULL}/claims",
                json=body,
                headers=auth(WORKER_KEY),
                timeout=60,
            )
        )
    )
    poll.start()
    wait_for(lambda: checked_since(engine, since), what="the server's claim to wait")
    rid = enqueue(
        client, "w1", API_KEY, stage="noop", job_id="lp", input={"value": 1}, worker_class=PULL
    ).json()["request_id"]
    poll.join(60)
    assert not poll.is_alive()
    (answer,) = answers
    assert answer.status_code == 201 and answer.json()["request_id"] == rid
    _TOKENS_SEEN.append(answer.json()["claim_token"])
    # Nothing claimable during the whole wait: 204 once it is used up.
    empty = client.post(
        f"/v1/worker-classes/{PULL}/claims",
        json={"worker_id": "long", "wait": 0.3},
        headers=auth(WORKER_KEY),
    )
    assert empty.status_code == 204
    bad = client.post(
        f"/v1/worker-classes/{PULL}/claims",
        json={"worker_id": "long", "wait": 61},
        headers=auth(WORKER_KEY),
    )
    assert bad.status_code == 422


def test_a_read_with_wait_answers_as_soon_as_the_request_ends(
    client: httpx.Client, engine: Engine
) -> None:
    """``GET …/requests/{id}?wait=S``: a long poll woken by the database (LISTEN), not polling;
    a wait used up answers the request as it is, 200."""
    import psycopg

    from onceflow import ClaimRef, Queue
    from onceflow.queue import sql
    from tests.conftest import libpq
    from tests.integration.test_wait_for_work import db_now

    get_start = sql.GET.sql.split("%(")[0]

    def read_since(since: Any) -> bool:
        """The server read the request after ``since`` and is idle: its wait LISTENs (it
        LISTENs before it reads) and sleeps."""
        url = libpq(engine.url.render_as_string(hide_password=False))
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND starts_with(query, %s) AND state = 'idle' AND query_start >= %s"
                " AND pid <> pg_backend_pid())",
                (get_start, since),
            ).fetchone()
        return bool(row and row[0])

    rid = enqueue(
        client, "w1", API_KEY, stage="noop", job_id="lw", input={"value": 1}, worker_class=PULL
    ).json()["request_id"]
    claimed = client.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "lw"}, headers=auth(WORKER_KEY)
    )
    assert claimed.status_code == 201 and claimed.json()["request_id"] == rid
    token = claimed.json()["claim_token"]
    _TOKENS_SEEN.append(token)
    # Used up: the request as it is now, 200.
    now = client.get(f"/v1/workspaces/w1/requests/{rid}?wait=0.3", headers=auth(API_KEY))
    assert now.status_code == 200 and now.json()["status"] == "running", now.text
    answers: list[httpx.Response] = []
    since = db_now(engine)
    poll = threading.Thread(
        target=lambda: answers.append(
            client.get(
                f"/v1/workspaces/w1/requests/{rid}",
                params={"wait": 30},
                headers=auth(API_KEY),
                timeout=60,
            )
        )
    )
    poll.start()
    wait_for(lambda: read_since(since), what="the server's read to wait")
    assert poll.is_alive()
    Queue(engine).complete(ClaimRef(rid, token), {"value": 1})
    poll.join(60)
    assert not poll.is_alive()
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert (answer.json()["status"], answer.json()["result"]) == ("succeeded", {"value": 1})
    # An ended request is answered at once; bounds and a missing request as without wait.
    again = client.get(f"/v1/workspaces/w1/requests/{rid}?wait=60", headers=auth(API_KEY))
    assert again.status_code == 200 and again.json()["status"] == "succeeded"
    for bad in ("61", "-1", "nan", "soon"):
        refused = client.get(f"/v1/workspaces/w1/requests/{rid}?wait={bad}", headers=auth(API_KEY))
        assert refused.status_code == 422, (bad, refused.text)
    missing = client.get(f"/v1/workspaces/w1/requests/{'0' * 64}?wait=5", headers=auth(API_KEY))
    assert missing.status_code == 404
    # Another workspace's request: 404 at once, as a read without wait.
    other = client.get(f"/v1/workspaces/w-sse/requests/{rid}?wait=5", headers=auth(API_KEY))
    assert other.status_code == 404


# ----------------------------------------------------------------- security


def _claimed(client: httpx.Client) -> tuple[str, str]:
    rid = enqueue(
        client, "w1", API_KEY, stage="noop", job_id="js", input={"value": 1}, worker_class=PULL
    ).json()["request_id"]
    answer = client.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "sec"}, headers=auth(WORKER_KEY)
    )
    assert answer.status_code == 201 and answer.json()["request_id"] == rid
    _TOKENS_SEEN.append(answer.json()["claim_token"])
    return rid, answer.json()["claim_token"]


def _chunks(size: int) -> Iterator[bytes]:
    for _ in range(size // 4096 + 1):
        yield b" " * 4096


Case = tuple[str, Callable[[httpx.Client, dict[str, str]], httpx.Response], int, str]
OP = {"type": "cell.set", "column": "c", "value": 1}
NOOP = {"stage": "noop", "job_id": "jn", "input": {"value": 1}}

CASES: list[Case] = [
    ("no key", lambda c, ids: c.post("/v1/workspaces/w1/requests", json=NOOP), 401, "unauthorized"),
    ("wrong key", lambda c, ids: c.post("/v1/workspaces/w1/requests", json=NOOP,
        headers=auth("of_wrong_key")), 401, "unauthorized"),
    ("not bearer", lambda c, ids: c.post("/v1/workspaces/w1/requests", json=NOOP,
        headers={"Authorization": f"Basic {API_KEY}"}), 401, "unauthorized"),
    ("no key, malformed JSON", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        content=b"{oops", headers={"content-type": "application/json"}), 401, "unauthorized"),
    ("other workspace: enqueue", lambda c, ids: c.post("/v1/workspaces/w2/requests", json=NOOP,
        headers=auth(API_KEY)), 403, "forbidden"),
    ("other workspace: existing id", lambda c, ids: c.get(
        f"/v1/workspaces/w2/requests/{ids['w2']}", headers=auth(API_KEY)), 403, "forbidden"),
    ("other workspace: unknown id", lambda c, ids: c.get(
        f"/v1/workspaces/w2/requests/{'0' * 64}", headers=auth(API_KEY)), 403, "forbidden"),
    ("other workspace's id under mine", lambda c, ids: c.get(
        f"/v1/workspaces/w1/requests/{ids['w2']}", headers=auth(API_KEY)), 404, "not_found"),
    ("unknown id under mine", lambda c, ids: c.get(
        f"/v1/workspaces/w1/requests/{'0' * 64}", headers=auth(API_KEY)), 404, "not_found"),
    ("other workspace: op", lambda c, ids: c.post("/v1/workspaces/w2/sub-docs/d/ops",
        json={"op_id": new_op_id(), "op": OP}, headers=auth(API_KEY)), 403, "forbidden"),
    ("other workspace: events", lambda c, ids: c.get("/v1/workspaces/w2/events",
        headers=auth(API_KEY)), 403, "forbidden"),
    ("other worker class", lambda c, ids: c.post("/v1/worker-classes/t-default/claims",
        json={"worker_id": "x"}, headers=auth(WORKER_KEY)), 403, "forbidden"),
    ("API key claims", lambda c, ids: c.post(f"/v1/worker-classes/{PULL}/claims",
        json={"worker_id": "x"}, headers=auth(API_KEY)), 403, "forbidden"),
    ("API key completes", lambda c, ids: c.post(f"/v1/claims/{ids['claimed']}/complete",
        json={"claim_token": ids["token"]}, headers=auth(API_KEY)), 403, "forbidden"),
    ("worker key enqueues", lambda c, ids: c.post("/v1/workspaces/w1/requests", json=NOOP,
        headers=auth(WORKER_KEY)), 403, "forbidden"),
    ("forged token: complete", lambda c, ids: c.post(f"/v1/claims/{ids['claimed']}/complete",
        json={"claim_token": "f" * 32, "result": 1}, headers=auth(WORKER_KEY)), 409, "lease_lost"),
    ("forged token: heartbeat", lambda c, ids: c.post(f"/v1/claims/{ids['claimed']}/heartbeat",
        json={"claim_token": "f" * 32}, headers=auth(WORKER_KEY)), 409, "lease_lost"),
    ("forged token: fail", lambda c, ids: c.post(f"/v1/claims/{ids['claimed']}/fail",
        json={"claim_token": "f" * 32, "error": "x"}, headers=auth(WORKER_KEY)), 409,
        "lease_lost"),
    ("forged token: op", lambda c, ids: c.post(f"/v1/claims/{ids['claimed']}/ops",
        json={"claim_token": "f" * 32, "sub_doc": "d", "op": OP, "key": "k"},
        headers=auth(WORKER_KEY)), 409, "lease_lost"),
    ("forged token: permit", lambda c, ids: c.post(f"/v1/claims/{ids['claimed']}/permits",
        json={"claim_token": "f" * 32, "provider": "any", "tokens": 1, "permit_id": "p" * 32},
        headers=auth(WORKER_KEY)), 409, "lease_lost"),
    ("forged token: permit settle", lambda c, ids: c.post(
        f"/v1/claims/{ids['claimed']}/permits/{'p' * 32}/settle",
        json={"claim_token": "f" * 32, "usage": {"input_tokens": 1, "output_tokens": 1}},
        headers=auth(WORKER_KEY)), 404, "not_found"),
    ("token of another class's request", lambda c, ids: c.post(
        f"/v1/claims/{ids['w2']}/complete", json={"claim_token": "f" * 32},
        headers=auth(WORKER_KEY)), 409, "lease_lost"),
    ("oversize body", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "input": {"value": 1, "pad": "x" * BODY_LIMIT}}, headers=auth(API_KEY)),
        413, "payload_too_large"),
    ("oversize chunked body", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        content=_chunks(BODY_LIMIT), headers={**auth(API_KEY),
        "content-type": "application/json"}), 413, "payload_too_large"),
    ("malformed JSON", lambda c, ids: c.post("/v1/workspaces/w1/requests", content=b"{oops",
        headers={**auth(API_KEY), "content-type": "application/json"}), 422, "invalid_request"),
    ("wrong type: job_id", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "job_id": 5}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("wrong type: input", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "input": "text"}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("wrong type: stage input", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "input": {"value": "seven"}}, headers=auth(API_KEY)), 422,
        "invalid_request"),
    ("wrong type: priority", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "priority": "high"}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("unknown field", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "workspace_id": "w2"}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("unknown stage", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "stage": "nope"}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("control character in an id", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "job_id": "j\x00"}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("lone surrogate in an op", lambda c, ids: c.post("/v1/workspaces/w1/sub-docs/d/ops",
        content=json.dumps({"op_id": new_op_id(), "op": {**OP, "value": "\ud800"}}).encode(),
        headers={**auth(API_KEY), "content-type": "application/json"}), 422, "invalid_request"),
    ("NaN in an op", lambda c, ids: c.post("/v1/workspaces/w1/sub-docs/d/ops",
        content=json.dumps({"op_id": new_op_id(), "op": {**OP, "value": float("nan")}}).encode(),
        headers={**auth(API_KEY), "content-type": "application/json"}), 422, "invalid_request"),
    ("NaN where a string goes", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        content=b'{"stage": NaN, "job_id": "j"}',
        headers={**auth(API_KEY), "content-type": "application/json"}), 422, "invalid_request"),
    ("JSON nested past the parser's depth", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        content=b"[" * 5000 + b"]" * 5000,
        headers={**auth(API_KEY), "content-type": "application/json"}), 422, "invalid_request"),
    ("short op id", lambda c, ids: c.post("/v1/workspaces/w1/sub-docs/d/ops",
        json={"op_id": "short", "op": OP}, headers=auth(API_KEY)), 422, "invalid_request"),
    ("unknown op type", lambda c, ids: c.post("/v1/workspaces/w1/sub-docs/d/ops",
        json={"op_id": new_op_id(), "op": {"type": "drop.table"}}, headers=auth(API_KEY)), 422,
        "invalid_request"),
    ("op id reused with another payload", lambda c, ids: c.post(
        "/v1/workspaces/w1/sub-docs/d/ops", json={"op_id": ids["op_id"], "op": {**OP, "value": 2}},
        headers=auth(API_KEY)), 409, "op_id_conflict"),
    ("strict input mismatch", lambda c, ids: c.post("/v1/workspaces/w1/requests",
        json={**NOOP, "job_id": "js", "input": {"value": 2}, "worker_class": PULL,
              "strict": True}, headers=auth(API_KEY)), 409, "input_mismatch"),
    ("negative clock", lambda c, ids: c.get("/v1/workspaces/w1/sub-docs/d/ops?since=-1",
        headers=auth(API_KEY)), 422, "invalid_request"),
    ("huge limit", lambda c, ids: c.get("/v1/workspaces/w1/requests?limit=100000",
        headers=auth(API_KEY)), 422, "invalid_request"),
]  # fmt: skip


@pytest.mark.security
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_security_case_gets_its_status_and_writes_nothing(
    client: httpx.Client, engine: Engine, case: Case
) -> None:
    _, call, status, code = case
    rid, token = _claimed(client)
    w2 = enqueue(client, "w2", OTHER_KEY, stage="noop", job_id="jw2", worker_class=HYP)
    op_id = new_op_id()
    first = client.post("/v1/workspaces/w1/sub-docs/d/ops", json={"op_id": op_id, "op": OP},
                        headers=auth(API_KEY))  # fmt: skip
    assert first.status_code == 201
    ids = {"claimed": rid, "token": token, "w2": w2.json()["request_id"], "op_id": op_id}
    before = snapshot(engine)
    response = call(client, ids)
    assert response.status_code == status, response.text
    if code:
        assert response.json()["code"] == code
    assert snapshot(engine) == before
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.security
def test_403_does_not_reveal_whether_an_id_exists(client: httpx.Client) -> None:
    w2 = enqueue(client, "w2", OTHER_KEY, stage="noop", job_id="jw2", worker_class=HYP)
    rid = w2.json()["request_id"]
    known = client.get(f"/v1/workspaces/w2/requests/{rid}", headers=auth(API_KEY))
    unknown = client.get(f"/v1/workspaces/w2/requests/{'0' * 64}", headers=auth(API_KEY))
    assert (known.status_code, known.json()) == (unknown.status_code, unknown.json())
    mine = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY))
    nothing = client.get(f"/v1/workspaces/w1/requests/{'0' * 64}", headers=auth(API_KEY))
    assert mine.status_code == nothing.status_code == 404
    assert mine.json()["code"] == nothing.json()["code"] == "not_found"


@pytest.fixture(scope="module")
def openapi_doc(api: str) -> dict[str, Any]:
    with httpx.Client(base_url=api) as http:
        doc: dict[str, Any] = http.get("/openapi.json").json()
    return doc


@pytest.mark.security
def test_openapi_documents_every_route_with_its_errors(openapi_doc: dict[str, Any]) -> None:
    paths = openapi_doc["paths"]
    assert set(paths) == {
        "/v1/workspaces/{ws}/requests", "/v1/workspaces/{ws}/requests/{request_id}",
        "/v1/workspaces/{ws}/counts", "/v1/workspaces/{ws}/events",
        "/v1/worker-classes/{wc}/claims", "/v1/claims/{request_id}/heartbeat",
        "/v1/claims/{request_id}/complete", "/v1/claims/{request_id}/fail",
        "/v1/claims/{request_id}/ops", "/v1/workspaces/{ws}/sub-docs/{sub_doc}",
        "/v1/workspaces/{ws}/sub-docs/{sub_doc}/ops", "/v1/claims/{request_id}/locks",
        "/v1/claims/{request_id}/locks/extend", "/v1/claims/{request_id}/locks/release",
        "/v1/claims/{request_id}/events", "/v1/claims/{request_id}/sub-docs",
        "/v1/claims/{request_id}/permits", "/v1/claims/{request_id}/permits/{permit_id}/settle",
        "/v1/claims/{request_id}/permits/{permit_id}/rate-limited",
        "/v1/claims/{request_id}/permits/{permit_id}/release",
        "/healthz", "/readyz",
    }  # fmt: skip
    for path in ("/healthz", "/readyz"):  # the probes: no key (a Kubernetes probe has none)
        assert "security" not in paths[path]["get"], path
    assert "503" in paths["/readyz"]["get"]["responses"]
    for path, item in paths.items():
        if path in ("/healthz", "/readyz"):
            continue
        for op in item.values():
            assert {"401", "403"} <= set(op["responses"]), op["operationId"]
            assert op["security"] == [{"HTTPBearer": []}]
    enqueue_op = paths["/v1/workspaces/{ws}/requests"]["post"]
    assert {"200", "201", "409", "413", "422"} <= set(enqueue_op["responses"])
    assert "204" in paths["/v1/worker-classes/{wc}/claims"]["post"]["responses"]
    replay = paths["/v1/workspaces/{ws}/sub-docs/{sub_doc}/ops"]["post"]["responses"]["200"]
    assert "Idempotent-Replayed" in replay["headers"]
    events = paths["/v1/workspaces/{ws}/events"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in events


@pytest.mark.security
def test_no_5xx_for_any_input_over_the_openapi_schema(
    client: httpx.Client, openapi_doc: dict[str, Any], runtime: Any
) -> None:
    stages = sorted(runtime.flow.stages)
    rid, token = _claimed(client)
    op_shapes = st.sampled_from(
        [OP, {"type": "node.insert", "node": "a"}, {"type": "merge", "patch": {"a": None}},
         {"type": "node.move", "node": "zz", "after": "a"}]
    ) | st.dictionaries(nasty_text, any_json, max_size=3)  # fmt: skip
    hints: dict[str, st.SearchStrategy[Any]] = {
        "stage": st.sampled_from(stages),
        "worker_class": st.just(HYP),
        "op": op_shapes,
        "claim_token": st.just(token) | st.text(max_size=40),
        "workspace_id": st.sampled_from(["w1", "w2"]) | nasty_text,  # the claim's, another's
        "input": st.fixed_dictionaries({"value": st.integers(-5, 5)}) | any_json,
        "wait": st.sampled_from([0, 0.01]),  # a long poll (claim, read): short, not up to 60 s
    }
    schemas = SchemaStrategies(openapi_doc, hints)
    ops = operations(openapi_doc)
    path_values = {
        "ws": st.sampled_from(["w1", "w2", "w-sse"]) | nasty_text,
        "wc": st.sampled_from([PULL, "t-default"]) | nasty_text,
        "request_id": st.sampled_from([rid, "0" * 64]) | nasty_text,
        "sub_doc": st.sampled_from(["d", "job:j1"]) | nasty_text,
    }
    keys = st.sampled_from(
        [auth(API_KEY), auth(WORKER_KEY), auth(OTHER_KEY), {}, auth("nope"),
         {"Authorization": "Bearer"}, {"Authorization": "bearer  " + API_KEY}]
    )  # fmt: skip
    statuses: list[int] = []

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=True,
    )
    @given(data=st.data())
    def one_call(data: st.DataObject) -> None:
        op = data.draw(st.sampled_from(ops), label="operation")
        path = op.path
        query: list[str] = []
        for param in op.spec.get("parameters", []):
            name, where = param["name"], param["in"]
            if where == "path":
                raw = data.draw(path_values.get(name, nasty_text), label=name)
                path = path.replace("{" + name + "}", path_value(raw))
            elif where == "query" and data.draw(st.booleans()):
                # A read's long poll (?wait=): short, not up to 60 s.
                drawn = hints["wait"] if name == "wait" else schemas.value(param["schema"])
                value = data.draw(drawn | nasty_text, label=name)
                values = value if isinstance(value, list) else [value]
                for v in values:
                    encoded = json.dumps(v) if not isinstance(v, str) else v
                    query.append(f"{name}={path_value(encoded)}")
        headers = dict(data.draw(keys, label="key"))
        content = None
        body_spec = op.spec.get("requestBody")
        if body_spec is not None:
            schema = body_spec["content"]["application/json"]["schema"]
            body = data.draw(schemas.value(schema), label="body")
            content = json.dumps(body).encode()  # ASCII escapes: lone surrogates travel too
            if data.draw(st.integers(0, 19)) == 0:
                content = data.draw(st.binary(max_size=64), label="raw body")
            headers["content-type"] = "application/json"
        url = path + ("?" + "&".join(query) if query else "")
        response = client.request(op.method, url, content=content, headers=headers)
        statuses.append(response.status_code)
        assert response.status_code < 500, (op.method, url, content, response.text)
        # Documented for the operation (404/405: a nasty id made the path another route's),
        # and every error is {"detail": <one line>, "code": ...}.
        # An empty path segment ("…/requests/") is Starlette's trailing-slash redirect: 307
        # (Starlette decodes %2F before routing: an id of "/" makes one too).
        decoded = urllib.parse.unquote(path)
        empty_segment = decoded.endswith("/") or "//" in decoded
        assert (
            str(response.status_code) in op.spec["responses"]
            or response.status_code in (404, 405)
            or (response.status_code == 307 and empty_segment)
        ), (op.method, url, response.status_code)
        if response.status_code >= 400:
            error = response.json()
            assert isinstance(error["detail"], str) and "\n" not in error["detail"], error
            assert isinstance(error["code"], str) and error["code"], error

    one_call()
    # The pass reached past authentication and validation, not only 401s.
    assert {200, 201} & set(statuses) and 401 in statuses and 403 in statuses
    # (Which handler-level refusals a derandomized pass reaches — 409 from a fence, 404 from
    # a lookup — shifts with the schema and the server's state; the fences' 409s have their
    # own tests. Validation's 422 is always reached.)
    assert 422 in statuses and {404, 409} & set(statuses), Counter(statuses)


# ---------------------------------------------------------------------- SSE


class EventReader(threading.Thread):
    """Reads an SSE stream on a thread: events and comments go to a queue."""

    def __init__(self, api: str, ws: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url = f"{api}/v1/workspaces/{ws}/events"
        self.key = key
        self.items: queue_mod.Queue[tuple[str, Any]] = queue_mod.Queue()
        self.stop = threading.Event()
        self.status: int | None = None
        self.seen: list[tuple[str, Any]] = []

    def run(self) -> None:
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=5)) as http,
            http.stream("GET", self.url, headers=auth(self.key)) as response,
        ):
            self.status = response.status_code
            event = "message"
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith(":"):
                    self.items.put(("comment", line))
                elif line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: "):
                    self.items.put((event, json.loads(line[len("data: ") :])))
                    event = "message"

    def next_event(self, kind: str, match: Callable[[Any], bool] = lambda _: True) -> Any:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                got_kind, value = self.items.get(timeout=1)
            except queue_mod.Empty:
                continue
            self.seen.append((got_kind, value))
            if got_kind == kind and match(value):
                return value
        raise AssertionError(f"no {kind} event within 30 s; saw {self.seen}")


def test_sse_subscriber_receives_the_commit_of_a_stage_write(
    client: httpx.Client, api: str, redis_url: str, celery_worker: Any, runtime: Any
) -> None:
    reader = EventReader(api, "w-sse", API_KEY)
    reader.start()
    try:
        ready = reader.next_event("ready")
        assert ready["workspace_id"] == "w-sse"
        # Another workspace's commit is not this stream's business.
        OpLog(runtime.flow.queue.engine).apply_op("w2", "job:jx", OP, new_op_id())
        answer = enqueue(client, "w-sse", API_KEY, stage="write_cell", job_id="jx",
                         input={"column": "fit", "value": 3})  # fmt: skip
        assert answer.status_code == 201
        commit = reader.next_event("commit", lambda e: e["sub_doc"] == "job:jx")
        assert commit["workspace_id"] == "w-sse" and commit["clock"] == 1
        assert commit["op_id"].startswith("stg-") and commit["type"] == "cell.set"
        assert all(v.get("workspace_id") != "w2" for k, v in reader.seen if k != "comment")
        # Broadcast after commit: what the event announces is readable at once.
        doc = client.get("/v1/workspaces/w-sse/sub-docs/job:jx", headers=auth(API_KEY)).json()
        assert doc["clock"] >= 1 and doc["state"]["cells"]["fit"] == 3
        reader.next_event("comment")  # keep-alives flow while idle
    finally:
        reader.stop.set()
        reader.join(timeout=10)
    assert reader.status == 200
    # The client is gone: the server unsubscribes.
    r = redis_lib.Redis.from_url(redis_url)
    channel = workspace_channel("w-sse")
    wait_for(lambda: dict(r.pubsub_numsub(channel)).get(channel.encode(), 0) == 0,
             what="the server to drop the subscription")  # fmt: skip


# ------------------------------------------------------------ HTTP transport


class DropFirstResponse(httpx.BaseTransport):
    """Forwards requests; the first response is lost after the server handled it."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.calls = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        response = self.inner.handle_request(request)
        if self.calls == 1:
            response.read()
            response.close()
            raise httpx.ReadError("connection reset after the server committed")
        return response


def test_http_transport_applies_once_and_a_retry_gets_the_original_clock(
    client: httpx.Client, api: str
) -> None:
    transport = HttpTransport(api, API_KEY)
    ws_client = WorkspaceClient(transport, "w1")
    first = ws_client.apply("board", NodeInsert(node="a"))
    assert first is not None and first.clock == 1 and not first.duplicate

    flaky = DropFirstResponse()
    retrying = WorkspaceClient(
        HttpTransport(api, API_KEY, client=httpx.Client(base_url=api, transport=flaky)), "w1"
    )
    second = retrying.apply("board", NodeInsert(node="b", after="a"))
    assert second is not None
    assert retrying.retries == 1 and flaky.calls == 2
    assert second.clock == 2 and second.duplicate  # the retry got the original clock
    ops = transport.ops_since("w1", "board")
    assert [o.clock for o in ops] == [1, 2]
    assert transport.get_sub_doc("w1", "board").state["order"] == ["a", "b"]

    op_id = ops[1].op_id
    with pytest.raises(OpIdConflict):
        transport.apply("w1", "board", {"type": "node.insert", "node": "c"}, op_id, None)
    with pytest.raises(AccessDenied):
        HttpTransport(api, "of_wrong").apply("w1", "board", {"type": "node.insert", "node": "d"},
                                             new_op_id(), None)  # fmt: skip
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TransportError):
        HttpTransport(closed, API_KEY, timeout=2).apply(
            "w1", "board", {"type": "node.insert", "node": "e"}, new_op_id(), None
        )
    assert [o.clock for o in transport.ops_since("w1", "board")] == [1, 2]


@pytest.mark.security
def test_ids_that_cannot_be_one_url_segment_are_refused_by_the_client(api: str) -> None:
    from onceflow import InvalidRequest

    with pytest.raises(InvalidRequest):
        HttpTransport(api, API_KEY).apply("w/1", "board", OP, new_op_id(), None)
    with pytest.raises(InvalidRequest):
        HttpTransport(api, API_KEY).apply("w1", "..", OP, new_op_id(), None)


# --------------------------------------------------------- compute locks over HTTP


def _claim_two_of_one_job(client: httpx.Client) -> list[tuple[str, str]]:
    """Two claimed requests of the same job (two branches): two holders racing one cell."""
    held = []
    job = f"jl-{secrets.token_hex(4)}"  # a lock left by an earlier run on this Redis is not ours
    for branch in ("a", "b"):
        enqueue(client, "w1", API_KEY, stage="noop", job_id=job, branch_path=branch,
                input={"value": 1}, worker_class=PULL)  # fmt: skip
        answer = client.post(
            f"/v1/worker-classes/{PULL}/claims", json={"worker_id": branch},
            headers=auth(WORKER_KEY),
        )  # fmt: skip
        assert answer.status_code == 201, answer.text
        _TOKENS_SEEN.append(answer.json()["claim_token"])
        held.append((answer.json()["request_id"], answer.json()["claim_token"]))
    return held


def test_http_compute_lock_one_holder_a_waiter_and_the_release_broadcast(
    client: httpx.Client, redis_url: str
) -> None:
    (rid_a, tok_a), (rid_b, tok_b) = _claim_two_of_one_job(client)
    pubsub = redis_lib.Redis.from_url(redis_url).pubsub()
    pubsub.subscribe(workspace_channel("w1"))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]

    def lock(rid: str, token: str, action: str = "", **body: Any) -> httpx.Response:
        path = f"/v1/claims/{rid}/locks" + (f"/{action}" if action else "")
        return client.post(path, json={"claim_token": token, "task": "eval:fit", **body},
                           headers=auth(WORKER_KEY))  # fmt: skip

    first = lock(rid_a, tok_a, ttl_seconds=30)
    assert first.status_code == 201 and first.json()["acquired"] is True, first.text
    lock_token = first.json()["lock_token"]
    _TOKENS_SEEN.append(lock_token)
    second = lock(rid_b, tok_b)
    assert second.status_code == 200, second.text
    assert second.json()["locked"] is True and second.json()["acquired"] is False
    assert 0 < second.json()["remaining_ms"] <= 30_000 and second.json()["job_id"].startswith("jl-")
    # Another holder's token cannot extend or release it; the holder's can.
    assert lock(rid_b, tok_b, "extend", lock_token="not-the-token").json() == {"held": False}
    assert lock(rid_a, tok_a, "extend", lock_token=lock_token).json() == {"held": True}
    stolen = lock(rid_b, tok_b, "release", lock_token="not-the-token", outcome="computed")
    assert stolen.json() == {"released": False}
    assert lock(rid_b, tok_b).json()["locked"] is True  # still held by a
    released = lock(rid_a, tok_a, "release", lock_token=lock_token, outcome="computed")
    assert released.json() == {"released": True}
    kinds = []
    deadline = time.monotonic() + 10
    while "lock_released" not in kinds and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1)
        if message and message["type"] == "message":
            kinds.append(json.loads(message["data"])["kind"])
    assert "lock_released" in kinds
    assert lock(rid_b, tok_b).status_code == 201  # free again: the waiter takes it
    pubsub.close()


def test_only_a_release_that_released_is_counted_and_announced(
    client: httpx.Client, redis_url: str
) -> None:
    (rid, token), _ = _claim_two_of_one_job(client)
    r = redis_lib.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    pubsub.subscribe(workspace_channel("w1"))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]

    def post(action: str, **body: Any) -> dict[str, Any]:
        answer = client.post(f"/v1/claims/{rid}/locks{action}", headers=auth(WORKER_KEY),
                             json={"claim_token": token, "task": "eval:x", **body})  # fmt: skip
        assert answer.status_code < 300, answer.text
        out: dict[str, Any] = answer.json()
        return out

    got = post("", ttl_seconds=3600)
    _TOKENS_SEEN.append(got["lock_token"])
    assert got["ttl_ms"] <= 60_000  # cut to ONCEFLOW_LOCK_TTL_SECONDS: a closed tab holds no hour
    counters = counters_key("w1")
    before = r.hgetall(counters)
    forged = post("/release", lock_token="forged", outcome="failed")
    assert forged == {"released": False}
    assert post("/release", lock_token=got["lock_token"], outcome="abandoned")["released"]
    again = post("/release", lock_token=got["lock_token"], outcome="computed")  # a retry
    assert again == {"released": False}
    messages = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not messages:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            messages.append(json.loads(message["data"]))
    assert pubsub.get_message(timeout=0.5) is None  # exactly one announcement
    assert [(m["kind"], m["ok"]) for m in messages] == [("lock_released", False)]
    assert r.hgetall(counters) == before  # abandoned counts nothing; the others released nothing
    pubsub.close()


def test_a_claim_holder_follows_its_workspace_events_and_no_one_else(
    client: httpx.Client, api: str
) -> None:
    (rid, token), _ = _claim_two_of_one_job(client)
    url = f"/v1/claims/{rid}/events"
    forged = client.post(url, json={"claim_token": "forged"}, headers=auth(WORKER_KEY))
    assert forged.status_code == 409
    with (
        httpx.Client(base_url=api, timeout=10) as http,
        http.stream("POST", url, json={"claim_token": token}, headers=auth(WORKER_KEY)) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert "event: ready" in [next(lines), next(lines)]  # after the `retry:` hint
        write = client.post(f"/v1/claims/{rid}/ops", headers=auth(WORKER_KEY), json={
            "claim_token": token, "sub_doc": "doc-ev", "key": "k1",
            "op": {"type": "node.insert", "node": "a"},
        })  # fmt: skip
        assert write.status_code == 201, write.text
        seen = []
        for line in lines:
            seen.append(line)
            if line.startswith("data: ") and "commit" in line:
                break
        assert "event: commit" in seen
        read = client.post(f"/v1/claims/{rid}/sub-docs", headers=auth(WORKER_KEY),
                           json={"claim_token": token, "sub_doc": "doc-ev"})  # fmt: skip
        assert read.status_code == 200 and read.json()["clock"] >= 1, read.text
        assert "a" in json.dumps(read.json()["state"])
        done = client.post(f"/v1/claims/{rid}/complete", headers=auth(WORKER_KEY),
                           json={"claim_token": token, "result": {}})  # fmt: skip
        assert done.status_code == 200, done.text
        after = []
        deadline = time.monotonic() + 10  # keep-alives come every 0.5 s: the loop gets here
        for line in lines:  # the claim is over: the stream ends (no more of the workspace)
            after.append(line)
            if time.monotonic() > deadline:
                break
        assert "event: end" in after
    read = client.post(f"/v1/claims/{rid}/sub-docs", json={"claim_token": token,
                       "sub_doc": "doc-ev"}, headers=auth(WORKER_KEY))  # fmt: skip
    assert read.status_code == 409  # after the claim: no read either
    forged_read = client.post(f"/v1/claims/{rid}/sub-docs",
                              json={"claim_token": "forged", "sub_doc": "doc-ev"},
                              headers=auth(WORKER_KEY))  # fmt: skip
    assert forged_read.status_code == 409


def test_http_compute_lock_needs_a_live_claim_and_a_good_task(client: httpx.Client) -> None:
    (rid, token), _ = _claim_two_of_one_job(client)
    url = f"/v1/claims/{rid}/locks"
    forged = client.post(url, json={"claim_token": "forged", "task": "t"}, headers=auth(WORKER_KEY))
    assert forged.status_code == 409 and forged.json()["code"] == "lease_lost"
    as_api_key = client.post(url, json={"claim_token": token, "task": "t"}, headers=auth(API_KEY))
    assert as_api_key.status_code == 403
    bad = client.post(url, json={"claim_token": token, "task": ""}, headers=auth(WORKER_KEY))
    assert bad.status_code == 422
    done = client.post(f"/v1/claims/{rid}/complete", json={"claim_token": token, "result": {}},
                       headers=auth(WORKER_KEY))  # fmt: skip
    assert done.status_code == 200, done.text
    late = client.post(url, json={"claim_token": token, "task": "t"}, headers=auth(WORKER_KEY))
    assert late.status_code == 409  # the claim ended: no new lock for it


@pytest.mark.security
@pytest.mark.parametrize("ttl", ["5", True, "1e1"], ids=["string", "bool", "string-float"])
def test_lock_bodies_are_strict_and_a_coerced_ttl_changes_nothing(
    client: httpx.Client, redis_url: str, ttl: Any
) -> None:
    """No type coercion, as every other body (``"5"`` was once a 5 s lock and ``true`` a
    1 s one)."""
    (rid, token), _ = _claim_two_of_one_job(client)
    job = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()["job_id"]
    r = redis_lib.Redis.from_url(redis_url)
    url = f"/v1/claims/{rid}/locks"

    def post(path: str, **body: Any) -> httpx.Response:
        return client.post(path, json={"claim_token": token, **body}, headers=auth(WORKER_KEY))

    counters = r.hgetall(counters_key("w1"))
    refused = post(url, task="t-coerced", ttl_seconds=ttl)
    assert refused.status_code == 422, refused.text
    assert refused.json()["code"] == "invalid_request"
    assert not r.exists(lock_key("w1", job, "t-coerced"))  # no lock taken
    # A number is a number (an integer too); extending with a coerced TTL changes nothing.
    held = post(url, task="t-held", ttl_seconds=30)
    assert held.status_code == 201, held.text
    lock_token = held.json()["lock_token"]
    _TOKENS_SEEN.append(lock_token)
    extend = post(f"{url}/extend", task="t-held", lock_token=lock_token, ttl_seconds=ttl)
    assert extend.status_code == 422, extend.text
    assert 0 < r.pttl(lock_key("w1", job, "t-held")) <= 30_000  # not extended
    assert r.hgetall(counters_key("w1")) == counters
    released = post(f"{url}/release", task="t-held", lock_token=lock_token, outcome="abandoned")
    assert released.json() == {"released": True}


def test_the_sdk_is_served_as_es_modules_with_an_etag(client: httpx.Client) -> None:
    index = client.get("/sdk/index.js")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/javascript")
    assert 'from "./transport.js"' in index.text
    again = client.get("/sdk/index.js", headers={"If-None-Match": index.headers["etag"]})
    assert again.status_code == 304
    assert client.get("/sdk/index.d.ts").status_code == 200
    for missing in ("/sdk/package.json", "/sdk/..%2Fapp.py", "/sdk/test", "/sdk/nope.js"):
        assert client.get(missing).status_code == 404, missing


def test_an_http_claim_gets_the_lease_its_stage_declares(client: httpx.Client) -> None:
    rid = enqueue(client, "w1", API_KEY, stage="leased_pull", job_id="jlease",
                  input={"value": 1}).json()["request_id"]  # fmt: skip
    answer = client.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "lw"}, headers=auth(WORKER_KEY)
    )
    assert answer.status_code == 201 and answer.json()["request_id"] == rid, answer.text
    _TOKENS_SEEN.append(answer.json()["claim_token"])
    assert answer.json()["lease_seconds"] == 3.0  # the stage's, not the server's 30 s default
    row = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()
    assert row["lease_expires_at"] == answer.json()["lease_expires_at"]


def test_a_worker_retrying_writes_whose_answers_were_lost_gets_the_original_answers(
    client: httpx.Client,
) -> None:
    """A pull worker repeats a call whose answer it lost, after that call committed and ended
    its claim: the completion (with a hand-off) and an earlier op are recognised as its own
    (200, the original answer), not refused as a lost lease."""
    rid = enqueue(client, "w1", API_KEY, stage="noop", job_id="jlost", input={"value": 1},
                  worker_class=PULL).json()["request_id"]  # fmt: skip
    claimed = client.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "lost"}, headers=auth(WORKER_KEY)
    )
    assert claimed.status_code == 201 and claimed.json()["request_id"] == rid, claimed.text
    token = claimed.json()["claim_token"]
    _TOKENS_SEEN.append(token)
    op = {"claim_token": token, "sub_doc": "job:jlost", "key": "c",
          "op": {"type": "cell.set", "column": "c", "value": 1}}  # fmt: skip
    first_op = client.post(f"/v1/claims/{rid}/ops", json=op, headers=auth(WORKER_KEY))
    assert first_op.status_code == 201, first_op.text
    then = [{"stage": "noop", "input": {"value": 2}, "branch_path": "after-lost"}]
    body = {"claim_token": token, "result": {"ok": 1}, "then": then}
    done = client.post(f"/v1/claims/{rid}/complete", json=body, headers=auth(WORKER_KEY))
    assert done.status_code == 200, done.text
    # Both answers were lost: the worker sends the same calls again, the claim now over.
    again = client.post(f"/v1/claims/{rid}/complete", json=body, headers=auth(WORKER_KEY))
    assert again.status_code == 200, again.text
    assert again.json()["status"] == "succeeded" and again.json()["result"] == {"ok": 1}
    replay = client.post(f"/v1/claims/{rid}/ops", json=op, headers=auth(WORKER_KEY))
    assert replay.status_code == 200, replay.text
    assert replay.json() == {**first_op.json(), "duplicate": True}
    follow = client.get("/v1/workspaces/w1/requests?job_id=jlost&stage=noop",
                        headers=auth(API_KEY)).json()["requests"]  # fmt: skip
    assert [r["branch_path"] for r in follow if r["request_id"] != rid] == ["after-lost"]
    # The same op id with another payload is a conflict; a new op under the ended claim and a
    # forged token are refused as before.
    other = {**op, "op": {"type": "cell.set", "column": "c", "value": 2}}
    conflict = client.post(f"/v1/claims/{rid}/ops", json=other, headers=auth(WORKER_KEY))
    assert conflict.status_code == 409 and conflict.json()["code"] == "op_id_conflict"
    fresh = client.post(f"/v1/claims/{rid}/ops", json={**op, "key": "d"}, headers=auth(WORKER_KEY))
    assert fresh.status_code == 409 and fresh.json()["code"] == "lease_lost"
    forged = client.post(f"/v1/claims/{rid}/complete", json={**body, "claim_token": "f" * 32},
                         headers=auth(WORKER_KEY))  # fmt: skip
    assert forged.status_code == 409 and forged.json()["code"] == "lease_lost"


# ----------------------------------------------- the claimed request's workspace in the body


def test_every_claim_call_finds_the_request_by_the_workspace_it_names(
    client: httpx.Client, api: str, engine: Engine
) -> None:
    """``workspace_id`` in a claim call's body: the request is found by its key. Another
    workspace than the request's is the same 409 lease_lost as a forged token, and changes
    nothing (no row, no lock); the claim's own workspace is served as without it."""
    (rid, token), (rid_b, token_b) = _claim_two_of_one_job(client)
    row = client.get(f"/v1/workspaces/w1/requests/{rid}", headers=auth(API_KEY)).json()
    assert row["workspace_id"] == "w1"

    def post(action: str, ws: Any, **body: Any) -> httpx.Response:
        sent = {"claim_token": token, "workspace_id": ws, **body}
        return client.post(f"/v1/claims/{rid}/{action}", json=sent, headers=auth(WORKER_KEY))

    task = {"task": "eval:ws"}
    op = {"sub_doc": "doc-ws", "key": "k", "op": {"type": "node.insert", "node": "a"}}
    calls: list[tuple[str, dict[str, Any]]] = [
        ("heartbeat", {}), ("ops", op), ("sub-docs", {"sub_doc": "doc-ws"}), ("locks", task),
        ("locks/extend", {**task, "lock_token": "lt"}),
        ("locks/release", {**task, "lock_token": "lt", "outcome": "computed"}),
        ("events", {}), ("fail", {"error": "x"}), ("complete", {"result": {"by": "w2"}}),
    ]  # fmt: skip
    before = snapshot(engine)
    for action, body in calls:
        for ws in ("w2", "ws-unknown"):  # another workspace's, or none's
            answer = post(action, ws, **body)
            assert answer.status_code == 409, (action, ws, answer.text)
            assert answer.json()["code"] == "lease_lost", (action, answer.text)
        for bad in ("", "a\x00b", 5, "x" * 201):  # checked like any id: 422
            answer = post(action, bad, **body)
            assert answer.status_code == 422, (action, bad, answer.text)
    assert snapshot(engine) == before

    # The claim's own workspace: every call is served.
    beat = post("heartbeat", "w1")
    assert beat.status_code == 200 and beat.json()["cancel_requested"] is False, beat.text
    assert post("ops", "w1", **op).status_code == 201
    assert post("sub-docs", "w1", sub_doc="doc-ws").json()["clock"] == 1
    got = post("locks", "w1", **task)
    assert got.status_code == 201 and got.json()["acquired"] is True, got.text  # none was taken
    lock_token = got.json()["lock_token"]
    _TOKENS_SEEN.append(lock_token)
    assert post("locks/extend", "w1", **task, lock_token=lock_token).json() == {"held": True}
    released = post("locks/release", "w1", **task, lock_token=lock_token, outcome="computed")
    assert released.json() == {"released": True}
    with (
        httpx.Client(base_url=api, timeout=10) as http,
        http.stream("POST", f"/v1/claims/{rid}/events", headers=auth(WORKER_KEY),
                    json={"claim_token": token, "workspace_id": "w1"}) as stream,
    ):  # fmt: skip
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert "event: ready" in [next(lines), next(lines)]
    done = post("complete", "w1", result={"by": "w1"})
    assert done.status_code == 200 and done.json()["result"] == {"by": "w1"}, done.text
    failed = client.post(f"/v1/claims/{rid_b}/fail", headers=auth(WORKER_KEY),
                         json={"claim_token": token_b, "workspace_id": "w1", "error": "x",
                               "retryable": False})  # fmt: skip
    assert failed.status_code == 200 and failed.json()["status"] == "dead", failed.text


def test_the_python_pull_worker_sends_the_claims_workspace(client: httpx.Client, api: str) -> None:
    """Every later call of a claim carries the claim answer's ``request.workspace_id``: the
    same claim with another workspace in its request is refused on every call (found by
    the key it names, not by its id), and served with its own."""
    import dataclasses

    enqueue(client, "w1", API_KEY, stage="noop", job_id="jpy", input={"value": 1},
            worker_class=PULL)  # fmt: skip
    with PullWorker(api, WORKER_KEY, PULL, lease_seconds=30) as worker:
        claim = worker.claim()
        assert claim is not None and claim.workspace_id == "w1"
        _TOKENS_SEEN.append(claim.token)
        moved = dataclasses.replace(claim, request={**claim.request, "workspace_id": "w2"})
        assert moved.workspace_id == "w2"
        op = {"type": "cell.set", "column": "c", "value": 1}
        refused: list[Callable[[], Any]] = [
            lambda: worker.heartbeat(moved),
            lambda: worker.apply_op(moved, "job:jpy", op, key="c"),
            lambda: worker.read_sub_doc(moved, "job:jpy"),
            lambda: worker.acquire_lock(moved, "eval:py"),
            lambda: worker.extend_lock(moved, "eval:py", "lt"),
            lambda: worker.release_lock(moved, "eval:py", "lt", "computed"),
            lambda: worker.claim_events(moved),
            lambda: worker.fail(moved, {"type": "Wrong"}),
            lambda: worker.complete(moved, {"by": "w2"}),
        ]
        for call in refused:
            with pytest.raises(LeaseLost):
                call()
        assert worker.heartbeat(claim) is False
        assert worker.apply_op(claim, "job:jpy", op, key="c").clock == 1
        assert worker.read_sub_doc(claim, "job:jpy").clock == 1
        got = worker.acquire_lock(claim, "eval:py")
        assert got["acquired"] is True  # the refused acquire took nothing
        _TOKENS_SEEN.append(got["lock_token"])
        assert worker.extend_lock(claim, "eval:py", got["lock_token"]) is True
        assert worker.release_lock(claim, "eval:py", got["lock_token"], "computed") is True

        def live_events() -> Any:
            # Served for the claim's own workspace (a refused one raised LeaseLost above).
            # A stream the server could not start yet (503 while Redis confirms the
            # subscription) is "unavailable" with a Retry-After: open it again, as a client
            # does.
            events = worker.claim_events(claim)
            if events.ended is None:
                return events
            events.close()
            return None

        wait_for(live_events, timeout=60, interval=0.5, what="a live event stream").close()
        done = worker.complete(claim, {"by": "w1"})
    assert done["status"] == "succeeded" and done["result"] == {"by": "w1"}
