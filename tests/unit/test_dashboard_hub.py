"""The dashboard's snapshot producer: one per event loop, shared by every stream, bounded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from onceflow.integrations.fastapi.dashboard import SnapshotHub
from onceflow.integrations.fastapi.events import StreamLimit


def test_one_producer_feeds_every_stream_and_sends_only_changes() -> None:
    state = {"n": 0, "db_now": 0}
    computed: list[int] = []

    def compute() -> dict[str, Any]:
        computed.append(1)
        state["db_now"] += 1  # the clock alone moves: not a change
        return {"db_now": state["db_now"], "depth": {"n": state["n"]}, "running": []}

    async def scenario() -> tuple[list[str], list[str], int]:
        hub = SnapshotHub(compute, interval=0.01, max_streams=3, max_per_key=2)
        a, b = hub.open("k1"), hub.open("k2")
        first_a, first_b = await a.queue.get(), await b.queue.get()
        rounds = len(computed)
        while len(computed) < rounds + 5:  # five more rounds, nothing changed
            await asyncio.sleep(0.01)
        assert a.queue.empty() and b.queue.empty()
        state["n"] = 1
        changed_a, changed_b = await a.queue.get(), await b.queue.get()
        c = hub.open("k1")
        with pytest.raises(StreamLimit):
            hub.open("k1")  # per key
        assert await c.queue.get() == changed_a  # a new stream gets the latest at once
        with pytest.raises(StreamLimit):
            hub.open("k3")  # per process
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
