"""The sweeper's guarantees on a real Postgres and a real Redis broker.

- Sweeps begin with a compare-and-set on the database clock (beat and worker watchdogs).
- A wake-up waiting in the broker behind a backlog is not sent again; a lost one is.
- A Flow's sweep touches only the stages it declares; `onceflow sweep` needs such a Flow.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import NewRequest, Queue, Status
from onceflow.demo.procs import wait_for
from onceflow.keys import queue_name
from onceflow.models import Dispatch
from onceflow.tasks import Flow
from tests.conftest import table_snapshot
from tests.integration.test_claims import db_now

QUEUES = tuple(queue_name(wc) for wc in ("sg-a", "sg-b", "sg-storm"))


class Empty(BaseModel):
    pass


def make_flow(name: str, stage: str, worker_class: str) -> Flow:
    flow = Flow(name=name)

    @flow.stage(stage, input=Empty, worker_class=worker_class)
    def body(ctx: Any, data: Empty) -> dict[str, Any]:
        return {}

    return flow


@pytest.fixture()
def broker(redis_url: str, clean_db: Engine) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url)
    client.delete(*QUEUES)
    yield client
    client.delete(*QUEUES)


def rows_of(engine: Engine, stage: str) -> dict[str, Any]:
    """Every row of ``stage`` as JSON (whatever columns the schema has)."""
    query = text(
        "SELECT request_id, to_jsonb(w) FROM workspace_process_requests w WHERE stage = :s"
    )
    with engine.connect() as conn:
        return {r[0]: r[1] for r in conn.execute(query, {"s": stage})}


def request_ids_in(client: redis_lib.Redis, worker_class: str) -> list[str]:
    """The request ids of the Celery messages waiting in the class's queue (a Redis list)."""
    out = []
    for raw in client.lrange(queue_name(worker_class), 0, -1):
        envelope = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(envelope["body"]))
        out.append(args[0])
    return out


# ------------------------------------------------------------ the sweep compare-and-set


def test_begin_sweep_is_a_compare_and_set_on_the_database_clock(
    api_queue: Queue, clean_db: Engine
) -> None:
    queue = api_queue  # both APIs (the async one's contenders share one event loop)
    first = queue.begin_sweep("flow:x", "beat@a", min_gap=60)
    assert first.won and 59 < first.next_in <= 60  # no row yet: inserted, won
    again = queue.begin_sweep("flow:x", "watchdog@b", min_gap=60)
    assert not again.won and 0 < again.next_in <= 60
    assert queue.begin_sweep("flow:x", "call@c", min_gap=0).won  # a direct sweep always runs
    assert not queue.begin_sweep("flow:x", "watchdog@b", min_gap=60).won

    # Many contenders at once (watchdogs of every worker): exactly one wins.
    barrier = threading.Barrier(8)
    wins: list[bool] = []

    def contend(i: int) -> None:
        barrier.wait()
        wins.append(queue.begin_sweep("flow:race", f"watchdog@{i}", min_gap=60).won)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(wins) == [False] * 7 + [True]
    with clean_db.connect() as conn:
        names = conn.execute(text("SELECT name FROM onceflow_sweeps ORDER BY name")).scalars()
        assert list(names) == ["flow:race", "flow:x"]


def test_flows_with_other_stages_keep_separate_sweep_rows(broker: redis_lib.Redis) -> None:
    flow_a = make_flow("same-name", "a1", "sg-a")
    flow_b = make_flow("same-name", "b1", "sg-b")
    assert flow_a.sweep_name != flow_b.sweep_name
    # Flow B's sweep (say its beat) never makes Flow A's watchdogs stand down.
    assert flow_b.sweep_if_due(60, by="beat@b") is not None
    assert flow_a.sweep_if_due(60, by="watchdog@a") is not None
    assert flow_a.sweep_if_due(60, by="watchdog@a") is None


# ------------------------------------------------------------------ item 8: foreign flows


def test_a_foreign_flows_sweep_leaves_rows_of_other_stages_alone(
    broker: redis_lib.Redis, clean_db: Engine
) -> None:
    flow_a = make_flow("flow-a", "a1", "sg-a")
    flow_b = make_flow("flow-b", "b1", "sg-b")
    waiting = [flow_a.enqueue("a1", "w", f"j{i}").request_id for i in range(3)]
    lapsed = flow_a.enqueue("a1", "w", "lapsed").request_id
    claim = flow_a.queue.claim(lapsed, "gone-worker", lease_seconds=0.05)
    assert claim is not None
    wait_for(lambda: db_now(clean_db) > claim.lease_expires_at, what="the lease to lapse")
    # Every wake-up of flow A is lost: only flow A can send them again.
    broker.delete(queue_name("sg-a"))
    before = rows_of(clean_db, "a1")

    swept_b = flow_b.sweep_once(redispatch_after=0)
    assert (swept_b.rescued, swept_b.to_dispatch) == ([], [])
    # Untouched: status, dispatched_at, redispatch_count, crash_attempts — every column.
    assert rows_of(clean_db, "a1") == before
    assert broker.llen(queue_name("sg-b")) == 0

    swept_a = flow_a.sweep_once(redispatch_after=0)
    assert swept_a.rescued == [lapsed]
    assert sorted(d.request_id for d in swept_a.to_dispatch) == sorted([*waiting, lapsed])
    assert sorted(request_ids_in(broker, "sg-a")) == sorted([*waiting, lapsed])


