"""A backlog is not a loss — no wake-up storm while rows merely wait.

Rows wait in the broker longer than the redispatch interval (0.5 s here) while one
worker drains them and beat sweeps every 0.5 s. The old sweeper re-sent every waiting
row at every sweep; now a wake-up is re-sent only when the broker holds fewer messages
than there are due rows, so the worker processes at most 1.2 messages per row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from onceflow import NewRequest, Status
from onceflow.keys import queue_name
from onceflow.models import Dispatch
from tests.acceptance.conftest import processed
from tests.acceptance.procs import APP, started_together, wait_for, worker_args

pytestmark = pytest.mark.slow

#: Enough rows that the last ones wait in the broker for many sweeps (seconds, against a
#: 0.5 s redispatch interval): the old sweeper re-sent all of them at each.
ROWS = 150


def test_a_backlog_longer_than_the_redispatch_interval_gets_no_storm(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    env = {"ONCEFLOW_REDISPATCH_AFTER_SECONDS": "0.5"}
    queue = runtime.flow.queue
    items = [
        NewRequest("w1", f"j-storm-{i}", "noop", worker_class="t-default") for i in range(ROWS)
    ]
    ids = [r.request_id for r in queue.enqueue_many(items)]
    for rid in ids:
        assert runtime.flow.dispatch(Dispatch(rid, "noop", "t-default"))
    client = redis_lib.Redis.from_url(redis_url)
    beat = ("beat.log", ["beat", "--app", APP], "beat: Starting")
    worker = ("worker-w.log", worker_args("t-default"), " ready.")
    with started_together(tmp_path, beat, worker, env=env):

        def all_done() -> bool:
            return queue.counts().get("t-default", {}).get("succeeded", 0) == ROWS

        wait_for(all_done, timeout=180, interval=0.2, what="the backlog drained")
        wait_for(lambda: client.llen(queue_name("t-default")) == 0, what="every message consumed")
        messages = sum(processed(redis_url, rid) for rid in ids)
        assert ROWS <= messages <= 1.2 * ROWS, messages
        assert all(queue.get(rid).status is Status.SUCCEEDED for rid in ids[:5])
