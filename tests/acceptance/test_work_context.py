"""``WorkContext``: one body, the same members, under a Celery stage and a Python pull worker.

A real ``onceflow api`` and a real Celery worker for ``tests.acceptance.context_stages``, real
Postgres and Redis; the provider is the counting stand-in (``tests/integration/standin.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from onceflow import LeaseLost
from onceflow.cache import CacheKey
from onceflow.context import WorkContext
from onceflow.errors import InvalidRequest, PermanentError
from onceflow.integrations.fastapi import hash_key
from onceflow.integrations.pull import PullContext, PullWorker
from onceflow.locks import Locked
from onceflow.oplog import SubDoc
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.context_stages import CELERY, IDLE, PULL, shared_body
from tests.acceptance.procs import ROOT, free_port, started_together, wait_for, worker_args
from tests.integration.standin import StandIn

pytestmark = pytest.mark.slow

APP = "tests.acceptance.context_stages:flow"
API_KEY = "of_test_api_key_ctx_0123456789abcdef"  # workspace w-ctx
WORKER_KEY = "of_test_worker_key_ctx_0123456789ab"  # worker class t-ctx-pull
WS = "w-ctx"
_TOKENS_SEEN: list[str] = []


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """A real `onceflow api` for the context stages and a real Celery worker of ``t-ctx``,
    started side by side; the API's base URL."""
    tmp = tmp_path_factory.mktemp("ctx")
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
        "ONCEFLOW_API_SSE_KEEPALIVE_SECONDS": "0.5",
    }
    port = free_port()
    api_args = ["api", "--app", APP, "--port", str(port), "--log-level", "info"]
    with started_together(
        tmp,
        ("api.log", api_args, "Application startup complete"),
        ("worker.log", worker_args(CELERY, app=APP, name="ctx"), " ready."),
        env=env,
    ) as (api_proc, _):
        yield f"http://127.0.0.1:{port}"
    for secret in (API_KEY, WORKER_KEY, *_TOKENS_SEEN):  # never logged
        assert secret not in api_proc.log()


@pytest.fixture()
def client(api: str, clean_db: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, timeout=10) as http:
        yield http


@pytest.fixture()
def standin() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.stop()


def enqueue(http: httpx.Client, **body: Any) -> str:
    answer = http.post(f"/v1/workspaces/{WS}/requests", json=body, headers=auth(API_KEY))
    assert answer.status_code == 201, answer.text
    rid: str = answer.json()["request_id"]
    return rid


def row(http: httpx.Client, rid: str) -> dict[str, Any]:
    answer = http.get(f"/v1/workspaces/{WS}/requests/{rid}", headers=auth(API_KEY))
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


def run_under_celery(http: httpx.Client, api: str, job: str, provider: str) -> str:
    rid = enqueue(http, stage="ctx_body", job_id=job, input={"value": 7, "provider": provider})
    wait_for(lambda: row(http, rid)["status"] in ("succeeded", "dead"), timeout=60,
             what="the Celery stage to finish")  # fmt: skip
    return rid


def run_under_pull(http: httpx.Client, api: str, job: str, provider: str) -> str:
    rid = enqueue(http, stage="ctx_body", job_id=job, worker_class=PULL,
                  input={"value": 7, "provider": provider})  # fmt: skip
    with PullWorker(api, WORKER_KEY, PULL, lease_seconds=10) as worker:

        def body(ctx: PullContext) -> dict[str, Any]:
            _TOKENS_SEEN.append(ctx.claim.token)
            return shared_body(ctx)

        assert worker.run_once(body, wait=5) is not None
    return rid


@pytest.mark.parametrize("runner", [run_under_celery, run_under_pull], ids=["celery", "pull"])
def test_one_body_gives_the_same_results_under_celery_and_a_pull_worker(
    runner: Any, client: httpx.Client, api: str, standin: StandIn
) -> None:
    job = f"jb-{runner.__name__.split('_')[-1]}"
    rid = runner(client, api, job, standin.url)
    stored = row(client, rid)
    assert stored["status"] == "succeeded", stored["error"]
    text = json.dumps(stored["result"]).replace(rid, "RID").replace(job, "JOB")
    assert json.loads(text) == {
        "interface": True,
        "ids": ["RID", WS, "JOB", "ctx_body", ""],
        "claim_request_id": "RID",
        "token_is_str": True,
        "attempt": 1,
        "input": {"value": 7, "provider": standin.url},
        "lease_lost": False,
        "cancel_requested": False,
        "before": ["SubDoc", 0, {}],
        "written": ["ApplyResult", 1, False],
        "after": ["SubDoc", 1, {"a": 7}],
        "compute_once": [
            {"value": "answer-JOB-1", "path": "computed"},
            {"value": "answer-JOB-1", "path": "preflight"},
        ],
    }
    assert standin.calls == {job: 1}  # one paid call; the second run found it stored
    query = {"job_id": job, "stage": "ctx_next"}
    listed = client.get(f"/v1/workspaces/{WS}/requests", params=query, headers=auth(API_KEY))
    follow = listed.json()["requests"]
    assert [(r["branch_path"], r["worker_class"], r["input"]) for r in follow] == [
        ("next", IDLE, {"value": 8})
    ]