def test_a_bare_queue_sweep_covers_every_stage_or_the_stages_named(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    queue.enqueue_many([NewRequest("w", "j", s, worker_class="default") for s in ("x", "y")])
    later = db_now(clean_db) + timedelta(seconds=120)
    only_x = api_queue.sweep_once(now=later, stages=["x"])
    assert [d.stage for d in only_x.to_dispatch] == ["x"]
    rest = api_queue.sweep_once(now=later)  # no stages: every stage (the caller sends them all)
    assert [d.stage for d in rest.to_dispatch] == ["y"]


def onceflow_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd(), **env},
    )


def test_sweep_cli_refuses_without_a_flow_that_declares_stages(
    broker: redis_lib.Redis, clean_db: Engine
) -> None:
    flow_a = make_flow("flow-a", "a1", "sg-a")
    flow_a.enqueue("a1", "w", "j1")
    with clean_db.begin() as conn:  # a wake-up due for a re-send
        conn.execute(text("UPDATE workspace_process_requests SET dispatched_at = '2000-01-01'"))
    before = table_snapshot(clean_db)

    # The two refusals run side by side (neither may write or send anything).
    with ThreadPoolExecutor(2) as pool:
        # ONCEFLOW_APP unset: the default Flow, which declares none
        default_run = pool.submit(onceflow_cli, "sweep")
        bare_run = pool.submit(onceflow_cli, "sweep", "--app", "tests.acceptance.stages:app")
        default, bare = default_run.result(), bare_run.result()
    assert default.returncode == 2, default.stdout
    assert "declares no stages" in default.stderr
    assert bare.returncode == 2 and "bare Celery app" in bare.stderr
    assert table_snapshot(clean_db) == before  # nothing marked dispatched, nothing sent
    assert broker.llen(queue_name("sg-a")) == 1

    ok = onceflow_cli("sweep", "--app", "tests.acceptance.stages:flow", "--redispatch-after", "0")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["dispatched"] == []  # stage a1 is not the test flow's
    assert table_snapshot(clean_db) == before


# ------------------------------------------------------------------- item 7: wake-up storms

ROWS = 300


def test_a_backlog_waiting_in_the_broker_gets_no_second_wakeup(
    broker: redis_lib.Redis, clean_db: Engine
) -> None:
    flow = make_flow("storm", "storm", "sg-storm")
    items = [NewRequest("w", f"j{i}", "storm", worker_class="sg-storm") for i in range(ROWS)]
    ids = [r.request_id for r in flow.queue.enqueue_many(items)]
    for rid in ids:
        assert flow.dispatch(Dispatch(rid, "storm", "sg-storm"))
    assert broker.llen(queue_name("sg-storm")) == ROWS

    # Every row has waited longer than redispatch_after (0 s): the old sweeper re-sent them
    # all at every sweep. Their messages are all still in the broker: nothing to re-send.
    resent = sum(len(flow.sweep_once(redispatch_after=0).to_dispatch) for _ in range(5))
    assert broker.llen(queue_name("sg-storm")) <= 1.2 * ROWS
    assert resent == 0

    # A slow worker takes 100 messages and finishes those rows: the rest still wait.
    assert len(broker.rpop(queue_name("sg-storm"), 100) or []) == 100
    taken = ids[:100]
    for rid in taken:
        claim = flow.queue.claim(rid, "slow-worker")
        assert claim is not None
        flow.queue.complete(claim, {})
    assert sum(len(flow.sweep_once(redispatch_after=0).to_dispatch) for _ in range(3)) == 0

    # Rows whose send failed (dispatched_at NULL) are always sent, backlog or not.
    for rid in ids[100:103]:
        flow.queue.mark_undispatched(rid)
    assert sorted(d.request_id for d in flow.sweep_once().to_dispatch) == sorted(ids[100:103])

    # 50 messages lost: exactly 50 re-sent (due rows - messages waiting).
    broker.rpop(queue_name("sg-storm"), 50)
    assert broker.llen(queue_name("sg-storm")) == ROWS - 100 + 3 - 50
    assert len(flow.sweep_once(redispatch_after=0).to_dispatch) == 50 - 3
    assert broker.llen(queue_name("sg-storm")) == ROWS - 100

    # The whole queue purged (a Redis restart without persistence): every wake-up re-sent.
    broker.delete(queue_name("sg-storm"))
    swept = flow.sweep_once(redispatch_after=0)
    assert sorted(d.request_id for d in swept.to_dispatch) == sorted(ids[100:])
    assert sorted(request_ids_in(broker, "sg-storm")) == sorted(ids[100:])
    assert flow.sweep_once(redispatch_after=0).to_dispatch == []


def test_without_the_broker_resends_of_one_row_back_off(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    ids = [r.request_id for r in queue.enqueue_many([NewRequest("w", f"j{i}", "s")
                                                     for i in range(20)])]  # fmt: skip
    start = db_now(clean_db)
    resends: Counter[str] = Counter()
    # 16 sweeps, one per redispatch interval (10 s), nobody claiming: the wake-ups may all be
    # lost, so each row is re-sent — after 1, 2, 4, 8 intervals, not at every sweep.
    for k in range(1, 17):
        swept = api_queue.sweep_once(redispatch_after=10, now=start + timedelta(seconds=10 * k + 1))
        resends.update(d.request_id for d in swept.to_dispatch)
    assert set(resends) == set(ids)
    assert set(resends.values()) == {4}
    assert all(queue.get(rid).status is Status.QUEUED for rid in ids)
