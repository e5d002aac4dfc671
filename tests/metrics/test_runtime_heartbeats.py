"""The Celery runtime's shared heartbeat thread never beats a row whose outcome is recorded."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

from onceflow.models.requests import NewRequest
from onceflow.queue import Queue
from onceflow.tasks.flow import StageSpec
from onceflow.tasks.runtime import run_request


class In(BaseModel):
    pass


def rejected_heartbeats() -> float:
    sample = REGISTRY.get_sample_value(
        "onceflow_zombie_writes_rejected_total", {"operation": "heartbeat"}
    )
    return sample or 0.0


def test_no_heartbeat_races_the_recording_of_the_same_run(
    queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    # Short leases (a heartbeat every 0.1 s) and bodies ending at every phase of it, in
    # 8 threads as in a thread pool: a heartbeat sent for a row whose completion committed
    # before the run left the heartbeat set is rejected — a false "lease lost" and a false
    # zombie-write count.
    def body(ctx: Any, data: In) -> dict[str, int]:
        time.sleep(random.uniform(0.0, 0.1))  # the work: ends at a random heartbeat phase
        return {"ok": 1}

    n = 600
    items = [NewRequest("w1", f"j{i}", "quick", worker_class="wc-z") for i in range(n)]
    ids = [r.request_id for r in queue.enqueue_many(items)]
    spec = StageSpec("quick", body, In, "wc-z", True, 0.3, None, None, 0, None)
    before = rejected_heartbeats()
    caplog.set_level(logging.WARNING, logger="onceflow")
    outcomes: list[str] = []
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                if not ids:
                    return
                rid = ids.pop()
            outcome = run_request(queue, spec, rid, "celery-w", lambda e: True)["outcome"]
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=drain) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes == ["succeeded"] * n
    assert [r.getMessage() for r in caplog.records if "lease lost" in r.getMessage()] == []
    assert rejected_heartbeats() == before
