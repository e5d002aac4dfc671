"""Stages as Celery tasks in real worker processes: duplicates, crashes, pauses, purges."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib

from onceflow import Status
from onceflow.demo import procs
from onceflow.ids import request_id_for
from onceflow.keys import queue_name
from tests.acceptance.conftest import TEST_ENV, executions, processed, release
from tests.acceptance.procs import (
    APP,
    ROOT,
    Proc,
    pool_children,
    start_beat,
    start_worker,
    started_together,
    stop_all,
    wait_for,
    worker_args,
)

pytestmark = pytest.mark.slow


def status_of(stages: Any, rid: str) -> Status:
    return stages.flow.queue.get(rid).status


def test_bad_input_is_refused_before_anything_is_written(runtime: Any) -> None:
    from onceflow import InvalidRequest
    from onceflow.errors import UnknownStage

    with pytest.raises(InvalidRequest, match="invalid"):
        runtime.flow.enqueue("noop", "w1", "j1", "main", {"value": "not a number"})
    with pytest.raises(UnknownStage):
        runtime.flow.enqueue("nope", "w1", "j1", "main", {})
    assert runtime.flow.queue.counts() == {}


def test_same_message_ten_times_runs_the_body_once(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    result = runtime.flow.enqueue("noop", "w1", "j-dup", "main", {"value": 1})
    for _ in range(9):
        runtime.app.send_task(
            "onceflow.stage.noop", args=[result.request_id], queue=queue_name("t-default")
        )
    # A duplicate enqueue collapses at the primary key and sends nothing more.
    assert not runtime.flow.enqueue("noop", "w1", "j-dup", "main", {"value": 1}).created
    worker = start_worker(tmp_path, "t-default", concurrency=2)
    try:
        wait_for(lambda: processed(redis_url, result.request_id) == 10, what="10 messages")
        assert len(executions(redis_url, result.request_id)) == 1
        row = runtime.flow.queue.get(result.request_id)
        assert (row.status, row.attempts) == (Status.SUCCEEDED, 1)
    finally:
        worker.stop()


def test_kill_9_mid_stage_beat_redispatches_another_worker_completes(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    a = start_worker(tmp_path, "t-block", name="a")
    beat = None
    b = None
    try:
        rid = runtime.flow.enqueue("blocker", "w1", "j-kill", "main", {}).request_id
        [first] = wait_for(lambda: executions(redis_url, rid), what="first run started")
        a.signal_group(signal.SIGKILL)  # the worker and its pool child, mid-stage
        a.popen.wait(timeout=10)
        b = start_worker(tmp_path, "t-block", name="b")
        beat = start_beat(tmp_path)
        runs = wait_for(
            lambda: len(executions(redis_url, rid)) == 2 and executions(redis_url, rid),
            timeout=60,
            what="second run",
        )
        assert runs[1]["attempt"] == 2 and runs[1]["pid"] != first["pid"]
        release(redis_url, rid, 2)
        wait_for(lambda: status_of(runtime, rid) is Status.SUCCEEDED, what="success")
        row = runtime.flow.queue.get(rid)
        assert (row.attempts, row.crash_attempts) == (2, 1)
        assert row.result["pid"] == runs[1]["pid"]
        assert len(executions(redis_url, rid)) == 2
    finally:
        stop_all([proc for proc in (a, b, beat) if proc is not None])


def test_sigstop_past_the_lease_zombie_completion_rejected(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    with started_together(
        tmp_path,
        ("worker-a.log", worker_args("t-block", name="a"), " ready."),
        ("worker-b.log", worker_args("t-block", name="b"), " ready."),
    ) as (a, b):
        rid = runtime.flow.enqueue("blocker", "w1", "j-stop", "main", {}).request_id
        [first] = wait_for(lambda: executions(redis_url, rid), what="first run started")
        owner = a if first["pid"] in pool_children(a) else b
        owner.signal_group(signal.SIGSTOP)
        try:
            # The sweeper (called here; beat does the same) rescues the lapsed lease.
            wait_for(lambda: runtime.flow.sweep_once().rescued == [rid], timeout=30, what="rescue")
            runs = wait_for(
                lambda: len(executions(redis_url, rid)) == 2 and executions(redis_url, rid),
                timeout=30,
                what="second run",
            )
            assert runs[1]["attempt"] == 2
            release(redis_url, rid, 2)
            wait_for(lambda: status_of(runtime, rid) is Status.SUCCEEDED, what="success")
        finally:
            owner.signal_group(signal.SIGCONT)
        release(redis_url, rid, 1)
        # The paused worker wakes: its heartbeat is rejected and its completion discarded.
        owner.wait_log("lease lost; result discarded")
        row = runtime.flow.queue.get(rid)
        assert row.status is Status.SUCCEEDED
        assert row.result["attempt"] == 2 and row.result["pid"] == runs[1]["pid"]
        assert (row.attempts, row.crash_attempts) == (2, 1)


def test_purged_wakeup_is_resent_by_the_sweeper(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    rid = runtime.flow.enqueue("noop", "w1", "j-purge", "main", {}, worker_class="t-purge")
    client = redis_lib.Redis.from_url(redis_url)
    assert client.llen(queue_name("t-purge")) == 1
    with runtime.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue_name("t-purge"))
    assert client.llen(queue_name("t-purge")) == 0
    worker = start_worker(tmp_path, "t-purge")
    try:
        assert status_of(runtime, rid.request_id) is Status.QUEUED
        swept = runtime.flow.sweep_once(redispatch_after=0)
        assert [d.request_id for d in swept.to_dispatch] == [rid.request_id]
        wait_for(lambda: status_of(runtime, rid.request_id) is Status.SUCCEEDED, what="success")
    finally:
        worker.stop()


def test_always_raising_stage_retries_with_backoff_then_dead(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    with started_together(
        tmp_path,
        ("worker-w.log", worker_args("t-fail"), " ready."),
        ("beat.log", ["beat", "--app", APP], "beat: Starting"),
    ):
        rid = runtime.flow.enqueue("always_fails", "w1", "j-fail", "main", {}).request_id
        wait_for(lambda: status_of(runtime, rid) is Status.DEAD, timeout=60, what="dead")
        row = runtime.flow.queue.get(rid)
        assert row.attempts == 3
        assert row.error["type"] == "RuntimeError"
        assert row.error["message"] == "boom on attempt 3"
        assert [e["attempt"] for e in executions(redis_url, rid)] == [1, 2, 3]


def test_stage_that_kills_its_process_is_quarantined(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    worker = start_worker(tmp_path, "t-kill")
    try:
        rid = runtime.flow.enqueue("self_kill", "w1", "j-poison", "main", {}).request_id
        wait_for(
            lambda: runtime.flow.sweep_once() and status_of(runtime, rid) is Status.DEAD,
            timeout=60,
            interval=0.3,
            what="quarantine",
        )
        row = runtime.flow.queue.get(rid)
        assert row.crash_attempts == 2
        assert row.error["type"] == "LeaseLapsed"
        assert len(executions(redis_url, rid)) == 2  # not retried forever
    finally:
        worker.stop()


def test_pickle_message_is_refused_and_runs_nothing(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    rid = runtime.flow.queue.enqueue("noop", "w1", "j-pickle", "main", {}).request_id
    runtime.app.send_task(
        "onceflow.stage.noop", args=[rid], queue=queue_name("t-pickle"), serializer="pickle"
    )
    worker = start_worker(tmp_path, "t-pickle")
    try:
        worker.wait_log("untrusted content")
        client = redis_lib.Redis.from_url(redis_url)
        wait_for(lambda: client.llen(queue_name("t-pickle")) == 0, what="message consumed")
        assert executions(redis_url, rid) == []
        assert status_of(runtime, rid) is Status.QUEUED
        assert rid == request_id_for("w1", "j-pickle", "main", "noop")
    finally:
        worker.stop()


def test_pull_worker_classes_get_no_celery_wakeup(runtime: Any, redis_url: str) -> None:
    from onceflow.tasks import Flow

    client = redis_lib.Redis.from_url(redis_url)
    client.delete(queue_name("tabs"))
    pull_flow = Flow(pull_worker_classes=("tabs",))
    pull_flow.stages.update(runtime.flow.stages)  # the same stage declarations
    result = pull_flow.enqueue("noop", "w1", "j-pull", "main", {}, worker_class="tabs")
    assert result.created
    swept = pull_flow.sweep_once(redispatch_after=0)
    assert [d.request_id for d in swept.to_dispatch] == [result.request_id]
    # Nothing piles up in a queue no Celery worker reads.
    assert client.llen(queue_name("tabs")) == 0
    claim = runtime.flow.queue.claim_next("tabs", "tab-1")  # a pull worker takes it
    assert [c.request_id for c in claim] == [result.request_id]


# The tests below share one `t-default` worker (a module fixture): each is a request the
# worker takes up while idle, on a table and queues the `runtime` fixture empties first.
# They come last: the tests above that start `t-default` workers of their own (the ten
# duplicate messages, waiting before a concurrency-2 worker starts) must not meet it.


@pytest.fixture(scope="module")
def t_default_worker(
    database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    """One real `onceflow worker` for class `t-default`, with the tests' fast settings."""
    worker = procs.start_worker(
        tmp_path_factory.mktemp("t-default"), APP, "t-default",
        env={"PYTHONPATH": str(ROOT), **TEST_ENV}, cwd=ROOT,
    )  # fmt: skip
    yield worker
    worker.stop()


