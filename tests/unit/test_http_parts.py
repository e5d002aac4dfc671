"""The HTTP integration's parts that need no server: keys, scopes, errors, events, the body cap."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from onceflow.errors import (
    AccessDenied,
    InvalidRequest,
    LeaseLost,
    NotFound,
    OpIdConflict,
    ReplayTooOld,
)
from onceflow.integrations.fastapi import BodyLimitMiddleware, KeyAuth, hash_key, new_key
from onceflow.integrations.fastapi.app import error_response
from onceflow.integrations.fastapi.events import format_event
from onceflow.oplog import TransportError
from onceflow.oplog.http import path_segment, raise_for_api_error


def test_keys_are_stored_hashed_and_scoped() -> None:
    key, digest = new_key()
    assert digest == hash_key(key) and len(digest) == 64 and key not in digest
    auth = KeyAuth({digest: ["w1"]}, {hash_key("worker"): ["llm"], digest: ["browser"]})
    principal = auth.authenticate(key)
    assert principal is not None
    assert principal.may_use_workspace("w1") and not principal.may_use_workspace("w2")
    assert principal.may_work("browser") and not principal.may_work("llm")
    assert principal.key_id == digest[:12]
    assert auth.authenticate("worker") is not None
    assert auth.authenticate(key + "x") is None and auth.authenticate("") is None
    wildcard = KeyAuth({hash_key("admin"): ["*"]}).authenticate("admin")
    assert wildcard is not None and wildcard.may_use_workspace("any") and not wildcard.is_worker


@pytest.mark.parametrize(
    "table",
    [{"plain-key": ["w1"]}, {"A" * 64: ["w1"]}, {hash_key("k"): "w1"}, {hash_key("k"): [""]}],
)
def test_a_malformed_key_table_is_refused(table: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        KeyAuth(table)


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (AccessDenied(401, "x"), 401, "unauthorized"),
        (AccessDenied(403, "x"), 403, "forbidden"),
        (NotFound("r"), 404, "not_found"),
        (LeaseLost("r"), 409, "lease_lost"),
        (OpIdConflict("o", "d"), 409, "op_id_conflict"),
        (ReplayTooOld("o", 1, 5), 409, "replay_too_old"),
        (InvalidRequest("x"), 422, "invalid_request"),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates"), 422, "invalid_request"),
    ],
)
def test_errors_map_to_statuses(exc: Exception, status: int, code: str) -> None:
    response = error_response(exc)
    assert response.status_code == status
    assert json.loads(bytes(response.body))["code"] == code


def test_client_side_mapping_is_the_inverse() -> None:
    def answer(status: int, **body: Any) -> httpx.Response:
        return httpx.Response(status, json=body)

    raise_for_api_error(answer(201))
    with pytest.raises(TransportError):
        raise_for_api_error(answer(503, code="unavailable"))
    with pytest.raises(TransportError):
        raise_for_api_error(answer(429))
    with pytest.raises(AccessDenied):
        raise_for_api_error(answer(403, code="forbidden", detail="x"))
    with pytest.raises(LeaseLost):
        raise_for_api_error(answer(409, code="lease_lost"), request_id="r")
    with pytest.raises(OpIdConflict):
        raise_for_api_error(answer(409, code="op_id_conflict"), op_id="o", sub_doc="d")
    with pytest.raises(ReplayTooOld) as too_old:
        raise_for_api_error(answer(409, code="replay_too_old", horizon=7), op_id="o")
    assert too_old.value.horizon == 7
    with pytest.raises(InvalidRequest):
        raise_for_api_error(answer(422, detail=[{"loc": ["body"]}]))
    assert path_segment("ws", "a b?#%") == "a%20b%3F%23%25"
    with pytest.raises(InvalidRequest):
        path_segment("ws", "a/b")


def test_events_are_named_by_kind_and_multi_line_data_is_split() -> None:
    event = format_event(b'{"kind": "commit", "clock": 3}')
    assert event == 'event: commit\ndata: {"kind": "commit", "clock": 3}\n\n'
    assert format_event("not json\nsecond").startswith("event: message\ndata: not json\n")
    assert format_event('{"kind": "x\\ny"}').startswith("event: message\n")


def _call(app: BodyLimitMiddleware, chunks: list[bytes], declared: int | None) -> list[Any]:
    sent: list[Any] = []
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "headers": headers}

    async def receive() -> Any:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_the_body_cap_refuses_declared_and_streamed_bodies_before_the_app_reads_them() -> None:
    seen: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    app = BodyLimitMiddleware(inner, max_body_bytes=10)
    assert _call(app, [b"12345", b"678"], None)[0]["status"] == 200
    assert seen == [b"12345678"]  # what passes is handed over whole
    assert _call(app, [b"x" * 11], 11)[0]["status"] == 413  # declared: refused at once
    assert _call(app, [b"123456", b"78901"], None)[0]["status"] == 413  # streamed: counted
    assert _call(app, [b""], -5)[0]["status"] == 400
    assert seen == [b"12345678"]  # the app never saw an oversize body
