"""A worker's wall clock decides nothing — not even through Celery options.

Beat's sweep task used to carry Celery's ``expires``, which each worker checks against
its own wall clock: a worker more than two sweep intervals ahead discarded every sweep,
so nothing was rescued or re-sent. Here the only worker runs an hour ahead (its
``time.time()`` and ``datetime.now()`` are shifted by ``skewed_clock/sitecustomize.py``)
and must still run beat's sweeps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from onceflow import Status
from onceflow.demo import procs
from tests.acceptance.conftest import executions
from tests.acceptance.procs import APP, ROOT, wait_for

pytestmark = pytest.mark.slow

SKEWED_CLOCK = ROOT / "tests" / "acceptance" / "skewed_clock"


def test_a_worker_an_hour_ahead_still_runs_beats_sweeps(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    fast = {"ONCEFLOW_REDISPATCH_AFTER_SECONDS": "1"}
    skewed = {
        **fast,
        "PYTHONPATH": f"{SKEWED_CLOCK}{os.pathsep}{ROOT}",
        "ONCEFLOW_TEST_CLOCK_SKEW_SECONDS": "3600",
        # Only beat's sweeps may rescue anything here, not the worker's own watchdog.
        "ONCEFLOW_SWEEP_WATCHDOG": "false",
    }
    worker = procs.start_worker(tmp_path, APP, "t-default", name="skewed", env=skewed, cwd=ROOT)
    beat = procs.start_beat(tmp_path, APP, env={**fast, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        assert "wall clock skewed by +3600s" in worker.log()
        # A request whose wake-up is lost: the row is committed, no message is ever sent.
        rid = runtime.flow.queue.enqueue(
            "noop", "w1", "j-skew", "main", {}, worker_class="t-default"
        ).request_id
        wait_for(
            lambda: runtime.flow.queue.get(rid).status is Status.SUCCEEDED,
            timeout=60,
            what="beat's sweep, run by the skewed worker, to re-send the wake-up",
        )
        assert len(executions(redis_url, rid)) == 1
        with runtime.flow.queue.engine.connect() as conn:
            swept_by = conn.execute(text("SELECT swept_by FROM onceflow_sweeps")).scalars().all()
        assert [s.split("@")[0] for s in swept_by] == ["beat"]
        assert "Discarding revoked task: onceflow.sweep" not in worker.log()  # none expired
    finally:
        beat.stop()
        worker.stop()
