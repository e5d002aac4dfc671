"""The dashboard's snapshot producer on a database that stops answering (nothing closed)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from sqlalchemy import Engine

from onceflow.db import get_engine
from onceflow.integrations.fastapi.dashboard import SnapshotHub, SnapshotTimeout
from onceflow.integrations.fastapi.operators import VIEWER, Operator
from onceflow.queue.overview import read_tables
from tests.metrics.stall_proxy import StallProxy

DEADLINE_SECONDS = 30.0  # generous: an event not there by then is never coming


def test_the_stream_says_problem_on_a_stalled_database_and_recovers(
    clean_db: Engine, database_url: str
) -> None:
    proxy, through = StallProxy.for_url(database_url)
    engine = get_engine(through)
    lock = threading.Lock()
    running = [0, 0]  # (in flight now, most in flight at once)

    def compute() -> dict[str, Any]:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        try:
            return read_tables(engine)
        finally:
            with lock:
                running[0] -= 1

    async def scenario() -> list[str]:
        hub = SnapshotHub(compute, interval=0.05, timeout=0.5)
        stream = hub.open(Operator(key_id="k", roles=frozenset({VIEWER})))
        seen: list[str] = []

        async def next_event(kind: str) -> None:
            deadline = time.monotonic() + DEADLINE_SECONDS
            while True:
                left = deadline - time.monotonic()
                assert left > 0, f"no {kind} event before the deadline; saw {seen}"
                text = await asyncio.wait_for(stream.next_event(), left)
                seen.append(text.split("\n", 1)[0])
                if text.startswith(f"event: {kind}\n"):
                    return

        await next_event("snapshot")
        proxy.stall()
        await next_event("problem")
        # The stuck compute is waited for, never doubled; a direct read says it timed out.
        try:
            await hub.fresh()
            raise AssertionError("a snapshot came from a stalled database")
        except SnapshotTimeout:
            pass
        proxy.resume()
        await next_event("snapshot")
        hub.close(stream)
        return seen

    with proxy:
        try:
            seen = asyncio.run(scenario())
        finally:
            engine.dispose()
    assert seen[0] == "event: snapshot" and "event: problem" in seen
    assert running[1] == 1, "a second compute started while one was stuck"