def test_enqueue_runs_the_stage_to_success(
    runtime: Any, redis_url: str, t_default_worker: Proc
) -> None:
    result = runtime.flow.enqueue("noop", "w1", "j1", "main", {"value": 7})
    assert result.created
    wait_for(lambda: status_of(runtime, result.request_id) is Status.SUCCEEDED, what="success")
    row = runtime.flow.queue.get(result.request_id)
    assert row.result["value"] == 7
    assert row.result["holding"] is True  # a prefork child holds its connection
    # ... and keeps its parent's objects out of its collections (frozen before the fork,
    # where billiard forks its children: Linux; macOS spawns them)
    if sys.platform == "linux":
        assert row.result["gc_frozen"] > 10_000
    assert row.attempts == 1
    assert len(executions(redis_url, result.request_id)) == 1


def test_stage_writes_through_the_fenced_op_log(
    runtime: Any, redis_url: str, t_default_worker: Proc
) -> None:
    from onceflow.oplog import OpLog

    rid = runtime.flow.enqueue("write_cell", "w1", "j-cell", "main",
                               {"column": "fit", "value": 9}).request_id  # fmt: skip
    wait_for(lambda: status_of(runtime, rid) is Status.SUCCEEDED, what="success")
    oplog = OpLog(runtime.flow.queue.engine, runtime.flow.queue.settings)
    doc = oplog.get_sub_doc("w1", "job:j-cell")
    assert (doc.clock, doc.state) == (1, {"cells": {"fit": 9}})
    [op] = oplog.ops_since("w1", "job:j-cell")
    assert op.fence == rid
    assert runtime.flow.queue.get(rid).result == {"clock": 1}


