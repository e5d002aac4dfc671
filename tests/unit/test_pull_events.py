"""The pull worker's reading of a server-sent event stream (``pull_locks.sse_events``)."""

from __future__ import annotations

from onceflow.integrations.fastapi.events import format_event
from onceflow.integrations.pull_locks import sse_events


def test_events_as_the_api_formats_them_are_read_back() -> None:
    lines = [
        "retry: 2000",
        "event: ready",
        'data: {"kind": "ready"}',
        "",
        ": keep-alive",
        "",
        *format_event('{"kind": "lock_released",\n "ok": true}').split("\n"),
        *format_event('{"kind": "commit"}').split("\n"),
        "event: end",
        'data: {"kind": "end"}',
        "",
    ]
    assert list(sse_events(iter(lines))) == [
        ("ready", '{"kind": "ready"}'),
        ("lock_released", '{"kind": "lock_released",\n "ok": true}'),
        ("commit", '{"kind": "commit"}'),
        ("end", '{"kind": "end"}'),
    ]


def test_an_event_without_data_or_cut_off_is_not_delivered() -> None:
    assert list(sse_events(iter(["event: commit", "", "data: x"]))) == []
