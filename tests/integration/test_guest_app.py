"""A Flow in *your* Celery app is a good guest (docs/celery.md), on a real Redis broker and
real ``celery -A … worker`` processes (Celery's own CLI, not ``onceflow worker``):

- your app's settings stay yours (they used to be overridden by onceflow's defaults):
  your task keeps your serializer, acks, results, default queue and routes; onceflow's
  tasks carry their own options (late acks, JSON, no result);
- a worker started with ``-Q`` and the documented queue names runs the stages;
- a ``task_routes`` entry naming a stage's task (``onceflow.stage.<stage>``) is honoured,
  and the sweeper counts the wake-ups waiting there;
- declaring stages sets no deprecated ``queue`` task attribute (no warning);
- ``revoke`` of a wake-up does not cancel the request: the sweeper sends another; and
  ``revoke(terminate=True)`` kills the body mid-run, but the lease lapses and the
  sweeper runs the request again.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import Engine

from onceflow import Status
from onceflow.demo.procs import wait_for
from onceflow.keys import queue_name
from onceflow.tasks import Flow

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.guest_app:app"
QUEUES = [
    queue_name("guest-wc"),
    queue_name("guest-wc2"),
    queue_name("guest-slow"),
    "guest-stage-q",
    "guest-default",
    "default",
    "onceflow.guest",
]


@pytest.fixture()
def guest(redis_url: str, clean_db: Engine) -> Iterator[tuple[Any, redis_lib.Redis]]:
    from tests.integration import guest_app

    client = redis_lib.Redis.from_url(redis_url)
    client.delete(*QUEUES)
    yield guest_app, client
    client.delete(*QUEUES)


@contextmanager
def celery_worker(
    tmp: Path, queues: list[str], name: str = "guest", pool: str = "solo"
) -> Iterator[str]:
    """``celery -A tests.integration.guest_app:app worker -Q <queues>``, once ready."""
    node = f"{name}-{os.getpid()}@localhost"
    log = tmp / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, "worker", "-Q", ",".join(queues),
             "--pool", pool, "-c", "1", "-n", node, "--loglevel", "INFO"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: " ready." in log.read_text(), timeout=60, what=f"{name} ready")
        yield node
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _status(flow: Flow, request_id: str) -> Status:
    return flow.queue.get(request_id).status


def _messages(client: redis_lib.Redis, queue: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(queue, 0, -1)]


def test_your_settings_stay_yours_and_onceflows_tasks_carry_their_own(guest: Any) -> None:
    guest_app, _ = guest
    conf = guest_app.app.conf
    mine = {
        "task_default_queue": conf.task_default_queue,
        "task_serializer": conf.task_serializer,
        "task_acks_late": conf.task_acks_late,
        "task_ignore_result": conf.task_ignore_result,
        "worker_prefetch_multiplier": conf.worker_prefetch_multiplier,
        "result_backend": conf.result_backend,
        "task_routes": conf.task_routes,
    }
    assert mine == {
        "task_default_queue": "guest-default",
        "task_serializer": "yaml",
        "task_acks_late": False,
        "task_ignore_result": False,
        "worker_prefetch_multiplier": 4,
        "result_backend": guest_app.REDIS,
        "task_routes": guest_app.UserConfig.task_routes,
    }, "the user's own settings were changed by Flow(app=…)"
    user_task = guest_app.app.tasks["guest.add"]
    assert (user_task.acks_late, user_task.ignore_result, user_task.serializer) == (
        False, False, "yaml"
    )  # fmt: skip
    for name in ("onceflow.stage.guest_plain", "onceflow.sweep"):
        task = guest_app.app.tasks[name]
        options = (task.acks_late, task.reject_on_worker_lost, task.ignore_result)
        assert options == (True, True, True) and task.serializer == "json", name
    # What onceflow still sets on your app, where you left it unset (docs/celery.md).
    assert conf.beat_schedule["onceflow-sweep"]["options"]["queue"] == "onceflow.guest"
    assert conf.broker_transport_options["visibility_timeout"] == 3600


def test_declaring_stages_warns_nothing_and_an_own_app_keeps_onceflows_settings() -> None:
    class Empty(BaseModel):
        pass

    # Garbage of earlier tests (an unclosed event loop, a socket) warns when it is
    # collected: collected now, so only what declaring stages says is recorded below.
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flow = Flow(name="guest-warn")

        @flow.stage("guest_warn", input=Empty, worker_class="guest-warn")
        def body(ctx: Any, data: Empty) -> dict[str, Any]:
            return {}

        flow.app.finalize(auto=True)
        assert flow.app.tasks["onceflow.stage.guest_warn"].acks_late is True
    assert [str(w.message) for w in caught] == []
    # A Flow's own app is still configured in full.
    conf = flow.app.conf
    assert (conf.task_acks_late, conf.worker_prefetch_multiplier, conf.task_default_queue) == (
        True, 1, "default"
    )  # fmt: skip
    # accept_content without json gets json (onceflow's wake-ups are JSON); nothing else.
    app = Celery("guest-accept", set_as_current=False)
    app.conf.update(accept_content=["yaml"], broker_url="memory://")
    Flow(app=app)
    assert (app.conf.accept_content, app.conf.broker_url) == (["yaml", "json"], "memory://")


def test_documented_queues_and_routes_on_a_plain_celery_worker(guest: Any, tmp_path: Path) -> None:
    guest_app, client = guest
    flow = guest_app.flow
    plain = flow.enqueue("guest_plain", "w-guest", "j1", "main", {}).request_id
    routed = flow.enqueue("guest_routed", "w-guest", "j2", "main", {}).request_id
    mine = guest_app.add.delay(2, 3)
    waiting = {q: len(_messages(client, q)) for q in QUEUES if client.llen(q)}
    assert waiting == {
        queue_name("guest-wc"): 1,  # the stage's worker class queue
        "guest-stage-q": 1,  # the user's task_routes entry for onceflow.stage.guest_routed
        "guest-default": 1,  # the user's own task, in the user's default queue
    }, "wake-ups or the user's task went to the wrong queue"
    [wakeup] = _messages(client, queue_name("guest-wc"))
    [user_message] = _messages(client, "guest-default")
    assert (wakeup["content-type"], user_message["content-type"]) == (
        "application/json", "application/x-yaml"
    )  # fmt: skip
    # The sweeper counts the routed wake-up as waiting (no duplicate re-send).
    assert flow.broker_backlog(["guest-wc2"]) == {"guest-wc2": 1}
    # A stage task's own apply_async routes the same way (a duplicate wake-up: harmless).
    for stage, request_id in (("guest_plain", plain), ("guest_routed", routed)):
        guest_app.app.tasks[f"onceflow.stage.{stage}"].apply_async([request_id])
    assert (client.llen(queue_name("guest-wc")), client.llen("guest-stage-q")) == (2, 2)
    # `onceflow worker` would consume the routed queue too.
    assert "guest-stage-q" in flow.broker_queues(["guest-wc2"])

    queues = [queue_name("guest-wc"), "guest-stage-q", "guest-default"]
    with celery_worker(tmp_path, queues):
        wait_for(
            lambda: {_status(flow, plain), _status(flow, routed)} == {Status.SUCCEEDED},
            timeout=30,
            what="both stages to succeed on a plain celery worker",
        )
        assert mine.get(timeout=30) == 5  # the user's result backend kept its result


def test_a_revoked_wakeup_does_not_cancel_the_request(guest: Any, tmp_path: Path) -> None:
    guest_app, client = guest
    flow, app = guest_app.flow, guest_app.app
    # The worker does not consume the stage's queue yet: its wake-up waits there.
    with celery_worker(tmp_path, ["guest-default"], name="guest-revoke") as node:
        request_id = flow.enqueue("guest_plain", "w-guest", "j3", "main", {}).request_id
        [wakeup] = _messages(client, queue_name("guest-wc"))
        task_id = wakeup["headers"]["id"]
        assert app.control.revoke(task_id, destination=[node], reply=True, timeout=10)
        assert app.control.add_consumer(
            queue_name("guest-wc"), destination=[node], reply=True, timeout=10
        )
        log = tmp_path / "guest-revoke.log"
        wait_for(
            lambda: (
                f"Discarding revoked task: onceflow.stage.guest_plain[{task_id}]" in log.read_text()
            ),
            timeout=30,
            what="the worker to discard the revoked wake-up",
        )
        assert client.llen(queue_name("guest-wc")) == 0
        assert _status(flow, request_id) is Status.QUEUED  # the row is untouched
        # The sweeper finds a due row whose wake-up is in no queue: it sends another.
        assert [d.request_id for d in flow.sweep_once(redispatch_after=0).to_dispatch] == [
            request_id
        ]
        wait_for(
            lambda: _status(flow, request_id) is Status.SUCCEEDED,
            timeout=30,
            what="the request to run after the revoke",
        )
        assert flow.queue.get(request_id).attempts == 1


def test_revoke_terminate_kills_a_run_and_the_sweeper_runs_it_again(
    guest: Any, tmp_path: Path
) -> None:
    guest_app, _ = guest
    flow, app = guest_app.flow, guest_app.app
    queues = [queue_name("guest-slow")]
    with celery_worker(tmp_path, queues, name="guest-term", pool="prefork") as node:
        request_id = flow.enqueue("guest_slow", "w-guest", "j4", "main", {}).request_id
        wait_for(lambda: _status(flow, request_id) is Status.RUNNING, what="the body to start")
        [active] = app.control.inspect(destination=[node], timeout=10).active()[node]
        assert active["args"] == [request_id, "w-guest"]  # the key: id and workspace
        app.control.revoke(active["id"], terminate=True, destination=[node], reply=True)
        log = tmp_path / "guest-term.log"
        wait_for(lambda: "Terminating" in log.read_text(), timeout=30, what="the terminate")
        # The terminate reaches the body as SystemExit: under the one outcome table it is
        # recorded as an interrupted, retryable failure before the child exits. Had the
        # child died before that write, its lease would lapse and the sweep would rescue it
        # as a crash. Either way the request runs again, once.

        def swept_and_done() -> bool:
            flow.sweep_once(redispatch_after=0)  # rescues a lapsed lease, re-sends
            return _status(flow, request_id) is Status.SUCCEEDED

        wait_for(swept_and_done, timeout=30, interval=0.3, what="the request to run again")
        row = flow.queue.get(request_id)
        assert (row.attempts, row.result) == (2, {"attempt": 2})
        assert row.crash_attempts in (0, 1)


def test_which_routes_decide_the_queue() -> None:
    from onceflow.tasks.routing import routed_queue, send_options

    def router(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any) -> Any:
        if name == "onceflow.stage.boom":
            raise RuntimeError("a bug in the user's router")
        if name == "onceflow.stage.fn":
            return {"queue": "by-function"}
        return None

    app = Celery("guest-routes", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_routes=[
            {"onceflow.stage.prio": {"priority": 5}, "onceflow.stage.glob*": "globbed"},
            router,
        ],
    )
    cases = {stage: send_options(app, stage, "c", ["r"]) for stage in
             ("plain", "prio", "glob_x", "fn", "boom")}  # fmt: skip
    assert cases == {
        "plain": {"queue": "onceflow.wc.c"},
        "prio": {"queue": "onceflow.wc.c"},  # a route naming no destination
        "glob_x": {},  # Celery routes it: to "globbed"
        "fn": {},
        "boom": {"queue": "onceflow.wc.c"},  # a failing router never loses the wake-up
    }
    assert [routed_queue(app, s, "c") for s in ("plain", "glob_x", "fn")] == [
        "onceflow.wc.c", "globbed", "by-function"
    ]  # fmt: skip
