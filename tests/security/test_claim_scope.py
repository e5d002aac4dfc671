"""A pull worker holding one claim reaches only its own request's data, through the real API.

Against a real `onceflow api` (uvicorn), real Postgres and Redis, with a worker key of one
pull-worker class holding one claim:

* ``POST /v1/claims/{id}/sub-docs`` and ``…/ops`` reach only the sub-docs the claimed
  stage declares (``sub_docs``; by default its job's, ``job:{job_id}`` and
  ``job:{job_id}:*``): another client's ``billing`` sub-doc, or another job's, is 403 —
  before, it was read and overwritten;
* ``POST /v1/claims/{id}/events`` streams only the claimed request's news (commits to its
  scope's sub-docs, lock news of its own job) — before, every event of the workspace;
* ``complete`` hands off only to the stages the claimed stage declares (``hands_off_to``;
  none by default): before, one completion created 100 rows of any stage, a paid
  Celery-class one included; and each follow-up counts against the key's rate limit.

Every refusal leaves the tables (requests, sub-docs, op log) and Redis (the workspace's
keys, the broker queues) as they were, and the claim running.
"""

from __future__ import annotations

import json
import queue as queue_mod
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.errors import InvalidRequest
from onceflow.integrations.fastapi import create_app, hash_key
from onceflow.keys import queue_name, workspace_channel
from onceflow.locks.base import released_message
from onceflow.oplog import OpLog, new_op_id
from onceflow.tasks import Flow
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import api_server
from tests.acceptance.test_http_api import auth, snapshot
from tests.security.scope_stages import PAID, PULL, StepInput

pytestmark = pytest.mark.slow

APP = "tests.security.scope_stages:flow"
API_KEY = "of_test_scope_api_key_0123456789abcdef"  # workspace w-scope
WORKER_KEY = "of_test_scope_worker_key_0123456789ab"  # worker class t-scope-tab
WS = "w-scope"
OP = {"type": "cell.set", "column": "c", "value": 1}
RATE = 40  # a day (no window boundary within a test), on the rate-limited server


def _env(**extra: str) -> dict[str, str]:
    return {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
        "ONCEFLOW_API_SSE_KEEPALIVE_SECONDS": "0.5",
        "ONCEFLOW_API_RATE_LIMIT": "",
        **extra,
    }


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    with api_server(tmp_path_factory.mktemp("api-scope"), _env(), APP) as (url, proc):
        yield url
    assert "Traceback" not in proc.log(), proc.log()[-3000:]


@pytest.fixture()
def client(api: str, clean_db: Engine, redis_url: str) -> Iterator[httpx.Client]:
    r = redis_lib.Redis.from_url(redis_url)
    r.delete(queue_name(PAID), queue_name(PULL))
    with httpx.Client(base_url=api, timeout=30) as http:
        yield http


def enqueue(http: httpx.Client, stage: str, job: str, branch: str = "") -> str:
    body = {"stage": stage, "job_id": job, "branch_path": branch, "input": {"value": 1}}
    answer = http.post(f"/v1/workspaces/{WS}/requests", json=body, headers=auth(API_KEY))
    assert answer.status_code == 201, answer.text
    rid: str = answer.json()["request_id"]
    return rid


def claim(http: httpx.Client) -> tuple[str, str]:
    answer = http.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "tab"}, headers=auth(WORKER_KEY)
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["request_id"], answer.json()["claim_token"]


def claimed(http: httpx.Client, stage: str, job: str) -> tuple[str, str]:
    rid = enqueue(http, stage, job)
    got, token = claim(http)
    assert got == rid
    return rid, token


def api_write(http: httpx.Client, sub_doc: str, value: int) -> None:
    """Another client (an API key of the workspace) writes ``sub_doc``."""
    op = {"type": "cell.set", "column": "secret", "value": value}
    answer = http.post(f"/v1/workspaces/{WS}/sub-docs/{sub_doc}/ops",
                       json={"op_id": new_op_id(), "op": op}, headers=auth(API_KEY))  # fmt: skip
    assert answer.status_code == 201, answer.text