def test_two_pull_worker_processes_racing_for_one_cell_pay_one_provider_call(
    client: httpx.Client, api: str, standin: StandIn
) -> None:
    job = "jrace"
    standin.block_next(job)  # the leader's call is held until the other one waits
    racers = [  # started first: they import while the requests are enqueued, then long-poll
        subprocess.Popen(
            [sys.executable, "-m", "tests.acceptance.pull_racer", api, WORKER_KEY, PULL],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    rids = [
        enqueue(client, stage="ctx_race", job_id=job, branch_path=branch,
                input={"value": 1, "provider": standin.url})
        for branch in ("a", "b")
    ]  # fmt: skip
    try:
        wait_for(lambda: standin.calls[job] == 1 and standin.marks[job] >= 1, timeout=60,
                 what="one racer to call the provider while the other waits")  # fmt: skip
        standin.unblock(job)
        outputs = [p.communicate(timeout=60)[0].strip() for p in racers]
    finally:
        for p in racers:
            p.kill()
    assert outputs == ["succeeded", "succeeded"]
    assert standin.calls == {job: 1}  # exactly one provider call
    results = sorted((row(client, rid)["result"] for rid in rids), key=lambda r: r["path"])
    value = f"answer-{job}-1"
    assert results == [
        {"value": value, "path": "computed", "served_by": None},
        {"value": value, "path": "waited", "served_by": "broadcast"},  # the release broadcast
    ]
    doc = client.get(f"/v1/workspaces/{WS}/sub-docs/job:{job}", headers=auth(API_KEY)).json()
    assert doc["clock"] == 1 and doc["state"]["cells"] == {"race": value}


def test_a_pull_context_whose_lease_lapsed_reads_and_locks_nothing(
    client: httpx.Client, api: str
) -> None:
    rid = enqueue(client, stage="ctx_body", job_id="jlost", worker_class=PULL,
                  input={"value": 1, "provider": "http://unused"})  # fmt: skip
    with (
        PullWorker(api, WORKER_KEY, PULL, lease_seconds=1, worker_id="zombie") as zombie,
        PullWorker(api, WORKER_KEY, PULL, lease_seconds=30, worker_id="successor") as successor,
    ):
        old = zombie.claim()
        assert old is not None and old.request_id == rid
        _TOKENS_SEEN.append(old.token)
        ctx = PullContext(zombie, old)  # no heartbeat thread: the lease lapses
        assert isinstance(ctx, WorkContext)
        read = ctx.read_sub_doc("job:jlost")
        assert isinstance(read, SubDoc) and read.clock == 0
        new = wait_for(successor.claim, what="the lapsed lease to be claimed again")
        _TOKENS_SEEN.append(new.token)
        assert not ctx.lease_lost  # the context has not heard yet: the server fences the read
        with pytest.raises(LeaseLost):
            ctx.read_sub_doc("job:jlost")
        calls: list[str] = []
        with pytest.raises(LeaseLost):
            ctx.compute_once("eval:x", check=lambda: None, compute=lambda: calls.append("x"),
                             store=lambda v: None)  # fmt: skip
        assert calls == []  # no provider call without the claim
        with pytest.raises(LeaseLost):
            ctx.heartbeat()
        assert ctx.lease_lost
        successor.complete(new, {"by": "successor"})


def test_a_pull_context_refuses_the_result_cache_before_asking_anything(
    client: httpx.Client, api: str
) -> None:
    """The result cache is not offered to pull workers: ``cache=`` is InvalidRequest, no
    check, no lock, no compute; the claim's compute lock works as without it."""
    rid = enqueue(client, stage="ctx_body", job_id="jcache", worker_class=PULL,
                  input={"value": 1, "provider": "http://unused"})  # fmt: skip
    with PullWorker(api, WORKER_KEY, PULL, lease_seconds=30) as worker:
        claim = worker.claim()
        assert claim is not None and claim.request_id == rid
        _TOKENS_SEEN.append(claim.token)
        ctx = PullContext(worker, claim)
        calls: list[str] = []
        for extra in ({"cache": CacheKey("workspace", "prompt", ttl=60)}, {"result_cache": None}):
            with pytest.raises(InvalidRequest, match="not offered to pull workers"):
                ctx.compute_once("eval:c", check=lambda: calls.append("check"),
                                 compute=lambda: calls.append("compute") or 1,
                                 store=lambda v: calls.append("store"), **extra)  # fmt: skip
        assert calls == []
        out = ctx.compute_once("eval:c", check=lambda: None, compute=lambda: 7,
                               store=lambda v: calls.append("store"))  # fmt: skip
        assert (out.value, out.path.value, calls) == (7, "computed", ["store"])
        worker.complete(claim, {"ok": True})


def test_a_waiter_woken_by_a_failed_release_leads_and_its_stream_is_closed(
    client: httpx.Client, api: str
) -> None:
    """The holder's compute fails: its release announces ok=false on the claim's event
    stream, the waiter wakes (no polling), takes the lock and computes; ``wait=False``
    meanwhile answers Locked; the stream the waiter opened is closed after."""
    for branch in ("a", "b"):
        enqueue(client, stage="ctx_race", job_id="jfail", branch_path=branch,
                input={"value": 1, "provider": "http://unused"})  # fmt: skip
    with (
        PullWorker(api, WORKER_KEY, PULL, lease_seconds=30, worker_id="holder") as holder,
        PullWorker(api, WORKER_KEY, PULL, lease_seconds=30, worker_id="waiter") as waiter,
    ):
        first, second = holder.claim(), waiter.claim()
        assert first is not None and second is not None
        _TOKENS_SEEN.extend([first.token, second.token])
        lead, other = PullContext(holder, first), PullContext(waiter, second)
        waiting = threading.Event()
        calls: list[str] = []
        outcomes: list[Any] = []

        def compute(ctx: PullContext, value: str) -> str:
            calls.append(ctx.worker_id)
            return value

        def run_waiter() -> None:
            outcomes.append(other.compute_once(
                "eval:f", check=lambda: None, compute=lambda: compute(other, "second"),
                store=lambda v: None, on_wait=waiting.set,
            ))  # fmt: skip

        waiter_thread = threading.Thread(target=run_waiter)

        def failing() -> str:
            compute(lead, "first")
            waiter_thread.start()
            assert waiting.wait(30), "the waiter never waited"
            locked = other.compute_once("eval:f", check=lambda: None, compute=lambda: "no",
                                        store=lambda v: None, wait=False)  # fmt: skip
            assert isinstance(locked, Locked)
            raise RuntimeError("provider down")

        with pytest.raises(RuntimeError, match="provider down"):
            lead.compute_once("eval:f", check=lambda: None, compute=failing, store=lambda v: None)
        waiter_thread.join(timeout=30)
    assert calls == ["holder", "waiter"]  # one call each, one after the other
    [outcome] = outcomes
    assert (outcome.value, str(outcome.path), outcome.rounds) == ("second", "computed", 2)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "onceflow-pull-events"],
             what="the claim's event stream reader to end")  # fmt: skip


def test_a_pull_worker_records_an_error_the_store_could_not_take(
    client: httpx.Client, api: str
) -> None:
    # A body's error with a NUL (a provider's bytes) and a lone surrogate: before, the
    # server refused the report (422), nothing was recorded, and the request ran again
    # once its lease lapsed; now the error is sent storable and the request dies once.
    rid = enqueue(client, stage="ctx_body", job_id="jb-unstorable", worker_class=PULL,
                  input={"value": 1, "provider": "http://127.0.0.1:1"})  # fmt: skip
    with PullWorker(api, WORKER_KEY, PULL, lease_seconds=10) as worker:

        def body(ctx: PullContext) -> dict[str, Any]:
            raise PermanentError("bad bytes: b'\x00' and \udcff")

        assert worker.run_once(body, wait=5) == "dead"
    stored = row(client, rid)
    assert stored["status"] == "dead"
    assert stored["error"]["message"] == "bad bytes: b'\\x00' and \\udcff"
