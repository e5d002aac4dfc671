"""Attacks on routing and on the broker, against a real API server, Celery worker and Redis.

A client never chooses where work goes: the worker class comes from the stage's
declaration (an enqueue naming any other class is refused, nothing written, no Redis
key touched); every broker queue onceflow uses is ``onceflow.wc.<class>``; and a worker
survives any message or key a client of the broker's Redis could plant there.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow import Status
from onceflow.errors import InvalidRequest
from onceflow.keys import lock_key, queue_name
from onceflow.queue import Queue
from tests.acceptance.procs import start_worker, wait_for
from tests.acceptance.test_http_api import API_KEY, auth, snapshot
from tests.integration.lock_callers import APIS, run_compute_once

FOREIGN_NAMES = [
    "unacked_index",  # kombu's own sorted set: a list there killed every worker
    "unacked",
    "_kombu.binding.onceflow.wc.t-default",
    "onceflow:{w2}:lock:j:t",  # another workspace's compute lock: its waiters hung
    "onceflow",  # the maintenance queue
    "t-block",  # a class another stage declares
    "onceflow.wc.t-default",
    "other-app:queue",
]


def redis_keys(redis_url: str) -> set[bytes]:
    return set(redis_lib.Redis.from_url(redis_url).keys("*"))


def status(runtime: Any, rid: str) -> Status:
    return runtime.flow.queue.get(rid).status  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", FOREIGN_NAMES)
def test_an_enqueue_cannot_route_work_to_a_class_the_stage_does_not_declare(
    client: httpx.Client, clean_db: Engine, redis_url: str, name: str
) -> None:
    before_rows, before_keys = snapshot(clean_db), redis_keys(redis_url)
    body = {"stage": "noop", "job_id": "j-route", "input": {"value": 1}, "worker_class": name}
    response = client.post("/v1/workspaces/w1/requests", json=body, headers=auth(API_KEY))
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "invalid_request"
    assert "served by worker class 't-default'" in response.json()["detail"]
    assert snapshot(clean_db) == before_rows
    assert redis_keys(redis_url) == before_keys


def test_the_declared_class_is_used_and_the_worker_keeps_serving(
    client: httpx.Client, celery_worker: Any, runtime: Any, redis_url: str
) -> None:
    for name in FOREIGN_NAMES:  # the attacks first
        body = {"stage": "noop", "job_id": "j-a", "input": {}, "worker_class": name}
        client.post("/v1/workspaces/w1/requests", json=body, headers=auth(API_KEY))
    body = {"stage": "noop", "job_id": "j-ok", "input": {"value": 2}}
    response = client.post("/v1/workspaces/w1/requests", json=body, headers=auth(API_KEY))
    assert response.status_code == 201, response.text
    rid = response.json()["request_id"]
    wait_for(lambda: status(runtime, rid) is Status.SUCCEEDED, what="the noop to succeed")
    assert celery_worker.popen.poll() is None
    # Every key in the broker's Redis is onceflow's (or kombu's/Celery's own): none is
    # named by a worker class, none is a foreign key a client could have named.
    keys = {k.decode() for k in redis_keys(redis_url)}
    assert not keys & {"t-default", "t-block", "onceflow:{w2}:lock:j:t", "other-app:queue"}
    r = redis_lib.Redis.from_url(redis_url)
    assert r.type("unacked_index") in (b"zset", b"none")
    assert r.type("unacked") in (b"hash", b"none")


def test_a_bare_queue_refuses_a_worker_class_that_could_name_a_foreign_key(
    clean_db: Engine, redis_url: str
) -> None:
    queue = Queue()
    for name in ["onceflow:{w2}:lock:j:t", "_kombu.binding.x", "a b", "", "x" * 101, "-x"]:
        with pytest.raises(InvalidRequest, match="is not a worker class"):
            queue.enqueue("noop", "w1", "j", "", {}, worker_class=name)
    assert snapshot(clean_db)["workspace_process_requests"] == []


def _envelope(task: str = "onceflow.stage.noop", args: Any = None, **headers: Any) -> dict:
    args = ["0" * 64] if args is None else args
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    body = base64.b64encode(json.dumps([args, {}, embed]).encode()).decode()
    tid = str(uuid.uuid4())
    return {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": task, "id": tid, "root_id": tid, "retries": 0,
                    "timelimit": [None, None], "ignore_result": True, **headers},
        "properties": {
            "correlation_id": tid, "delivery_mode": 2, "priority": 0, "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": "x"},
            "delivery_tag": str(uuid.uuid4()),
        },
    }  # fmt: skip


def hostile_items() -> Iterator[tuple[str, str]]:
    """Queue items a client of the broker's Redis could push, each once fatal to a worker."""
    yield "not JSON", "garbage{"
    yield "a JSON array", "[]"
    yield "an object kombu's decoder cannot build (uuid)", '{"__type__": "uuid", "__value__": 1}'
    yield "an object kombu's decoder cannot build (bytes)", '{"__type__": "bytes", "__value__": 1}'
    env = _envelope()
    env["headers"]["x"] = {"__type__": "datetime", "__value__": 5}
    yield "a header kombu's decoder cannot build", json.dumps(env)
    yield "JSON null", "null"
    yield "nested 100,000 deep", "[" * 100_000 + "]" * 100_000
    env = _envelope()
    env["body"] = "!!!not base64"
    yield "a body that is not base64", json.dumps(env)
    env = _envelope()
    env["headers"] = "x"
    yield "headers that are not an object", json.dumps(env)
    env = _envelope()
    env["properties"]["delivery_info"] = "x"
    yield "delivery_info that is not an object", json.dumps(env)
    yield "timelimit that is not a pair", json.dumps(_envelope(timelimit="x"))
    env = _envelope()
    env["body"] = base64.b64encode(b'{"a": 1}').decode()
    yield "a body that is not [args, kwargs, embed]", json.dumps(env)
    yield "args that are not a request id", json.dumps(_envelope(args=[{"x": 1}, 2]))
    yield "an unknown task", json.dumps(_envelope(task="nope.unknown"))
    yield "a bad eta", json.dumps(_envelope(eta="garbage"))


