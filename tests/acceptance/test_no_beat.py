"""Beat is not a single point of failure.

Beat is never started here. Every ``onceflow worker`` runs a watchdog that sweeps when
no sweep began for 1.5 sweep intervals (a compare-and-set on the database clock), so a
dead worker's request is rescued within lease + 2 sweep intervals and another worker
completes it. The timing is read from the rows, on the database clock.
"""

from __future__ import annotations

import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from onceflow import Status
from tests.acceptance.conftest import TEST_ENV, executions, release
from tests.acceptance.procs import pool_children, start_worker, wait_for

pytestmark = pytest.mark.slow

INTERVAL = float(TEST_ENV["ONCEFLOW_SWEEP_INTERVAL_SECONDS"])
#: Thread wake-up and statement latency on a busy test machine, beyond two sweep intervals.
SCHEDULING_ALLOWANCE = 0.5


def test_without_beat_a_dead_workers_request_is_rescued_and_completed(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    a = start_worker(tmp_path, "t-block", name="a")
    b = start_worker(tmp_path, "t-block", name="b")
    try:
        queue = runtime.flow.queue
        rid = runtime.flow.enqueue("blocker", "w1", "j-no-beat", "main", {}).request_id
        [first] = wait_for(lambda: executions(redis_url, rid), what="first run started")
        owner, other = (a, b) if first["pid"] in pool_children(a) else (b, a)
        owner.signal_group(signal.SIGKILL)  # the worker, its pool child and its watchdog
        owner.popen.wait(timeout=10)

        # Follow the row until the rescue: the last lease the dead worker's heartbeats set.
        last_lease: list[datetime] = []

        def rescued() -> bool:
            row = queue.get(rid)
            if row.status is Status.RUNNING and row.attempts == 1:
                assert row.lease_expires_at is not None
                last_lease.append(row.lease_expires_at)
                return False
            return True

        wait_for(rescued, timeout=60, interval=0.02, what="the rescue")
        runs = wait_for(
            lambda: len(executions(redis_url, rid)) == 2 and executions(redis_url, rid),
            timeout=30,
            what="the second run",
        )
        assert runs[1]["attempt"] == 2 and runs[1]["pid"] in pool_children(other)
        release(redis_url, rid, 2)
        wait_for(lambda: queue.get(rid).status is Status.SUCCEEDED, what="success")
        row = queue.get(rid)
        assert (row.attempts, row.crash_attempts) == (2, 1)
        assert row.result["pid"] == runs[1]["pid"]

        # The rescue set run_after to its own time (the claim keeps it): both on the DB clock.
        lapse_to_rescue = (row.run_after - last_lease[-1]).total_seconds()
        assert 0 <= lapse_to_rescue <= 2 * INTERVAL + SCHEDULING_ALLOWANCE, lapse_to_rescue
        with queue.engine.connect() as conn:
            swept_by = conn.execute(text("SELECT swept_by FROM onceflow_sweeps")).scalar_one()
        assert swept_by.startswith("watchdog@")
    finally:
        a.stop()
        b.stop()
