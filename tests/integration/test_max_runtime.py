"""A stage's runtime is bounded (``max_runtime``).

Before the fix a hung body kept its lease forever: the heartbeat thread renewed it every
lease/3, so nothing was ever rescued. Now heartbeats never extend the lease past the claim
time + max_runtime (database clock), the sweeper rescues the request, and the late
completion of the hung body is fenced off.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import Status
from onceflow.context import StageContext as Ctx
from onceflow.errors import InvalidRequest
from onceflow.models.requests import SweepResult
from onceflow.queue import Queue
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.runtime import _heartbeats, run_request
from tests.acceptance.procs import wait_for


class Empty(BaseModel):
    pass


def test_a_hung_body_loses_its_lease_at_max_runtime_and_is_failed_as_overrun(
    clean_db: Engine, redis_url: str
) -> None:
    flow = Flow(name="runtime-test")
    release = threading.Event()

    @flow.stage("hangs", input=Empty, worker_class="wc", lease_seconds=0.6, max_runtime=1.5)
    def hangs(ctx: StageContext, data: Empty) -> dict[str, Any]:
        release.wait(60)  # hung: never checks its lease
        return {"late": True}

    rid = flow.enqueue("hangs", "w", "j", "main").request_id
    outcome: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: outcome.update(
            run_request(flow.queue, flow.spec("hangs"), rid, "host:1", lambda _: True)
        )
    )
    runner.start()
    try:
        wait_for(lambda: flow.queue.get(rid).status is Status.RUNNING, what="claimed")

        # Heartbeats run every 0.2 s; the sweeper acts only once the lease lapsed, which
        # (database clock) is at claim time + max_runtime: no crash, a failed attempt
        # (MaxRuntimeExceeded) retried after the backoff.
        def sweep() -> SweepResult | None:
            result = flow.queue.rescue_expired()
            return result if result.overran or result.rescued else None

        swept = wait_for(sweep, timeout=30, what="the sweep of the hung run")
        assert (swept.overran, swept.rescued, swept.to_dispatch) == ([rid], [], [])
        row = flow.queue.get(rid)
        assert (row.status, row.attempts, row.crash_attempts) == (Status.QUEUED, 1, 0)
        assert row.error["type"] == "MaxRuntimeExceeded"
        assert row.run_after > row.updated_at  # after the backoff, not at once
        with clean_db.connect() as conn:
            span = conn.execute(
                text("SELECT extract(epoch FROM updated_at - created_at) FROM"
                     " workspace_process_requests WHERE request_id = :r"), {"r": rid}
            ).scalar_one()  # fmt: skip
        assert span >= 1.5  # not rescued before max_runtime
    finally:
        release.set()
        runner.join(30)
    assert outcome["outcome"] == "lease_lost"  # the late completion changed nothing
    assert flow.queue.get(rid).result is None


def test_stage_time_limits_stay_below_the_visibility_timeout(clean_db: Engine) -> None:
    flow = Flow(name="limits-test")

    @flow.stage("ok", input=Empty, max_runtime=100)
    def ok(ctx: StageContext, data: Empty) -> None:
        return None

    task = flow.app.tasks["onceflow.stage.ok"]
    visibility = flow.app.conf.broker_transport_options["visibility_timeout"]
    assert task.soft_time_limit == 100 and 100 < task.time_limit < visibility
    with pytest.raises(InvalidRequest, match="visibility timeout"):
        flow.stage("too_long", input=Empty, max_runtime=visibility)(ok)
    with pytest.raises(InvalidRequest, match="positive"):
        flow.stage("negative", input=Empty, max_runtime=-1)(ok)
    assert "too_long" not in flow.stages


def test_on_rabbitmq_time_limits_stay_below_its_consumer_timeout() -> None:
    """On an AMQP broker no visibility timeout applies (kombu's Redis option is not set);
    RabbitMQ's consumer_timeout bounds the stages, and a channel error restarts the
    worker's consumer instead of stopping the worker."""
    from onceflow.settings import get_settings

    settings = get_settings().model_copy(
        update={"broker_url": "amqp://guest:guest@127.0.0.1:5672//",
                "broker_consumer_timeout_seconds": 600.0}
    )  # fmt: skip
    flow = Flow(name="amqp-limits-test", settings=settings)
    conf = flow.app.conf
    assert "visibility_timeout" not in (conf.broker_transport_options or {})
    assert conf.broker_channel_error_retry is True

    @flow.stage("ok", input=Empty, max_runtime=500)  # hard limit 550 s
    def ok(ctx: StageContext, data: Empty) -> None:
        return None

    with pytest.raises(InvalidRequest, match=r"consumer_timeout .*\(600 s\)"):
        flow.stage("too_long", input=Empty, max_runtime=560)(ok)  # hard limit 616 s
    assert list(flow.stages) == ["ok"]
    # The default max_runtime (1500 s, hard limit 1650 s) fits RabbitMQ's default (1800 s).
    default = Flow(name="amqp-default-test", settings=settings.model_copy(
        update={"broker_consumer_timeout_seconds": 1800.0}))  # fmt: skip
    default.stage("fits", input=Empty)(ok)
    assert default.app.tasks["onceflow.stage.fits"].time_limit == 1650
    # On Redis the same stage is bounded by the visibility timeout (3600 s) alone.
    redis_flow = Flow(name="redis-limits-test", settings=settings.model_copy(
        update={"broker_url": "redis://127.0.0.1:6379/0"}))  # fmt: skip
    redis_flow.stage("long", input=Empty, max_runtime=2000)(ok)
    assert redis_flow.app.conf.broker_transport_options == {"visibility_timeout": 3600}
    assert redis_flow.app.conf.broker_channel_error_retry is False  # Celery's default
    # Your app on RabbitMQ: no visibility timeout added; its stages are bounded the same way.
    from celery import Celery

    mine = Celery("amqp-guest-test", broker="amqp://guest:guest@127.0.0.1:5672//",
                  set_as_current=False)  # fmt: skip
    guest = Flow(app=mine, settings=settings)
    assert "visibility_timeout" not in (mine.conf.broker_transport_options or {})
    with pytest.raises(InvalidRequest, match="consumer_timeout"):
        guest.stage("too_long", input=Empty, max_runtime=560)(ok)


class _Broken(Queue):
    """A queue whose heartbeat fails in a way no code path expects (a bug, not a blip)."""

    def heartbeat(self, claim: Any, *, now: Any = None) -> Any:
        raise RuntimeError("unexpected")


def test_the_heartbeat_thread_survives_any_exception(clean_db: Engine, redis_url: str) -> None:
    flow = Flow(name="hb-test")
    flow.stage("s", input=Empty, worker_class="wc", lease_seconds=0.6)(lambda c, d: None)
    for job in ("a", "b"):
        flow.enqueue("s", "w", job, "main")
    good, bad = flow.queue.claim_next("wc", "host:1", limit=2, lease_seconds=0.6)
    broken = _Broken(clean_db)
    ctx_bad, ctx_good = Ctx(broken, bad, "host:1"), Ctx(flow.queue, good, "host:1")
    _heartbeats.add(broken, ctx_bad, interval=0.2)
    _heartbeats.add(flow.queue, ctx_good, interval=0.2)
    try:
        first = flow.queue.get(good.request_id).heartbeat_at
        # The good stage keeps being heartbeaten after the broken one raised many times.
        wait_for(lambda: flow.queue.get(good.request_id).heartbeat_at != first, what="beat")
        second = flow.queue.get(good.request_id).heartbeat_at
        wait_for(lambda: flow.queue.get(good.request_id).heartbeat_at != second, what="beat 2")
        assert flow.queue.get(good.request_id).status is Status.RUNNING
    finally:
        _heartbeats.remove(ctx_bad)
        _heartbeats.remove(ctx_good)
