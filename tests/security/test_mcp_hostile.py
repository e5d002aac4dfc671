"""`onceflow mcp` answers every request, hostile lines included, and keeps serving.

A real `onceflow mcp` subprocess on stdio, driven line by line (the SDK's client
would refuse to send most of these). Each request gets its JSON-RPC answer —
an error, or a tool error (``isError``) for bad tool arguments — a notification
gets none, nothing is written, and the next request is served.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import redis as redis_lib

from onceflow.integrations.mcp_stdio import MAX_LINE_BYTES
from tests.acceptance.conftest import runtime  # noqa: F401 - the fixture
from tests.acceptance.procs import APP, ROOT
from tests.conftest import table_snapshot

pytestmark = pytest.mark.slow

ANSWER_TIMEOUT = 30.0  # the most a test waits for an answer before failing


class RawSession:
    """`onceflow mcp` on pipes: write raw lines, read JSON answers (with a deadline)."""

    def __init__(self, log_path: Path) -> None:
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", "mcp", "--app", APP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=str(ROOT),
        )
        self.lines: queue.Queue[bytes] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            self.lines.put(line)

    def send(self, line: str | bytes) -> None:
        raw = line.encode() if isinstance(line, str) else line
        assert self.proc.stdin is not None
        self.proc.stdin.write(raw + b"\n")
        self.proc.stdin.flush()

    def request(self, message: dict[str, Any]) -> None:
        self.send(json.dumps({"jsonrpc": "2.0", **message}))

    def answer(self, what: str = "") -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=ANSWER_TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"no answer to {what} within {ANSWER_TIMEOUT} s") from None
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ping(self, request_id: int) -> None:
        """The server still serves: a ping is answered, and it is the next line out."""
        self.request({"id": request_id, "method": "ping"})
        assert self.answer() == {"jsonrpc": "2.0", "id": request_id, "result": {}}

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        code = self.proc.wait(timeout=30)
        self._log.close()
        return code


@pytest.fixture()
def session(tmp_path: Path, runtime: Any) -> Iterator[RawSession]:  # noqa: F811 - the fixture
    raw = RawSession(tmp_path / "mcp.log")
    try:
        raw.request(
            {
                "id": 0,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "hostile", "version": "1"},
                },
            }
        )
        assert "result" in raw.answer()
        raw.request({"method": "notifications/initialized"})
        yield raw
    finally:
        if raw.proc.poll() is None:
            raw.close()


def _nested(levels: int) -> Any:
    value: Any = {"value": 1}
    for _ in range(levels):
        value = {"x": value}
    return value


def _tool_call(request_id: int, name: str, arguments: str) -> str:
    """A tools/call line with ``arguments`` as raw JSON text (so escapes travel as written)."""
    return (
        f'{{"jsonrpc": "2.0", "id": {request_id}, "method": "tools/call", '
        f'"params": {{"name": "{name}", "arguments": {arguments}}}}}'
    )


ENQUEUE = '{"workspace_id": "w-mcp", "job_id": "j1", "stage": "noop", "input": %s}'

# (case, the line, what the answer must be: ("error", code) or ("tool_error", text in it))
HOSTILE: list[tuple[str, str | bytes, tuple[str, Any]]] = [
    ("lone surrogate in a tool argument",
     _tool_call(11, "enqueue_stage", ENQUEUE % '{"value": 1, "note": "\\ud800"}'),
     ("tool_error", "lone surrogate")),
    ("lone surrogate as a tool argument's key",
     _tool_call(12, "list_requests", '{"workspace_id": "w", "\\udfff": 1}'),
     ("tool_error", "lone surrogate")),
    ("lone surrogate in the method name",
     '{"jsonrpc": "2.0", "id": 13, "method": "tools/\\ud800", "params": {}}',
     ("error", -32600)),
    ("lone surrogate in the tool name",
     _tool_call(14, "enqueue_\\ud800", "{}"), ("error", -32602)),
    ("a 300-deep tool argument",
     _tool_call(15, "enqueue_stage", ENQUEUE % json.dumps(_nested(300))),
     ("tool_error", "deep")),
    ("a 255-deep argument of another method",
     json.dumps({"jsonrpc": "2.0", "id": 16, "method": "resources/read",
                 "params": {"uri": "x", "_meta": _nested(255)}}),
     ("error", -32602)),
    ("not JSON", "hello, server", ("error", -32700)),
    ("truncated JSON", '{"jsonrpc": "2.0", "id": 17, "method": "pi', ("error", -32700)),
    ("JSON nested past any parser", "[" * 100_000 + "]" * 100_000, ("error", -32700)),
    ("a JSON array", '[{"jsonrpc": "2.0", "id": 18, "method": "ping"}]', ("error", -32600)),
    ("a JSON number", "42", ("error", -32600)),
    ("a JSON string", '"ping"', ("error", -32600)),
    ("no jsonrpc member", '{"id": 19, "method": "ping"}', ("error", -32600)),
    ("a boolean id", '{"jsonrpc": "2.0", "id": true, "method": "ping"}', ("error", -32600)),
    ("an object id", '{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}', ("error", -32600)),
    ("a fractional id", '{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', ("error", -32600)),
    ("a null id", '{"jsonrpc": "2.0", "id": null, "method": "ping"}', ("error", -32600)),
    ("a lone surrogate id", '{"jsonrpc": "2.0", "id": "\\ud800", "method": "ping"}',
     ("error", -32600)),
    ("an oversized line",
     _tool_call(20, "enqueue_stage", ENQUEUE % json.dumps({"pad": "x" * MAX_LINE_BYTES})),
     ("error", -32600)),
    ("an oversized line, a string id after the params",
     '{"method": "tools/call", "params": {"name": "enqueue_stage", "arguments": {}}, '
     '"jsonrpc": "2.0", "id": "call-21", "pad": "' + "x" * MAX_LINE_BYTES + '"}',
     ("error", -32600)),
    ("an oversized line, its id past the limit",
     '{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "enqueue_stage", '
     '"arguments": {"pad": "' + "\\\"[{" * MAX_LINE_BYTES + '"}}, "id": 22}',
     ("error", -32600)),
    ("an oversized line, an id inside its params only",
     '{"jsonrpc": "2.0", "method": "tools/call", "params": {"id": 23, "x": ['
     + "[1]," * MAX_LINE_BYTES + "[1]]}}",
     ("error", -32600)),
]  # fmt: skip
#: The id an oversized line is answered with: the request's, when it is a top-level member
#: within the first MAX_LINE_BYTES (before: null for every one, so a caller could not tell
#: which of its requests was refused).
OVERSIZED_IDS = {
    "an oversized line": 20,
    "an oversized line, a string id after the params": "call-21",
}


def test_every_hostile_request_gets_an_answer_and_the_server_keeps_serving(
    session: RawSession,
    runtime: Any,  # noqa: F811 - the fixture
    redis_url: str,
) -> None:
    before = table_snapshot(runtime.flow.queue.engine)
    for n, (case, line, (kind, expected)) in enumerate(HOSTILE):
        session.send(line)
        answer = session.answer(case)
        assert answer["jsonrpc"] == "2.0", (case, answer)
        if kind == "error":
            assert answer["error"]["code"] == expected, (case, answer)
            assert isinstance(answer["error"]["message"], str), (case, answer)
            assert "\n" not in answer["error"]["message"], (case, answer)
        else:
            result = answer["result"]
            assert result["isError"] is True, (case, answer)
            assert expected in result["content"][0]["text"], (case, answer)
        sent_id = OVERSIZED_IDS.get(case) if len(line) > MAX_LINE_BYTES else _sent_id(line)
        assert answer["id"] == sent_id, (case, answer, sent_id)
        session.ping(1000 + n)
    # Nothing was written: no row, no wake-up.
    assert table_snapshot(runtime.flow.queue.engine) == before == []
    assert redis_lib.Redis.from_url(redis_url).llen("t-default") == 0
    # And the tools still work.
    session.send(_tool_call(30, "enqueue_stage", ENQUEUE % '{"value": 3}'))
    done = session.answer()
    assert done["id"] == 30 and not done["result"].get("isError"), done
    assert json.loads(done["result"]["content"][0]["text"])["created"] is True
    assert session.close() == 0


def test_hostile_notifications_get_no_answer_and_the_server_serves_the_next_request(
    session: RawSession,
) -> None:
    for n, line in enumerate(
        [
            '{"jsonrpc": "2.0", "method": "notifications/\\ud800"}',
            '{"jsonrpc": "2.0", "method": "notifications/progress", "params": {"x": "\\udc00"}}',
            json.dumps(
                {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": _nested(300)}
            ),
            "",
        ]
    ):
        session.send(line)
        session.ping(2000 + n)  # the next line out is the ping's answer: nothing came before it
    assert session.close() == 0


def _sent_id(line: str | bytes) -> Any:
    """The id the answer must carry: the request's, or null when it cannot be read."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict):
        return None
    request_id = message.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        return None
    if isinstance(request_id, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in request_id):
        return None
    return request_id