def test_hand_off_is_dispatched_with_the_completion(
    runtime: Any, redis_url: str, t_default_worker: Proc
) -> None:
    rid = runtime.flow.enqueue("hand_off", "w1", "j-next", "main", {"value": 1}).request_id
    nxt = request_id_for("w1", "j-next", "main", "noop")

    # No sweeper runs here (redispatch_after is 30 s): the hand-off's wake-up was sent.
    def next_done() -> bool:
        rows = runtime.flow.queue.list(job_id="j-next", stage="noop")
        return bool(rows) and rows[0].status is Status.SUCCEEDED

    wait_for(next_done, what="the next stage")
    assert status_of(runtime, rid) is Status.SUCCEEDED
    assert runtime.flow.queue.get(nxt).result["value"] == 2


def test_a_hung_body_is_interrupted_at_max_runtime(
    runtime: Any, redis_url: str, t_default_worker: Proc
) -> None:
    """Celery's soft time limit (= max_runtime) stops a hung body."""
    rid = runtime.flow.enqueue("sleeper", "w1", "j-hang", "main", {}).request_id
    wait_for(lambda: status_of(runtime, rid) is Status.DEAD, timeout=60, what="dead")
    row = runtime.flow.queue.get(rid)
    # Celery's soft time limit, as the outcome table names it; a failed attempt, no crash.
    assert (row.error["type"], row.attempts, row.crash_attempts) == ("MaxRuntimeExceeded", 1, 0)
    assert len(executions(redis_url, rid)) == 1