@pytest.mark.slow
def test_a_worker_survives_hostile_messages_and_wrong_typed_keys(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    r = redis_lib.Redis.from_url(redis_url)
    wc = "t-hostile"  # a class no other worker of the suite consumes
    q = queue_name(wc)
    r.delete(q, "unacked", "unacked_index", "unacked_mutex")
    worker = start_worker(tmp_path, wc)
    try:
        items = list(hostile_items())
        for _, item in items:
            r.lpush(q, item)
        first = runtime.flow.enqueue("noop", "w1", "j-after-hostile", "main", {}, worker_class=wc)
        wait_for(lambda: status(runtime, first.request_id) is Status.SUCCEEDED,
                 what="a good request after the hostile messages")  # fmt: skip
        assert worker.popen.poll() is None
        log = worker.log()
        # Each was logged, and dropped or rejected.
        assert log.count("dropped a broker message") == 9, log
        assert log.count("rejected a message") + log.count("rejected task") == 3, log

        # Broadcasts (the pidbox of remote control) go through the same decoder.
        db = r.connection_pool.connection_kwargs.get("db", 0)
        for item in ('{"__type__": "bytes", "__value__": 1}', "[" * 100_000 + "]" * 100_000):
            r.publish(f"/{db}.celery.pidbox", item)
        wait_for(lambda: worker.log().count("broadcast: dropped a broker message") >= 2,
                 what="both broadcasts dropped")  # fmt: skip
        assert worker.popen.poll() is None

        # A queue key with the wrong type: the wake-up cannot even be sent (the row stays
        # queued), the worker renames the key aside, the sweeper re-sends the wake-up.
        r.delete(q)
        r.set(q, "poison")
        lost = runtime.flow.enqueue("noop", "w1", "j-poisoned-queue", "main", {}, worker_class=wc)
        wait_for(lambda: status(runtime, lost.request_id) is Status.SUCCEEDED,
                 what="the request whose wake-up was lost to the poisoned queue")  # fmt: skip
        assert r.keys(f"{q}.wrongtype.*"), "the poisoned key is kept aside for inspection"

        # kombu's own keys with the wrong type: healed the same way, the worker serves on.
        # Planted only while absent: another worker of the suite may hold a message there.
        plant = r.register_script(
            "if redis.call('exists', KEYS[1]) == 0 then "
            "return redis.call('lpush', KEYS[1], 'x') end return 0"
        )
        for key in ("unacked", "unacked_index"):
            wait_for(lambda key=key: plant(keys=[key]), what=f"{key} planted as a list")
        last = runtime.flow.enqueue("noop", "w1", "j-poisoned-unacked", "main", {}, worker_class=wc)
        wait_for(lambda: status(runtime, last.request_id) is Status.SUCCEEDED,
                 what="a request after kombu's keys were poisoned")  # fmt: skip
        assert r.type("unacked") in (b"hash", b"none")
        assert r.type("unacked_index") in (b"zset", b"none")
        assert worker.popen.poll() is None
    finally:
        worker.stop()
        for key in r.keys("*.wrongtype.*"):
            r.delete(key)


@pytest.mark.parametrize("api", APIS)
def test_a_lock_key_without_ttl_does_not_hang_its_waiters(
    api: str, clean_db: Engine, redis_url: str
) -> None:
    """A value planted at a compute lock's key (no TTL: never one of onceflow's locks)
    made every waiter wait forever; it is deleted and the call computes once."""
    r = redis_lib.Redis.from_url(redis_url)
    key = lock_key("w-lock", "j", "t")
    r.delete(key)
    r.lpush(key, "planted")
    calls: list[int] = []
    stored: dict[str, int] = {}

    def call() -> int:
        outcome = run_compute_once(
            api, "w-lock", "j", "t",
            check=lambda: stored.get("v"),
            compute=lambda: calls.append(1) or 42,
            store=lambda v: stored.__setitem__("v", v),
        )  # fmt: skip
        return outcome.value

    # In a thread with a deadline: before the fix this call never returned.
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(call).result(timeout=30) == 42
    assert len(calls) == 1
    assert not r.exists(key)


def test_upgrading_from_unprefixed_queues_loses_no_wake_up(
    clean_db: Engine, redis_url: str
) -> None:
    """A wake-up sent before the upgrade waits in the old queue (``up-llm``): the new
    workers consume it with ONCEFLOW_LEGACY_QUEUES, and without it the sweeper re-sends
    the row's wake-up to ``onceflow.wc.up-llm``."""
    from pydantic import BaseModel

    from onceflow.settings import Settings
    from onceflow.tasks import Flow

    class Empty(BaseModel):
        pass

    r = redis_lib.Redis.from_url(redis_url)
    r.delete("up-llm", queue_name("up-llm"))
    settings = Settings(legacy_queues=True)
    flow = Flow(name="upgrade-test", settings=settings)

    @flow.stage("up", input=Empty, worker_class="up-llm")
    def up(ctx: Any, data: Empty) -> None:
        return None

    assert flow.broker_queues() == [queue_name("up-llm"), "up-llm", "onceflow.upgrade-test"]
    assert Flow(name="upgrade-plain").broker_queues(["up-llm"]) == [
        queue_name("up-llm"),
        "onceflow.upgrade-plain",
    ]
    # A row dispatched by the old code: its wake-up went to the unprefixed queue.
    [old] = flow.queue.enqueue_many([flow.new_request("up", "w1", "j-old", "", {})])
    with clean_db.begin() as conn:
        conn.execute(
            text(
                "UPDATE workspace_process_requests SET dispatched_at = now() WHERE request_id = :r"
            ),
            {"r": old.request_id},
        )
    r.lpush("up-llm", "an old wake-up")
    swept = flow.sweep_once(redispatch_after=0)
    assert [d.request_id for d in swept.to_dispatch] == [old.request_id]
    assert r.llen(queue_name("up-llm")) == 1  # re-sent to the new queue
    r.delete("up-llm", queue_name("up-llm"))


def test_a_row_stored_with_a_class_that_names_a_foreign_key_gets_no_wake_up(
    clean_db: Engine, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A row written before worker classes were checked (an attacker's) is never sent to its
    foreign name, and does not make the sweep's backlog check give up."""
    from pydantic import BaseModel

    from onceflow.tasks import Flow

    class Empty(BaseModel):
        pass

    flow = Flow(name="legacy-rows")

    @flow.stage("lr", input=Empty, worker_class="lr-good")
    def lr(ctx: Any, data: Empty) -> None:
        return None

    foreign = "onceflow:{w2}:lock:j:t"
    r = redis_lib.Redis.from_url(redis_url)
    r.delete(foreign, queue_name("lr-good"))
    [bad] = flow.queue.enqueue_many([flow.new_request("lr", "w1", "j-bad", "", {})])
    with clean_db.begin() as conn:
        conn.execute(
            text("UPDATE workspace_process_requests SET worker_class = :wc WHERE request_id = :r"),
            {"wc": foreign, "r": bad.request_id},
        )
    flow.queue.enqueue_many([flow.new_request("lr", "w1", "j-good", "", {})])
    assert flow.broker_backlog([foreign, "lr-good"]) == {foreign: 0, "lr-good": 0}
    flow.sweep_once(redispatch_after=0)
    assert not r.exists(foreign)
    assert r.llen(queue_name("lr-good")) == 1  # the good row's wake-up went out
    assert "is not one onceflow can route to" in caplog.text
    r.delete(queue_name("lr-good"))
