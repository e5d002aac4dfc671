"""The dashboard's snapshot producer: one per event loop, shared by every stream, bounded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from onceflow.integrations.fastapi.dashboard import SnapshotHub, scoped_snapshot
from onceflow.integrations.fastapi.events import StreamLimit
from onceflow.integrations.fastapi.operators import VIEWER, Operator
from onceflow.models.scopes import WorkspaceScope


def key(key_id: str, workspaces: list[str] | None = None) -> Operator:
    scope = None if workspaces is None else WorkspaceScope.parse(workspaces)
    return Operator(key_id=key_id, roles=frozenset({VIEWER}), workspaces=scope)


def test_one_producer_feeds_every_stream_and_sends_only_changes() -> None:
    state = {"n": 0, "db_now": 0}
    computed: list[int] = []

    def compute() -> dict[str, Any]:
        computed.append(1)
        state["db_now"] += 1  # the clock alone moves: not a change
        return {"db_now": state["db_now"], "depth": {"n": state["n"]}, "running": []}

    async def scenario() -> tuple[list[str], list[str], int]:
        hub = SnapshotHub(compute, interval=0.01, max_streams=3, max_per_key=2)
        a, b = hub.open(key("k1")), hub.open(key("k2"))
        first_a, first_b = await a.next_event(), await b.next_event()
        rounds = len(computed)
        while len(computed) < rounds + 5:  # five more rounds, nothing changed
            await asyncio.sleep(0.01)
        assert a.queue.empty() and b.queue.empty()
        state["n"] = 1
        changed_a, changed_b = await a.next_event(), await b.next_event()
        c = hub.open(key("k1"))
        with pytest.raises(StreamLimit):
            hub.open(key("k1"))  # per key
        assert await c.next_event() == changed_a  # a new stream gets the latest at once
        with pytest.raises(StreamLimit):
            hub.open(key("k3"))  # per process
        for stream in (a, b, c):
            hub.close(stream)
        stopped = len(computed)
        await asyncio.sleep(0.1)
        return [first_a, changed_a], [first_b, changed_b], len(computed) - stopped

    got_a, got_b, after_close = asyncio.run(scenario())
    assert got_a == got_b  # the same snapshot text for every stream
    assert '"n": 0' in got_a[0] and '"n": 1' in got_a[1]
    assert all(text.startswith("event: snapshot\ndata: ") for text in got_a)
    assert after_close <= 1  # nobody watches: the producer stops (after its current round)


def dead_row(workspace_id: str, error: str) -> dict[str, Any]:
    return {"request_id": f"r-{workspace_id}", "workspace_id": workspace_id, "error": error}


def test_each_stream_gets_the_one_snapshot_as_its_key_may_see_it() -> None:
    computed: list[int] = []

    def compute() -> dict[str, Any]:
        computed.append(1)
        return {
            "db_now": 1,
            "running": [],
            "dead": [dead_row("acme-1", "KeyError: acme"), dead_row("other", "token=hunter2")],
            "savings": {"workspaces": [{"workspace_id": "acme-1"}, {"workspace_id": "other"}]},
        }

    async def scenario() -> tuple[str, str]:
        hub = SnapshotHub(compute, interval=0.01)
        every, limited = hub.open(key("all")), hub.open(key("acme", ["acme-*"]))
        texts = await every.next_event(), await limited.next_event()
        hub.close(every)
        hub.close(limited)
        return texts

    every, limited = asyncio.run(scenario())
    assert len(computed) >= 1  # one compute, rendered per stream
    assert "token=hunter2" in every and "KeyError: acme" in every
    assert "token=hunter2" not in limited and "KeyError: acme" in limited
    data = json.loads(limited.split("data: ", 1)[1])
    assert [(r["workspace_id"], r["error"]) for r in data["dead"]] == [
        ("acme-1", "KeyError: acme"),
        ("other", None),
    ]
    assert [w["workspace_id"] for w in data["savings"]["workspaces"]] == ["acme-1"]
    # The route's answer is the same view; the shared snapshot itself is not changed.
    snapshot = compute()
    assert scoped_snapshot(snapshot, key("acme", ["acme-1"]))["dead"][1]["error"] is None
    assert snapshot["dead"][1]["error"] == "token=hunter2"
    assert scoped_snapshot(snapshot, key("all")) is snapshot


def test_a_limited_key_gets_the_savings_totals_of_its_own_workspaces() -> None:
    rows = [{"workspace_id": ws, "made": 1, "saved": 1, "asked": 2} for ws in ("a-1", "a-2", "b")]
    every = {"workspaces": rows, "workspaces_total": 3, "truncated": False, "limit": 200}
    limited = scoped_snapshot({"savings": every}, key("a", ["a-*"]))["savings"]
    assert [w["workspace_id"] for w in limited["workspaces"]] == ["a-1", "a-2"]
    assert (limited["workspaces_total"], limited["truncated"]) == (2, False)
    # Not every workspace read: how many of the key's were left out is not known.
    cut = {**every, "workspaces_total": 500, "truncated": True}
    limited = scoped_snapshot({"savings": cut}, key("a", ["a-*"]))["savings"]
    assert (limited["workspaces_total"], limited["truncated"]) == (None, True)
    assert scoped_snapshot({"savings": cut}, key("all"))["savings"]["workspaces_total"] == 500
