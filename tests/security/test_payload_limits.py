"""Deep and non-finite JSON, as an attacker with one key sends it.

Against a real `onceflow api` (uvicorn), the real pull-worker client, the real stdio MCP
server and CLI, and the Python API: a payload nested deeper than
``ONCEFLOW_MAX_PAYLOAD_DEPTH`` (64 here, the default) or holding NaN / ±Infinity /
``1e400`` is refused on every path with 422 ``invalid_request`` (a clear error) and writes
nothing; a body nested past what the parser can take is refused before it is parsed. Rows
written before the limit existed (inserted with SQL, 300 and 2000 levels deep) never make a
read, a list, a claim or a worker fail: the too-deep value is served as a placeholder.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from onceflow import InvalidRequest, Status
from onceflow.integrations.fastapi import hash_key
from onceflow.integrations.pull import PullContext, PullWorker
from onceflow.models.ops import CellSet
from onceflow.oplog import InProcessTransport, OpLog, WorkspaceClient, new_op_id
from onceflow.queue import Queue
from onceflow.tasks.runtime import run_request
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, api_server
from tests.acceptance.test_http_api import auth, snapshot
from tests.security import payload_stages
from tests.security.payload_stages import PULL

pytestmark = pytest.mark.slow

APP = "tests.security.payload_stages:flow"
API_KEY = "of_test_payload_api_key_0123456789abcdef"  # workspace w-sec
WORKER_KEY = "of_test_payload_worker_key_0123456789ab"  # worker class t-sec-pull
WS = "w-sec"
LIMIT = 64  # ONCEFLOW_MAX_PAYLOAD_DEPTH's default
UNREADABLE = "onceflow_unreadable"
JSON_CT = {"content-type": "application/json"}


def nested(depth: int) -> Any:
    """A value whose arrays nest ``depth`` levels (``nested(0)`` is a scalar)."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def nested_text(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def depth_of(value: Any) -> int:
    """Nesting depth of a decoded JSON value (iterative)."""
    best, stack = 0, [(value, 0)]  # (item, how many containers hold it)
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict | list):
            best = max(best, d + 1)
            stack.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return best


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """A real `onceflow api` process serving the free-form stages; its base URL."""
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
    }
    with api_server(tmp_path_factory.mktemp("api-payloads"), env, APP) as (url, proc):
        yield url
    log_text = proc.log()
    assert "Traceback" not in log_text, log_text[-3000:]  # no 500 on any of these paths
    assert API_KEY not in log_text and WORKER_KEY not in log_text


@pytest.fixture()
def client(api: str, clean_db: Engine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, timeout=30) as http:
        yield http


def _enqueue(http: httpx.Client, job: str, input: Any) -> str:
    body = {"stage": "free", "job_id": job, "input": input}
    answer = http.post(f"/v1/workspaces/{WS}/requests", json=body, headers=auth(API_KEY))
    assert answer.status_code == 201, answer.text
    rid: str = answer.json()["request_id"]
    return rid


def _claim(http: httpx.Client) -> tuple[str, str]:
    answer = http.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "sec"}, headers=auth(WORKER_KEY)
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["request_id"], answer.json()["claim_token"]


# ------------------------------------------------------------------------ the scan itself

_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_depth_scan_counts_what_the_parser_nests(value: Any) -> None:
    """Brackets, quotes and backslashes inside strings never fool the byte scan."""
    from onceflow.payloads import json_depth

    if "Infinity" in json.dumps(value):
        return  # st.floats() includes ±inf as floats; JSON has no such number
    for encoded in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
        assert json_depth(encoded) == depth_of(value), encoded
        assert json_depth(encoded.encode()) == depth_of(value), encoded


# ------------------------------------------------------------------ refusals over HTTP


def _request_body(input_text: str) -> bytes:
    return ('{"stage": "free", "job_id": "jx", "input": ' + input_text + "}").encode()


def _op_body(op_text: str) -> bytes:
    return ('{"op_id": "' + new_op_id() + '", "op": ' + op_text + "}").encode()


def _merge(patch_depth: int) -> str:
    """A merge op whose patch nests ``patch_depth`` levels (the op one more)."""
    return '{"type": "merge", "patch": {"a": ' + nested_text(patch_depth - 1) + "}}"


ENQUEUE = f"/v1/workspaces/{WS}/requests"
OPS = f"/v1/workspaces/{WS}/sub-docs/d/ops"