def redis_state(redis_url: str) -> dict[bytes, Any]:
    """The workspace's Redis keys (locks, counters) and the broker queues of both classes."""
    r = redis_lib.Redis.from_url(redis_url)
    keys = set(r.scan_iter(match=f"onceflow:{{{WS}}}:*"))
    state: dict[bytes, Any] = {k: r.dump(k) for k in keys}
    for wc in (PAID, PULL):
        state[queue_name(wc).encode()] = r.lrange(queue_name(wc), 0, -1)
    return state


def status_of(http: httpx.Client, rid: str) -> str:
    answer = http.get(f"/v1/workspaces/{WS}/requests/{rid}", headers=auth(API_KEY))
    assert answer.status_code == 200, answer.text
    status: str = answer.json()["status"]
    return status


def assert_forbidden(answer: httpx.Response, *words: str) -> None:
    assert answer.status_code == 403, answer.text
    body = answer.json()
    assert body["code"] == "forbidden", body
    for word in words:
        assert word in body["detail"], body


# ------------------------------------------------------------------- sub-docs


def test_a_claim_reads_no_sub_doc_outside_its_stages_scope(
    client: httpx.Client, engine: Engine, redis_url: str
) -> None:
    api_write(client, "billing", 900)
    api_write(client, "job:j2", 7)
    rid, token = claimed(client, "tab_eval", "j1")
    before, redis_before = snapshot(engine), redis_state(redis_url)
    url = f"/v1/claims/{rid}/sub-docs"
    for other in ("billing", "job:j2", "job:j10", "job:j", "jobs:j1"):
        answer = client.post(url, json={"claim_token": token, "sub_doc": other},
                             headers=auth(WORKER_KEY))  # fmt: skip
        assert_forbidden(answer, repr(other), "job:{job_id}, job:{job_id}:*", "sub_docs")
        assert "900" not in answer.text
    assert snapshot(engine) == before and redis_state(redis_url) == redis_before
    for own in ("job:j1", "job:j1:notes"):  # its job's sub-docs: read as before
        answer = client.post(url, json={"claim_token": token, "sub_doc": own},
                             headers=auth(WORKER_KEY))  # fmt: skip
        assert answer.status_code == 200 and answer.json()["sub_doc"] == own, answer.text
    assert status_of(client, rid) == "running"


def test_a_claim_writes_no_sub_doc_outside_its_stages_scope(
    client: httpx.Client, engine: Engine, redis_url: str
) -> None:
    api_write(client, "billing", 900)
    rid, token = claimed(client, "tab_eval", "j1")
    before, redis_before = snapshot(engine), redis_state(redis_url)
    pubsub = redis_lib.Redis.from_url(redis_url).pubsub()
    pubsub.subscribe(workspace_channel(WS))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    url = f"/v1/claims/{rid}/ops"
    for n, other in enumerate(("billing", "job:j2", "job:j10:x")):
        for ident in ({"key": f"k{n}"}, {"op_id": new_op_id()}):
            answer = client.post(url, json={"claim_token": token, "sub_doc": other, "op": OP,
                                            **ident}, headers=auth(WORKER_KEY))  # fmt: skip
            assert_forbidden(answer, repr(other), "job:{job_id}")
    assert snapshot(engine) == before and redis_state(redis_url) == redis_before
    own = client.post(url, json={"claim_token": token, "sub_doc": "job:j1", "op": OP,
                                 "key": "own"}, headers=auth(WORKER_KEY))  # fmt: skip
    assert own.status_code == 201, own.text
    # Nothing was broadcast for the refused writes: the first message is the own commit.
    message = pubsub.get_message(timeout=5)
    assert message is not None and json.loads(message["data"])["sub_doc"] == "job:j1"
    pubsub.close()
    doc = client.get(f"/v1/workspaces/{WS}/sub-docs/billing", headers=auth(API_KEY)).json()
    assert doc["clock"] == 1 and doc["state"]["cells"] == {"secret": 900}
    assert status_of(client, rid) == "running"


