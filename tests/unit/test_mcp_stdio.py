"""The MCP stdio guard's verdicts, line by line, against the installed SDK's own validation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from onceflow.integrations.mcp_stdio import sdk_line_validator, triage

VALIDATE = sdk_line_validator()


def verdict(line: str) -> Any:
    return triage(line, VALIDATE)


def nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    "line",
    [
        '{"jsonrpc": "2.0", "id": 1, "method": "ping"}',
        '{"jsonrpc": "2.0", "id": "a", "method": "tools/list"}',
        '{"jsonrpc": "2.0", "method": "notifications/initialized"}',
        '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", '
        '"params": {"name": "x", "arguments": {"s": "\\u00e9\\ud83d\\ude00"}}}',
    ],
)
def test_lines_the_sdk_reads_pass_untouched(line: str) -> None:
    assert verdict(line) is True


@pytest.mark.parametrize(
    ("line", "request_id", "code"),
    [
        ("nope", None, -32700),
        ("[1]", None, -32600),
        ("null", None, -32600),
        ('{"jsonrpc": "2.0", "id": true, "method": "ping"}', None, -32600),
        ('{"jsonrpc": "2.0", "id": null, "method": "ping"}', None, -32600),
        ('{"jsonrpc": "2.0", "id": 2.5, "method": "ping"}', None, -32600),
        ('{"jsonrpc": "1.0", "id": 3, "method": "ping"}', 3, -32600),
        ('{"jsonrpc": "2.0", "id": 4, "method": "\\udfff"}', 4, -32600),
        ('{"jsonrpc": "2.0", "id": 5, "method": "ping", "params": {"x": "\\ud800"}}', 5, -32602),
        (json.dumps({"jsonrpc": "2.0", "id": 6, "method": "ping", "params": nested(300)}), 6,
         -32602),
    ],
)  # fmt: skip
def test_unreadable_requests_get_their_error(line: str, request_id: Any, code: int) -> None:
    answer = verdict(line)
    assert isinstance(answer, dict)
    assert answer["jsonrpc"] == "2.0" and answer["id"] == request_id
    assert answer["error"]["code"] == code
    assert "\n" not in answer["error"]["message"]


def test_unreadable_tool_arguments_are_a_tool_error() -> None:
    for arguments in ['{"a": "\\ud800"}', json.dumps({"a": nested(300)})]:
        line = (
            '{"jsonrpc": "2.0", "id": 7, "method": "tools/call", '
            f'"params": {{"name": "enqueue_stage", "arguments": {arguments}}}}}'
        )
        answer = verdict(line)
        assert isinstance(answer, dict) and answer["id"] == 7
        assert answer["result"]["isError"] is True
        assert "enqueue_stage" in answer["result"]["content"][0]["text"]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "   ",
        '{"jsonrpc": "2.0", "method": "notifications/\\ud800"}',
        '{"jsonrpc": "2.0", "id": 8, "result": {"x": "\\ud800"}}',  # a response of the client
    ],
)
def test_unreadable_notifications_and_responses_are_dropped(line: str) -> None:
    assert verdict(line) is None
