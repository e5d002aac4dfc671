"""Every wake-up a sweep marks sent reaches the broker, and lost ones are never starved.

On a real Postgres and a real Redis broker (the messages are counted in Redis):

- A step that fails after rows were marked dispatched (a prune meeting a real error,
  here a trigger that refuses the delete) costs no wake-up: each batch is sent right
  after the statement that marks it, and prunes run last, each on its own.
- Rows that never had a wake-up and rows whose wake-up was lost each get a share of the
  sweep's limit: however many never-sent rows wait, lost ones are re-sent in the same sweep.
- Two Flows on one broker: beat's sweeps of each go to a queue only its workers consume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import NewRequest
from onceflow.demo.procs import start_worker, wait_for
from onceflow.keys import queue_name
from onceflow.settings import Settings, get_settings
from onceflow.tasks import MAINTENANCE_QUEUE, SWEEP_TASK, Flow
from tests.integration.test_claims import db_now
from tests.integration.test_sweeper_guarantees import request_ids_in

WC = "sd-wake"


class Empty(BaseModel):
    pass


def make_flow(settings: Settings | None = None) -> Flow:
    flow = Flow(name="sweep-delivery", settings=settings)

    @flow.stage("sd", input=Empty, worker_class=WC)
    def body(ctx: Any, data: Empty) -> dict[str, Any]:
        return {}

    return flow


@pytest.fixture()
def broker(redis_url: str, clean_db: Engine) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url)
    client.delete(queue_name(WC))
    yield client
    client.delete(queue_name(WC))


@contextmanager
def deletes_refused(engine: Engine, table: str) -> Iterator[None]:
    """Every DELETE on ``table`` raises (a statement trigger), until the block ends."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE OR REPLACE FUNCTION sd_refuse_delete() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN RAISE EXCEPTION USING MESSAGE = 'deletes on ' || TG_TABLE_NAME "
            "|| ' are refused'; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER sd_refuse_delete BEFORE DELETE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION sd_refuse_delete()"
        )
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS sd_refuse_delete ON {table}")
            conn.exec_driver_sql("DROP FUNCTION IF EXISTS sd_refuse_delete()")


# ------------------------------------------- item 1: a failing later step costs no wake-up


