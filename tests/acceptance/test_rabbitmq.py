"""onceflow on RabbitMQ: the broker is ``amqp://``, Redis keeps locks and broadcasts.

Real Celery worker processes (``onceflow worker``) on the machine's RabbitMQ, in a vhost of
the run's own (``rabbitmq_url``). Every worker runs with its sweep watchdog off, so a
request that completes was woken by a message, never by a sweep the test did not call.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery
from sqlalchemy import Engine, text

from onceflow import Status
from onceflow.demo import procs
from onceflow.ids import request_id_for
from onceflow.keys import queue_name
from onceflow.settings import get_settings
from onceflow.tasks.sweeper import broker_backlog
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, Proc, started_together, stop_all, wait_for, worker_args
from tests.conftest import env

pytestmark = pytest.mark.slow

APP = "tests.acceptance.amqp_stages:flow"


@pytest.fixture(scope="module")
def amqp(rabbitmq_url: str, database_url: str, redis_url: str) -> Iterator[Any]:
    """The RabbitMQ tests' stages module, its app configured (as an API process's would be)
    with ``ONCEFLOW_BROKER_URL`` naming the run's RabbitMQ; its queues are deleted before and
    after (they are the run's vhost's, or the shared vhost's)."""
    os.environ.update(TEST_ENV)
    with env(ONCEFLOW_BROKER_URL=rabbitmq_url):
        get_settings.cache_clear()
        from tests.acceptance import amqp_stages

        conf = amqp_stages.app.conf  # loaded now, from this environment
        assert (conf.broker_url, conf.broker_channel_error_retry) == (rabbitmq_url, True)
        assert "visibility_timeout" not in conf.broker_transport_options
    get_settings.cache_clear()
    _delete_queues(amqp_stages)
    yield amqp_stages
    _delete_queues(amqp_stages)
    records = redis_lib.Redis.from_url(redis_url)
    for key in records.scan_iter(f"{amqp_stages.PREFIX}*"):
        records.delete(key)


def _delete_queues(stages: Any) -> None:
    with stages.app.connection_for_write() as conn:
        for name in stages.QUEUES:
            channel = conn.channel()
            try:
                channel.queue_delete(name)
            finally:
                channel.close()


@pytest.fixture()
def flow(amqp: Any, clean_db: Engine) -> Any:
    """The Flow of the RabbitMQ stages on an empty table."""
    return amqp.flow


@pytest.fixture()
def ws() -> str:
    """A workspace of this test's own: its request ids (and their Redis records) are new."""
    return f"ws-amqp-{secrets.token_hex(4)}"


def worker_env(rabbitmq_url: str) -> dict[str, str]:
    """A worker of these tests: the RabbitMQ broker, and no sweep watchdog."""
    return {"ONCEFLOW_BROKER_URL": rabbitmq_url, "ONCEFLOW_SWEEP_WATCHDOG": "false"}


def start_worker(tmp: Path, rabbitmq_url: str, worker_class: str, name: str, **extra: str) -> Proc:
    env = {"PYTHONPATH": str(ROOT), **worker_env(rabbitmq_url), **extra}
    return procs.start_worker(tmp, APP, worker_class, name=name, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def default_workers(
    amqp: Any, rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Proc]]:
    """Two workers (two processes each) of the default class, started side by side."""
    tmp = tmp_path_factory.mktemp("amqp-workers")
    commands = [
        (f"worker-{n}.log", worker_args(amqp.DEFAULT, app=APP, concurrency=2, name=n), " ready.")
        for n in ("amqp-a", "amqp-b")
    ]
    with started_together(tmp, *commands, env=worker_env(rabbitmq_url)) as workers:
        yield workers


def status_of(flow: Any, rid: str) -> Status:
    return flow.queue.get(rid).status


def test_stages_enqueued_by_several_processes_run_once(
    flow: Any, amqp: Any, ws: str, default_workers: list[Proc], rabbitmq_url: str
) -> None:
    n, enqueuers = 30, 3
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "ONCEFLOW_BROKER_URL": rabbitmq_url}
    command = [sys.executable, "-m", "tests.acceptance.amqp_stages", ws, str(n)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    runs = [subprocess.Popen(command, cwd=ROOT, env=environ, **pipes) for _ in range(enqueuers)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0] * enqueuers, outputs
    # Each row was created by exactly one of the processes; the others collapsed onto it.
    assert sum(json.loads(out)["created"] for out, _ in outputs) == n
    rids = [request_id_for(ws, f"job-{i}", "", "amqp_noop") for i in range(n)]
    wait_for(lambda: all(status_of(flow, rid) is Status.SUCCEEDED for rid in rids),
             timeout=60, what="every request to succeed")  # fmt: skip
    # Every wake-up reached a worker: one per created row and one duplicate per enqueue.
    wait_for(lambda: sum(amqp.processed(rid) for rid in rids) == n + enqueuers * n,
             timeout=60, what="every message consumed")  # fmt: skip
    assert [len(amqp.executions(rid)) for rid in rids] == [1] * n
    assert {flow.queue.get(rid).attempts for rid in rids} == {1}
    ran_on = {flow.queue.get(rid).result["pid"] for rid in rids}
    assert len(ran_on) > 1  # several worker processes shared the work
    assert flow.broker_backlog([amqp.DEFAULT]) == {amqp.DEFAULT: 0}


def test_a_hand_off_chain_completes(
    flow: Any, amqp: Any, ws: str, default_workers: list[Proc]
) -> None:
    first = flow.enqueue("amqp_chain", ws, "chain", "", {"left": 4}).request_id
    hops = [first] + [request_id_for(ws, "chain", f"hop-{k}", "amqp_chain") for k in (3, 2, 1, 0)]

    def done() -> bool:
        rows = {row.request_id: row.status for row in flow.queue.list(job_id="chain")}
        return all(rows.get(rid) is Status.SUCCEEDED for rid in hops)

    wait_for(done, timeout=60, what="the five hops")
    assert [flow.queue.get(rid).result["left"] for rid in hops] == [4, 3, 2, 1, 0]
    assert [len(amqp.executions(rid)) for rid in hops] == [1] * 5
    # Each hop was woken by the wake-up its hand-off sent over AMQP (no sweep ran).
    assert [amqp.processed(rid) for rid in hops] == [1] * 5


def queue_exists(stages: Any, name: str) -> bool:
    with stages.app.connection_for_write() as conn:
        channel = conn.channel()
        try:
            channel.queue_declare(queue=name, passive=True)
        except conn.channel_errors:  # 404: RabbitMQ closes the channel
            return False
        channel.close()
        return True


def test_a_queue_deleted_under_its_workers_is_declared_again(
    flow: Any, amqp: Any, ws: str, default_workers: list[Proc]
) -> None:
    name = queue_name(amqp.DEFAULT)
    with amqp.app.connection_for_write() as conn:
        conn.default_channel.queue_delete(name)
    # RabbitMQ cancels the workers' consumers; each restarts its own and declares the queue
    # again.
    wait_for(lambda: queue_exists(amqp, name), what="the queue declared again")
    rid = flow.enqueue("amqp_noop", ws, "after-delete", "", {"value": 1}).request_id
    wait_for(lambda: status_of(flow, rid) is Status.SUCCEEDED, what="success")
    assert len(amqp.executions(rid)) == 1
    assert [w.popen.poll() for w in default_workers] == [None, None]  # both serve on
    assert all("consumer: Connection to broker lost" in w.log() for w in default_workers)


def test_a_purged_or_deleted_queue_is_refilled_by_the_sweeper(
    flow: Any, amqp: Any, ws: str, rabbitmq_url: str, tmp_path: Path
) -> None:
    rid = flow.enqueue("amqp_noop", ws, "purge", "", {}, worker_class=amqp.PURGE)
    # The depth the sweeper reads: a passive queue_declare (a queue that does not exist: 0).
    assert flow.broker_backlog([amqp.PURGE, "amqp-nobody"]) == {amqp.PURGE: 1, "amqp-nobody": 0}
    with amqp.app.connection_for_write() as conn:
        assert conn.default_channel.queue_purge(queue_name(amqp.PURGE)) == 1
    assert flow.broker_backlog([amqp.PURGE]) == {amqp.PURGE: 0}
    swept = flow.sweep_once(redispatch_after=0)
    assert [d.request_id for d in swept.to_dispatch] == [rid.request_id]
    assert flow.broker_backlog([amqp.PURGE]) == {amqp.PURGE: 1}
    # The queue deleted, with no worker to declare it again: this process declared it once
    # and kombu would not again, so its sends (the sweeper's too) were dropped by RabbitMQ
    # (before: the re-send below left the queue missing, the depth at 0). The depth probe
    # declares a missing queue again.
    with amqp.app.connection_for_write() as conn:
        conn.default_channel.queue_delete(queue_name(amqp.PURGE))
    assert flow.broker_backlog([amqp.PURGE]) == {amqp.PURGE: 0}
    swept = flow.sweep_once(redispatch_after=0)
    assert [d.request_id for d in swept.to_dispatch] == [rid.request_id]
    assert flow.broker_backlog([amqp.PURGE]) == {amqp.PURGE: 1}
    worker = start_worker(tmp_path, rabbitmq_url, amqp.PURGE, "amqp-purge")
    try:
        wait_for(lambda: status_of(flow, rid.request_id) is Status.SUCCEEDED, what="success")
        assert len(amqp.executions(rid.request_id)) == 1
    finally:
        worker.stop()


def lease_lapsed(engine: Engine, rid: str) -> bool:
    with engine.connect() as conn:
        query = text("SELECT lease_expires_at <= now() FROM workspace_process_requests"
                     " WHERE request_id = :r")  # fmt: skip
        return bool(conn.execute(query, {"r": rid}).scalar_one())


def test_kill_9_mid_stage_the_wakeup_is_redelivered_and_completes_once(
    flow: Any, amqp: Any, ws: str, clean_db: Engine, rabbitmq_url: str, tmp_path: Path
) -> None:
    a = start_worker(tmp_path, rabbitmq_url, amqp.BLOCK, "amqp-kill-a")
    b = None
    try:
        rid = flow.enqueue("amqp_blocker", ws, "kill", "", {}).request_id
        [first] = wait_for(lambda: amqp.executions(rid), what="the first run")
        sent_at = flow.queue.get(rid).dispatched_at
        assert flow.broker_backlog([amqp.BLOCK]) == {amqp.BLOCK: 0}  # delivered, unacked
        a.signal_group(signal.SIGKILL)  # the worker and its pool child, mid-stage
        a.popen.wait(timeout=10)
        # RabbitMQ requeues the unacknowledged wake-up once the connection is gone (no
        # visibility timeout to wait for): it is ready again in the queue.
        wait_for(lambda: flow.broker_backlog([amqp.BLOCK]) == {amqp.BLOCK: 1},
                 what="the wake-up back in the queue")  # fmt: skip
        wait_for(lambda: lease_lapsed(clean_db, rid), what="the lease to lapse (DB clock)")
        b = start_worker(tmp_path, rabbitmq_url, amqp.BLOCK, "amqp-kill-b")
        runs = wait_for(lambda: len(amqp.executions(rid)) == 2 and amqp.executions(rid),
                        what="the second run")  # fmt: skip
        assert runs[1]["attempt"] == 2 and runs[1]["pid"] != first["pid"]
        amqp.release(rid, 2)
        wait_for(lambda: status_of(flow, rid) is Status.SUCCEEDED, what="success")
        row = flow.queue.get(rid)
        assert (row.attempts, row.crash_attempts) == (2, 1)
        assert row.result == {"pid": runs[1]["pid"], "attempt": 2}
        # The redelivered message woke it (the one message b processed); nothing re-sent.
        wait_for(lambda: amqp.processed(rid) == 1, what="b's message to finish")
        assert row.dispatched_at == sent_at
        assert len(amqp.executions(rid)) == 2
    finally:
        stop_all([proc for proc in (a, b) if proc is not None])


def test_an_unreachable_broker_reports_no_depth(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("amqp-down", broker="amqp://guest:guest@127.0.0.1:1//", set_as_current=False)
    with caplog.at_level("WARNING", logger="onceflow.sweeper"):
        assert broker_backlog(app, ["amqp-default"]) is None  # the sweeper's backoff alone
    assert "broker queue lengths unavailable" in caplog.text


def test_on_quorum_queues_wakeups_and_depth_work_the_same(
    flow: Any, amqp: Any, ws: str, rabbitmq_url: str, tmp_path: Path
) -> None:
    """Celery's ``task_create_missing_queue_type = "quorum"`` on the app, in the enqueuing
    process and the worker: the class's queue is a quorum queue, and nothing else changes."""
    quorum = {"AMQP_TEST_QUEUE_TYPE": "quorum"}
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "ONCEFLOW_BROKER_URL": rabbitmq_url}
    n = 10
    command = [sys.executable, "-m", "tests.acceptance.amqp_stages", ws, str(n), amqp.QUORUM]
    run = subprocess.run(command, cwd=ROOT, env={**environ, **quorum}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["created"] == n
    # The depth of a quorum queue reads the same way: each request and its duplicate wait.
    assert flow.broker_backlog([amqp.QUORUM]) == {amqp.QUORUM: 2 * n}
    # A quorum queue: declaring it as a classic queue is refused (inequivalent x-queue-type).
    with amqp.app.connection_for_write() as conn:
        channel = conn.channel()
        with pytest.raises(conn.channel_errors, match="x-queue-type"):
            channel.queue_declare(queue=queue_name(amqp.QUORUM), durable=True, auto_delete=False)
    worker = start_worker(tmp_path, rabbitmq_url, amqp.QUORUM, "amqp-quorum", **quorum)
    try:
        rids = [request_id_for(ws, f"job-{i}", "", "amqp_noop") for i in range(n)]
        wait_for(lambda: all(status_of(flow, rid) is Status.SUCCEEDED for rid in rids),
                 timeout=60, what="every request to succeed")  # fmt: skip
        wait_for(lambda: flow.broker_backlog([amqp.QUORUM]) == {amqp.QUORUM: 0},
                 what="the duplicates consumed")  # fmt: skip
        assert [len(amqp.executions(rid)) for rid in rids] == [1] * n
    finally:
        worker.stop()


def amqp_hostile_messages() -> Iterator[tuple[str, bytes, str, dict[str, Any]]]:
    """Messages any client of the vhost could publish: (what, body, content type, headers)."""
    task = "onceflow.stage.amqp_noop"

    def headers(**extra: Any) -> dict[str, Any]:
        tid = secrets.token_hex(8)
        return {"lang": "py", "task": task, "id": tid, "root_id": tid, "retries": 0,
                "timelimit": [None, None], "ignore_result": True, **extra}  # fmt: skip

    good = json.dumps([["x" * 8], {}, {}]).encode()
    yield "not JSON", b"garbage{", "application/json", headers()
    yield "a JSON array", b"[]", "application/json", headers()
    yield "not [args, kwargs, embed]", b'{"a": 1}', "application/json", headers()
    yield "nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, "application/json", headers()
    yield "timelimit that is not a pair", good, "application/json", headers(timelimit="x")
    yield "a bad eta", good, "application/json", headers(eta="garbage")
    yield "an unknown task", good, "application/json", headers(task="nope.unknown")
    yield "a task name that is a number", good, "application/json", headers(task=5)
    yield "args that are not a request id", json.dumps([[{"x": 1}, 2], {}, {}]).encode(), \
        "application/json", headers()  # fmt: skip
    yield "no headers", b"null", "application/json", {}
    yield "pickle", b"\x80\x04K\x01.", "application/x-python-serialize", headers()


def test_workers_serve_on_after_hostile_messages(
    flow: Any, amqp: Any, ws: str, default_workers: list[Proc]
) -> None:
    """The hardened transport is Redis's: on RabbitMQ, Celery itself must not let one of
    these stop a worker (it acknowledges or rejects them), and the guard on the pool
    hand-off gives back the slot of a message it cannot start."""
    name = queue_name(amqp.DEFAULT)
    with amqp.app.connection_for_write() as conn:
        producer = conn.Producer()
        for _, body, content_type, headers in amqp_hostile_messages():
            producer.publish(body, exchange="", routing_key=name, content_type=content_type,
                             content_encoding="utf-8", headers=headers)  # fmt: skip
    wait_for(lambda: flow.broker_backlog([amqp.DEFAULT]) == {amqp.DEFAULT: 0},
             what="every hostile message taken")  # fmt: skip
    rids = [flow.enqueue("amqp_noop", ws, f"after-{i}", "", {}).request_id for i in range(4)]
    wait_for(lambda: all(status_of(flow, rid) is Status.SUCCEEDED for rid in rids),
             what="good requests after the hostile messages")  # fmt: skip
    # Before: the first body that is not [args, kwargs, embed] stopped the worker that took
    # it ("Unrecoverable error: ValueError"); requeued, it stopped the other one too.
    assert [w.popen.poll() for w in default_workers] == [None, None]  # both serve on
    logs = "".join(w.log() for w in default_workers)
    assert logs.count("rejected a message Celery could not take") == 2, logs
    assert logs.count("it could not be handed to the pool") == 1, logs  # the bad timelimit