def test_a_stage_that_declares_sub_docs_reaches_those_and_no_others(
    client: httpx.Client, engine: Engine
) -> None:
    rid, token = claimed(client, "tab_board", "j1")
    url = f"/v1/claims/{rid}/ops"

    def write(sub_doc: str) -> httpx.Response:
        return client.post(url, json={"claim_token": token, "sub_doc": sub_doc, "op": OP,
                                      "op_id": new_op_id()}, headers=auth(WORKER_KEY))  # fmt: skip

    for allowed in ("job:j1", f"board:{WS}", f"notes:{rid}:a", f"notes:{rid}:"):
        assert write(allowed).status_code == 201, allowed
    before = snapshot(engine)
    for refused in ("job:j1:x", "board:w-other", f"notes:{rid}", "notes:other:a", "billing"):
        assert_forbidden(write(refused), "board:{workspace_id}", "notes:{request_id}:*")
    assert snapshot(engine) == before


# ------------------------------------------------------------------- events


class ClaimEvents(threading.Thread):
    """A claim's event stream, read by a thread: its events in a queue, as they come."""

    def __init__(self, api: str, rid: str, token: str) -> None:
        super().__init__(daemon=True)
        self.url = f"{api}/v1/claims/{rid}/events"
        self.token = token
        self.items: queue_mod.Queue[tuple[str, Any]] = queue_mod.Queue()
        self.stop = threading.Event()

    def run(self) -> None:
        with (
            httpx.Client(timeout=httpx.Timeout(10, read=5)) as http,
            http.stream(
                "POST", self.url, json={"claim_token": self.token}, headers=auth(WORKER_KEY)
            ) as response,  # fmt: skip
        ):
            assert response.status_code == 200
            event = "message"
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: "):
                    self.items.put((event, json.loads(line[len("data: ") :])))

    def until(self, kind: str, match: Any = lambda _: True) -> list[tuple[str, Any]]:
        """Every event up to the first ``kind`` event that matches (that one included)."""
        seen: list[tuple[str, Any]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                got = self.items.get(timeout=1)
            except queue_mod.Empty:
                continue
            seen.append(got)
            if got[0] == kind and match(got[1]):
                return seen
        raise AssertionError(f"no {kind} event within 30 s; saw {seen}")


def test_a_claims_event_stream_carries_only_its_own_requests_news(
    client: httpx.Client, api: str, engine: Engine, redis_url: str
) -> None:
    rid, token = claimed(client, "tab_eval", "j1")
    reader = ClaimEvents(api, rid, token)
    reader.start()
    try:
        reader.until("ready")
        oplog = OpLog(engine)
        r = redis_lib.Redis.from_url(redis_url)
        channel = workspace_channel(WS)
        # Published in this order on one channel: whatever the stream forwards of the
        # first four arrives before the last two.
        oplog.apply_op(WS, "job:j2", OP, new_op_id())  # another job's commit
        oplog.apply_op(WS, "billing", OP, new_op_id())  # a sub-doc outside the scope
        r.publish(channel, json.dumps(released_message("j2", "eval:c", ok=True)))
        r.publish(channel, json.dumps({"kind": "note", "job_id": "j1"}))  # not a kind it knows
        r.publish(channel, json.dumps(released_message("j1", "eval:c", ok=True)))  # its job's
        oplog.apply_op(WS, "job:j1:cells", OP, new_op_id())  # in its scope
        seen = reader.until("commit", lambda e: e["sub_doc"] == "job:j1:cells")
    finally:
        reader.stop.set()
    assert [(kind, e.get("sub_doc") or e.get("job_id")) for kind, e in seen] == [
        ("lock_released", "j1"), ("commit", "job:j1:cells"),
    ], seen  # fmt: skip


# ------------------------------------------------------------------- hand-offs


def _complete(http: httpx.Client, rid: str, token: str, then: list[dict[str, Any]]) -> Any:
    return http.post(f"/v1/claims/{rid}/complete", headers=auth(WORKER_KEY),
                     json={"claim_token": token, "result": {"ok": 1}, "then": then})  # fmt: skip


def _many(stage: str, n: int) -> list[dict[str, Any]]:
    return [{"stage": stage, "input": {"value": i}, "branch_path": f"b{i}"} for i in range(n)]


def test_a_stage_that_declares_no_targets_hands_off_nowhere(
    client: httpx.Client, engine: Engine, redis_url: str
) -> None:
    rid, token = claimed(client, "tab_eval", "j1")
    before, redis_before = snapshot(engine), redis_state(redis_url)
    for then in (_many("paid_call", 100), _many("tab_next", 1), _many("tab_eval", 1)):
        answer = _complete(client, rid, token, then)
        assert_forbidden(answer, "'tab_eval' may not hand off", "hands_off_to: none")
        assert snapshot(engine) == before and redis_state(redis_url) == redis_before
    assert status_of(client, rid) == "running"
    beat = client.post(f"/v1/claims/{rid}/heartbeat", json={"claim_token": token},
                       headers=auth(WORKER_KEY))  # fmt: skip
    assert beat.status_code == 200, beat.text  # the claim is intact
    done = _complete(client, rid, token, [])
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text


def test_a_stage_hands_off_only_to_its_declared_targets(
    client: httpx.Client, engine: Engine, redis_url: str
) -> None:
    rid, token = claimed(client, "tab_step", "j1")
    before, redis_before = snapshot(engine), redis_state(redis_url)
    for then in (_many("paid_call", 1), [*_many("tab_next", 3), *_many("paid_call", 1)]):
        answer = _complete(client, rid, token, then)
        assert_forbidden(answer, "'paid_call'", "hands_off_to: tab_next")
        assert snapshot(engine) == before and redis_state(redis_url) == redis_before
    assert status_of(client, rid) == "running"
    done = _complete(client, rid, token, _many("tab_next", 2))
    assert done.status_code == 200, done.text
    rows = snapshot(engine)["workspace_process_requests"]
    assert len(rows) == len(before["workspace_process_requests"]) + 2


@pytest.fixture(scope="module")
def limited_api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """A server whose keys may make RATE requests a day (its own in-memory counters)."""
    env = _env(ONCEFLOW_API_RATE_LIMIT=f"{RATE}/day")
    with api_server(tmp_path_factory.mktemp("api-scope-rl"), env, APP) as (url, _):
        yield url


def test_every_follow_up_counts_against_the_keys_rate_limit(
    limited_api: str, clean_db: Engine, redis_url: str, engine: Engine
) -> None:
    with httpx.Client(base_url=limited_api, timeout=30) as http:
        # The API key's calls are its own budget; the worker key's: claim 1, the rest below.
        rid, token = claimed(http, "tab_step", "j1")
        before, redis_before = snapshot(engine), redis_state(redis_url)
        # 1 (the call) + 60 follow-ups > the 39 left: refused before anything is written.
        answer = _complete(http, rid, token, _many("tab_next", 60))
        assert answer.status_code == 429, answer.text
        assert answer.json()["code"] == "rate_limited" and "Retry-After" in answer.headers
        assert snapshot(engine) == before and redis_state(redis_url) == redis_before
        assert status_of(http, rid) == "running"
        # 1 + 30 of the 38 left: written; the key has 7 requests left.
        done = _complete(http, rid, token, _many("tab_next", 30))
        assert done.status_code == 200, done.text
        assert len(snapshot(engine)["workspace_process_requests"]) == 31

        def beat() -> httpx.Response:  # one unit each (409 now: the claim is over)
            return http.post(f"/v1/claims/{rid}/heartbeat", json={"claim_token": token},
                             headers=auth(WORKER_KEY))  # fmt: skip

        assert [beat().status_code for _ in range(7)] == [409] * 7
        assert beat().status_code == 429


def test_a_hand_off_target_that_is_no_stage_is_refused_at_start_up() -> None:
    flow = Flow(name="onceflow-sec-typo")
    flow.stage("first", input=StepInput, worker_class=PULL, hands_off_to=("secnod",))(
        lambda ctx, data: None
    )
    flow.stage("second", input=StepInput, worker_class=PULL)(lambda ctx, data: None)
    with pytest.raises(InvalidRequest, match="hands_off_to names 'secnod', which is not a"):
        create_app(flow)