# (name, path, body, detail fragment): every one answers 422 invalid_request, writes nothing.
WORKSPACE_CASES = [
    ("input one level over the limit", ENQUEUE,
     _request_body('{"deep": ' + nested_text(LIMIT) + "}"), "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
    ("input 255 levels deep", ENQUEUE,
     _request_body('{"deep": ' + nested_text(254) + "}"), "levels deep"),
    ("body 900 levels deep", ENQUEUE, _request_body(nested_text(899)), "levels deep"),
    ("body 5000 levels deep", ENQUEUE, b"[" * 5000 + b"]" * 5000, "levels deep"),
    ("NaN in an input", ENQUEUE, _request_body('{"x": NaN}'), "NaN"),
    ("Infinity in an input", ENQUEUE, _request_body('{"x": [Infinity]}'), "NaN"),
    ("-Infinity in an input", ENQUEUE, _request_body('{"x": -Infinity}'), "NaN"),
    ("1e400 in an input", ENQUEUE, _request_body('{"x": 1e400}'), "too large"),
    ("1e400 in a float field", ENQUEUE, _request_body('{"ratio": -1.5e400}'), "too large"),
    ('"Infinity" parsed by a float field', ENQUEUE, _request_body('{"ratio": "Infinity"}'),
     "NaN or Infinity"),
    ("merge op one level over the limit", OPS, _op_body(_merge(LIMIT)),
     "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
    ("merge op 255 levels deep", OPS, _op_body(_merge(254)), "levels deep"),
    ("cell.set value 1e400", OPS, _op_body('{"type": "cell.set", "column": "c", "value": 1e400}'),
     "too large"),
    ("NaN in an op", OPS, _op_body('{"type": "cell.set", "column": "c", "value": NaN}'), "NaN"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "path", "body", "detail"), WORKSPACE_CASES, ids=[c[0] for c in WORKSPACE_CASES]
)
def test_deep_or_non_finite_payload_is_refused_and_writes_nothing(
    client: httpx.Client, engine: Engine, name: str, path: str, body: bytes, detail: str
) -> None:
    _enqueue(client, "j0", {"a": 1})  # something in the tables
    before = snapshot(engine)
    answer = client.post(path, content=body, headers={**auth(API_KEY), **JSON_CT})
    assert answer.status_code == 422, answer.text
    assert answer.json()["code"] == "invalid_request"
    assert detail in answer.json()["detail"]
    assert snapshot(engine) == before


def test_a_body_the_scan_cannot_read_is_refused_and_one_typed_oddly_is_scanned(
    client: httpx.Client, engine: Engine
) -> None:
    # Python's json (so FastAPI) reads UTF-16 and UTF-32 bodies, which the byte scan cannot;
    # and FastAPI reads a content type as email.message does ("application/json\xa0" is
    # JSON to it). Before: both went to the parser unscanned (NaN reached the payload
    # checks, a 5,000-deep body the parser's recursion).
    _enqueue(client, "j0", {"a": 1})
    before = snapshot(engine)
    headers = {**auth(API_KEY), **JSON_CT}
    for body in (
        _request_body('{"x": NaN}').decode().encode("utf-16"),
        (b"[" * 5000 + b"]" * 5000).decode().encode("utf-32"),
        _request_body('{"x": 1}').decode().encode("utf-16-le"),  # no byte-order mark
    ):
        answer = client.post(ENQUEUE, content=body, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json() == {
            "detail": "the request body is not UTF-8 JSON",
            "code": "bad_request",
        }
    odd = {**auth(API_KEY), "content-type": b"application/json\xa0"}  # type: ignore[dict-item]
    answer = client.post(ENQUEUE, content=b"[" * 5000 + b"]" * 5000, headers=odd)
    assert answer.status_code == 422, answer.text
    assert "levels deep" in answer.json()["detail"]
    assert snapshot(engine) == before


def _claim_cases(rid: str, token: str) -> list[tuple[str, str, bytes, str]]:
    deep = nested_text(LIMIT + 1)  # one level over the limit
    tok = f'"claim_token": "{token}"'
    claim = f"/v1/claims/{rid}"
    return [
        ("result over the limit", f"{claim}/complete",
         ("{" + tok + ', "result": ' + deep + "}").encode(), "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
        ("result 255 levels deep", f"{claim}/complete",
         ("{" + tok + ', "result": ' + nested_text(255) + "}").encode(), "levels deep"),
        ("NaN result", f"{claim}/complete", ("{" + tok + ', "result": NaN}').encode(), "NaN"),
        ("1e400 result", f"{claim}/complete",
         ("{" + tok + ', "result": {"x": 1e400}}').encode(), "too large"),
        ("error over the limit", f"{claim}/fail",
         ("{" + tok + ', "error": ' + deep + "}").encode(), "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
        ("hand-off input over the limit", f"{claim}/complete",
         ("{" + tok + ', "then": [{"stage": "free", "input": {"d": ' + nested_text(LIMIT)
          + "}}]}").encode(), "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
        ("claim op over the limit", f"{claim}/ops",
         ("{" + tok + ', "sub_doc": "d", "key": "k", "op": ' + _merge(LIMIT) + "}").encode(),
         "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
        ("NaN lease", f"{claim}/heartbeat",
         ("{" + tok + ', "lease_seconds": NaN}').encode(), "NaN"),
        ("Infinity lease on a claim", f"/v1/worker-classes/{PULL}/claims",
         b'{"worker_id": "x", "lease_seconds": Infinity}', "NaN"),
    ]  # fmt: skip


def test_pull_worker_payloads_are_refused_and_write_nothing(
    client: httpx.Client, engine: Engine
) -> None:
    _enqueue(client, "j1", {"a": 1})
    rid, token = _claim(client)
    before = snapshot(engine)
    for name, path, body, detail in _claim_cases(rid, token):
        answer = client.post(path, content=body, headers={**auth(WORKER_KEY), **JSON_CT})
        assert answer.status_code == 422, (name, answer.text)
        assert answer.json()["code"] == "invalid_request", name
        assert detail in answer.json()["detail"], (name, answer.json())
        assert snapshot(engine) == before, name
    # The claim is intact: the worker completes it normally.
    done = client.post(
        f"/v1/claims/{rid}/complete",
        json={"claim_token": token, "result": {"ok": True}},
        headers=auth(WORKER_KEY),
    )
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text


def test_payload_at_the_limit_is_accepted_and_reads_back(client: httpx.Client) -> None:
    value = {"deep": nested(LIMIT - 1)}  # exactly LIMIT levels
    rid = _enqueue(client, "j-edge", value)
    row = client.get(f"{ENQUEUE}/{rid}", headers=auth(API_KEY))
    assert row.status_code == 200 and row.json()["input"] == {"ratio": 0.0, **value}
    op = {"type": "merge", "patch": {"a": nested(LIMIT - 2)}}  # the op: LIMIT levels
    applied = client.post(OPS, json={"op_id": new_op_id(), "op": op}, headers=auth(API_KEY))
    assert applied.status_code == 201 and applied.json()["applied"] is True, applied.text
    ops = client.get(OPS, headers=auth(API_KEY))
    assert ops.status_code == 200 and ops.json()["ops"][0]["payload"] == op


# ------------------------------------------------------- rows written before the limit


def _poke(engine: Engine, sql: str, **params: Any) -> None:
    with engine.begin() as conn:
        conn.execute(text(sql), params)


def test_stored_deep_json_never_fails_a_read(client: httpx.Client, engine: Engine) -> None:
    """Rows and ops written before the limit (here: by SQL) are served; the too-deep parts
    as a placeholder, the rest as stored."""
    ids = {name: _enqueue(client, f"j-{name}", {"a": 1}) for name in ("d300", "d2000", "d150")}
    for name, depth in (("d300", 300), ("d2000", 2000), ("d150", 150)):
        deep = nested_text(depth)
        _poke(
            engine,
            "UPDATE workspace_process_requests SET input = CAST(:v AS jsonb),"
            " result = CAST(:v AS jsonb), error = CAST(:v AS jsonb) WHERE request_id = :rid",
            v=deep,
            rid=ids[name],
        )
    applied = client.post(
        OPS, json={"op_id": new_op_id(), "op": {"type": "merge", "patch": {"a": 1}}},
        headers=auth(API_KEY),
    )  # fmt: skip
    assert applied.status_code == 201
    _poke(
        engine,
        "UPDATE workspace_sub_doc_ops SET payload = CAST(:p AS jsonb), result = CAST(:r AS jsonb)",
        p='{"type": "merge", "patch": {"a": ' + nested_text(2000) + "}}",
        r=nested_text(300),
    )
    _poke(
        engine, "UPDATE workspace_sub_docs SET state = CAST(:s AS jsonb)",
        s='{"a": ' + nested_text(300) + "}",
    )  # fmt: skip

    for name, depth in (("d300", 300), ("d2000", 2000)):
        row = client.get(f"{ENQUEUE}/{ids[name]}", headers=auth(API_KEY))
        assert row.status_code == 200, row.text
        for field in ("input", "result", "error"):
            shown = row.json()[field]
            assert shown[UNREADABLE] is True and shown["depth"] == depth, shown
            assert "kept unchanged" in shown["reason"]
    readable = client.get(f"{ENQUEUE}/{ids['d150']}", headers=auth(API_KEY))
    assert readable.status_code == 200 and depth_of(readable.json()["input"]) == 150

    listed = client.get(ENQUEUE, headers=auth(API_KEY))
    assert listed.status_code == 200, listed.text
    assert {r["request_id"] for r in listed.json()["requests"]} == set(ids.values())

    ops = client.get(OPS, headers=auth(API_KEY))
    assert ops.status_code == 200, ops.text
    [op] = ops.json()["ops"]
    assert op["payload"][UNREADABLE] is True and op["payload"]["depth"] == 2002
    assert op["result"][UNREADABLE] is True

    doc = client.get(f"/v1/workspaces/{WS}/sub-docs/d", headers=auth(API_KEY))
    assert doc.status_code == 200, doc.text
    assert doc.json()["state"][UNREADABLE] is True and doc.json()["state"]["depth"] == 301

    # No op can build on a state nobody can read: recorded as rejected, the state kept.
    before = snapshot(engine)["workspace_sub_docs"]
    patch = {"op_id": new_op_id(), "op": {"type": "merge", "patch": {"b": 1}}}
    refused = client.post(OPS, json=patch, headers=auth(API_KEY))
    assert refused.status_code == 201 and refused.json()["applied"] is False, refused.text
    assert "stored state cannot be read" in refused.json()["error"]["message"]
    assert snapshot(engine)["workspace_sub_docs"] == before


def test_pull_worker_claiming_an_unreadable_input_fails_it_permanently(
    client: httpx.Client, api: str, engine: Engine
) -> None:
    rid = _enqueue(client, "j-claim", {"a": 1})
    _poke(
        engine,
        "UPDATE workspace_process_requests SET input = CAST(:v AS jsonb) WHERE request_id = :rid",
        v='{"deep": ' + nested_text(2000) + "}",
        rid=rid,
    )
    ran: list[str] = []

    def work(ctx: PullContext) -> Any:
        ran.append(ctx.claim.request_id)
        return {"ran": True}

    with PullWorker(api, WORKER_KEY, PULL, lease_seconds=30) as worker:
        outcome = worker.run_once(work)  # the claim answers (with a token), then it fails
    assert outcome == "dead" and ran == []
    row = client.get(f"{ENQUEUE}/{rid}", headers=auth(API_KEY)).json()
    assert row["status"] == "dead" and row["attempts"] == 1
    assert "input cannot be read" in row["error"]["message"]
    assert row["input"][UNREADABLE] is True  # the stored value itself is left as it was
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT length(input::text) FROM workspace_process_requests WHERE request_id=:r"),
            {"r": rid},
        ).scalar()
    assert stored == len('{"deep": ' + nested_text(2000) + "}")


def test_celery_runtime_fails_an_unreadable_input_permanently(clean_db: Engine) -> None:
    """The stage lifecycle every Celery task runs (in this process, on the real database)."""
    flow = payload_stages.flow
    rid = flow.enqueue("free", WS, "j-celery", "", {"a": 1}).request_id
    _poke(
        clean_db,
        "UPDATE workspace_process_requests SET input = CAST(:v AS jsonb) WHERE request_id = :rid",
        v=nested_text(2000),
        rid=rid,
    )
    outcome = run_request(flow.queue, flow.stages["free"], rid, "sec:1", lambda exc: True)
    assert outcome["outcome"] == "dead", outcome
    row = flow.queue.get(rid)
    assert row.status is Status.DEAD and row.error["type"] == "PermanentError"
    assert "input cannot be read" in row.error["message"]


# --------------------------------------------------------------------------- Python API


def test_python_api_refuses_deep_and_non_finite_payloads(clean_db: Engine) -> None:
    from tests.conftest import table_snapshot

    flow = payload_stages.flow
    bare = Queue()
    oplog = OpLog()
    bad_inputs = [
        {"x": float("nan")},
        {"x": [float("inf")]},
        {"x": float("1e400")},
        {"ratio": "Infinity"},
        {"ratio": "-inf"},
        {"deep": nested(LIMIT)},
        {"deep": nested(5000)},  # deeper than Python's own recursion limit
    ]
    for value in bad_inputs:
        with pytest.raises(InvalidRequest):
            flow.enqueue("free", WS, "j", "", value)
        with pytest.raises(InvalidRequest):
            bare.enqueue("free", WS, "j", "", value if "ratio" not in value else {"x": 1e999})
        for op in (
            {"type": "merge", "patch": value},
            {"type": "cell.set", "column": "c", "value": value},
        ):
            if "ratio" in value:
                continue  # a string is fine in an op
            with pytest.raises(InvalidRequest):
                oplog.apply_op(WS, "d", op, new_op_id())
    with pytest.raises(InvalidRequest):
        oplog.apply_op(WS, "d", CellSet(column="c", value=float("nan")), new_op_id())
    sdk = WorkspaceClient(InProcessTransport(oplog), WS)  # the retry-safe SDK: its outbox too
    for op in ({"type": "cell.set", "column": "c", "value": float("inf")},
               {"type": "merge", "patch": {"a": nested(LIMIT)}}):  # fmt: skip
        with pytest.raises(InvalidRequest):
            sdk.apply("d", op, send=False)
    assert sdk.pending() == []
    assert table_snapshot(clean_db) == []
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM workspace_sub_doc_ops")).scalar() == 0

    rid = flow.enqueue("free", WS, "j-ok", "", {"a": 1}).request_id
    [claim] = flow.queue.claim_next(PULL, "sec:2")
    before = table_snapshot(clean_db)
    for payload in ({"x": float("nan")}, nested(LIMIT + 1), {"x": float("-inf")}):
        with pytest.raises(InvalidRequest):
            flow.queue.complete(claim, payload)
        with pytest.raises(InvalidRequest):
            flow.queue.fail(claim, payload)
    assert table_snapshot(clean_db) == before
    assert flow.queue.get(rid).status is Status.RUNNING

    # A valid op whose new state would nest past the limit is rejected (and recorded).
    ok = oplog.apply_op(WS, "cells", {"type": "cell.set", "column": "a", "value": 1}, new_op_id())
    assert ok.applied
    value = nested(LIMIT - 1)  # the op nests LIMIT levels; the state would nest LIMIT + 2
    deep = oplog.apply_op(
        WS, "cells", {"type": "cell.set", "column": "b", "value": value}, new_op_id()
    )
    assert not deep.applied and "would nest" in deep.error["message"]
    assert oplog.get_sub_doc(WS, "cells").state == {"cells": {"a": 1}}


# ------------------------------------------------------------------------- CLI and MCP


def test_cli_enqueue_refuses_deep_and_non_finite_input(clean_db: Engine) -> None:
    from tests.conftest import table_snapshot

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "onceflow.cli", "enqueue", "--app", APP, "--stage", "free",
            "--workspace", WS, "--job", "j-cli", "--input"]  # fmt: skip
    for value, message in (
        ('{"deep": ' + nested_text(LIMIT) + "}", "ONCEFLOW_MAX_PAYLOAD_DEPTH"),
        ('{"deep": ' + nested_text(3000) + "}", "deep"),
        ('{"x": 1e400}', "NaN or Infinity"),
    ):
        done = subprocess.run(
            [*base, value], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
        )
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    assert table_snapshot(clean_db) == []


def test_mcp_enqueue_stage_refuses_deep_and_non_finite_input(clean_db: Engine) -> None:
    """Raw JSON-RPC lines to `onceflow mcp` (an SDK client would turn NaN into null)."""
    from tests.conftest import table_snapshot

    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "mcp", "--app", APP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines: queue_mod.Queue[bytes] = queue_mod.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()

    def send(text_: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(text_.encode() + b"\n")
        proc.stdin.flush()

    def answer(msg_id: int) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            message: dict[str, Any] = json.loads(line)
            if message.get("id") == msg_id:
                return message

    inputs = {
        2: '{"x": NaN}',
        3: '{"x": 1e400}',
        4: '{"ratio": "Infinity"}',
        5: '{"deep": ' + nested_text(LIMIT) + "}",
        6: '{"deep": ' + nested_text(150) + "}",
    }
    try:
        send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "sec", "version": "1"}}}))  # fmt: skip
        assert "result" in answer(1)
        send('{"jsonrpc": "2.0", "method": "notifications/initialized"}')
        for msg_id, input_text in inputs.items():
            send(
                '{"jsonrpc": "2.0", "id": ' + str(msg_id) + ', "method": "tools/call", '
                '"params": {"name": "enqueue_stage", "arguments": {"workspace_id": "'
                + WS
                + '", "job_id": "j-mcp", "stage": "free", "input": '
                + input_text
                + "}}}"
            )
            reply = answer(msg_id)
            result = reply.get("result", {})
            assert result.get("isError") is True, (msg_id, reply)
            assert "InvalidRequest" in json.dumps(result) or "PayloadTooDeep" in json.dumps(
                result
            ), reply
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert table_snapshot(clean_db) == []