@pytest.mark.parametrize(
    "table", ["workspace_sub_doc_ops", "workspace_process_requests"], ids=["oplog", "queue"]
)
def test_a_failing_prune_never_costs_a_wakeup_the_sweep_marked_sent(
    broker: redis_lib.Redis, clean_db: Engine, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Both prunes on: the op log's (every sweep, by default) and the queue's retention.
    settings = get_settings().model_copy(
        update={"retention_seconds": 3600.0, "op_retention_seconds": 3600.0}
    )
    flow = make_flow(settings)
    lapsed = flow.enqueue("sd", "w", "lapsed").request_id
    claim = flow.queue.claim(lapsed, "gone-worker", lease_seconds=0.05)
    assert claim is not None
    wait_for(lambda: db_now(clean_db) > claim.lease_expires_at, what="the lease to lapse")
    unsent = flow.enqueue("sd", "w", "unsent").request_id
    flow.queue.mark_undispatched(unsent)  # its send failed: the next sweep must send it
    broker.delete(queue_name(WC))  # no wake-up waits in the broker
    assert flow.queue.get(unsent).dispatched_at is None

    error: Exception | None = None
    with caplog.at_level(logging.WARNING), deletes_refused(clean_db, table):
        try:
            flow.sweep_once()
        except Exception as exc:  # what matters is what reached the broker
            error = exc

    # The rescued row and the never-sent row are marked dispatched: their wake-ups must be
    # in the broker now, not after the stale re-send (>= redispatch_after, with backoff).
    assert sorted(request_ids_in(broker, WC)) == sorted([lapsed, unsent]), error
    for rid in (lapsed, unsent):
        assert flow.queue.get(rid).dispatched_at is not None
    # The failing prune is logged, and the sweep itself still succeeds.
    assert error is None
    assert any("prune" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)


# ------------------------------------------ item 3: lost wake-ups get their share of a sweep


@pytest.mark.parametrize("with_backlog", [True, False], ids=["broker-lengths", "backoff-only"])
def test_lost_wakeups_are_resent_however_many_rows_were_never_sent(
    broker: redis_lib.Redis, clean_db: Engine, with_backlog: bool
) -> None:
    flow = make_flow()
    lost = [flow.enqueue("sd", "w", f"lost{i}").request_id for i in range(5)]
    broker.delete(queue_name(WC))  # their wake-ups are gone (a Redis restart without persistence)
    fresh = [NewRequest("w", f"u{i}", "sd", worker_class=WC) for i in range(20)]
    unsent = [r.request_id for r in flow.queue.enqueue_many(fresh)]
    for rid in unsent:  # a broker outage: every send failed, so all are marked unsent
        flow.queue.mark_undispatched(rid)

    # Two minutes on (database time), with wake-ups stale after one: 20 never-sent rows,
    # more than the limit of 10, and 5 lost ones. Each kind gets half the limit.
    later = db_now(clean_db) + timedelta(seconds=120)
    swept = flow.queue.sweep_once(
        redispatch_after=60,
        limit=10,
        stages=["sd"],
        backlog=flow.broker_backlog if with_backlog else None,
        now=later,
    )
    for item in swept.to_dispatch:
        flow.dispatch(item)

    in_broker = request_ids_in(broker, WC)
    assert sorted(set(in_broker) & set(lost)) == sorted(lost)  # every lost one, this sweep
    assert len(in_broker) == 10  # the limit holds
    assert len(set(in_broker) & set(unsent)) == 5


def test_a_share_nobody_needs_passes_to_the_other_kind(
    broker: redis_lib.Redis, clean_db: Engine
) -> None:
    flow = make_flow()
    lost = [flow.enqueue("sd", "w", f"lost{i}").request_id for i in range(12)]
    broker.delete(queue_name(WC))
    later = db_now(clean_db) + timedelta(seconds=120)

    # Nothing never-sent: all 10 places go to lost wake-ups.
    swept = flow.queue.sweep_once(
        redispatch_after=60, limit=10, stages=["sd"], backlog=flow.broker_backlog, now=later
    )
    assert len(swept.to_dispatch) == 10
    assert {d.request_id for d in swept.to_dispatch} <= set(lost)

    # 2 lost left, 20 never sent: the lost ones take 2 places, the never-sent ones 8.
    fresh = [NewRequest("w", f"u{i}", "sd", worker_class=WC) for i in range(20)]
    unsent = [r.request_id for r in flow.queue.enqueue_many(fresh)]
    for rid in unsent:
        flow.queue.mark_undispatched(rid)
    swept = flow.queue.sweep_once(redispatch_after=60, limit=10, stages=["sd"], now=later)
    ids = [d.request_id for d in swept.to_dispatch]
    assert len(ids) == 10
    assert len(set(ids) & set(lost)) == 2
    assert len(set(ids) & set(unsent)) == 8


# ------------------------------------- item 5: each Flow's beat sweeps reach its own workers


@pytest.mark.slow
def test_a_flows_worker_never_takes_another_flows_beat_sweep(
    redis_url: str, clean_db: Engine, tmp_path: Path
) -> None:
    from tests.integration.sweep_flows import flow_a, flow_b

    # Where beat sends each Flow's sweeps (its schedule entry, applied as beat applies it).
    entries = {f.name: f.app.conf.beat_schedule["onceflow-sweep"] for f in (flow_a, flow_b)}
    beat_queue = {name: entry["options"]["queue"] for name, entry in entries.items()}
    client = redis_lib.Redis.from_url(redis_url)
    client.delete(*beat_queue.values(), MAINTENANCE_QUEUE, queue_name("sd-a"), queue_name("sd-b"))
    # Only Flow B has a worker (its watchdog off: it sweeps only when beat says so).
    worker = start_worker(
        tmp_path, "tests.integration.sweep_flows:flow_b", name="sd-b",
        env={"ONCEFLOW_SWEEP_WATCHDOG": "false"},
    )  # fmt: skip
    try:
        for flow in (flow_a, flow_b):  # A's sweep first
            entry = entries[flow.name]
            flow.app.tasks[entry["task"]].apply_async(**entry["options"])

        def swept_by() -> dict[str, str]:
            with clean_db.connect() as conn:
                rows = conn.execute(text("SELECT name, swept_by FROM onceflow_sweeps"))
                return {r[0]: r[1] for r in rows}

        done = wait_for(swept_by, timeout=60, what="flow B's worker to run a beat sweep")
        assert list(done) == [flow_b.sweep_name] and done[flow_b.sweep_name].startswith("beat@")
        # Flow A's sweep was not taken by B's worker: it waits for A's workers.
        assert client.llen(beat_queue[flow_a.name]) == 1
    finally:
        worker.stop()
        client.delete(*beat_queue.values(), MAINTENANCE_QUEUE)

    # Each Flow's own queue: `onceflow worker` consumes it, beat sends there, and in one
    # process with two Flows each Celery app has its own sweep task (none shared).
    for flow in (flow_a, flow_b):
        assert beat_queue[flow.name] == flow.maintenance_queue != MAINTENANCE_QUEUE
        assert flow.app.tasks[SWEEP_TASK].flow is flow
        assert {n for n in flow.app.tasks if n.startswith("onceflow.")} == {
            SWEEP_TASK, *(spec.task_name for spec in flow.stages.values())
        }  # fmt: skip
