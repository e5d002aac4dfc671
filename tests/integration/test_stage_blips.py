"""A database blip after a stage's body succeeded never undoes it (issue 11, item 3).

The body kills every backend of the test database (its pooled connections included) just
before it returns, as a Postgres restart or a failover would: the completion meets a dead
connection. Before the fix the error went through ``fail``: the body ran again, or — with
``retry_on`` set — the request ended ``dead`` although its body succeeded.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import Engine

from onceflow import Status
from onceflow.oplog import OpLog
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.runtime import run_request
from tests.conftest import libpq


class Empty(BaseModel):
    pass


def kill_backends(database_url: str) -> int:
    """Terminate every other backend of the test database (never the shared server)."""
    with psycopg.connect(libpq(database_url), autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else 0


def make_flow(database_url: str, runs: list[int]) -> Flow:
    flow = Flow(name="blip-test")

    def body(ctx: StageContext, data: Empty) -> dict[str, Any]:
        runs.append(ctx.attempt)
        ctx.apply_op("doc", {"type": "cell.set", "column": "c", "value": 1}, key="c")
        killed = kill_backends(database_url)
        assert killed >= 1  # the pool's connections were open, and are now dead
        return {"ok": True}

    flow.stage("plain", input=Empty, worker_class="wc")(body)
    flow.stage("picky", input=Empty, worker_class="wc", retry_on=(ValueError,))(body)
    return flow


@pytest.mark.parametrize("stage", ["plain", "picky"])
def test_a_blip_at_completion_does_not_undo_a_successful_body(
    clean_db: Engine, redis_url: str, database_url: str, stage: str
) -> None:
    runs: list[int] = []
    flow = make_flow(database_url, runs)
    rid = flow.enqueue(stage, "w", "j", "main").request_id
    outcome = run_request(flow.queue, flow.spec(stage), rid, "host:1", lambda _: True)
    assert outcome["outcome"] == "succeeded"
    row = flow.queue.get(rid)
    assert (row.status, row.attempts, row.crash_attempts) == (Status.SUCCEEDED, 1, 0)
    assert row.result == {"ok": True}
    assert runs == [1]  # the body ran once
    assert OpLog(clean_db).get_sub_doc("w", "doc").clock == 1


def test_fenced_writes_retry_a_blip_and_join_their_first_attempt(
    clean_db: Engine, redis_url: str, database_url: str
) -> None:
    flow = Flow(name="blip-op-test")

    @flow.stage("writer", input=Empty, worker_class="wc")
    def writer(ctx: StageContext, data: Empty) -> dict[str, Any]:
        kill_backends(database_url)  # the write's pooled connection is dead
        first = ctx.apply_op("doc", {"type": "cell.set", "column": "c", "value": 2})
        return {"clock": first.clock}

    rid = flow.enqueue("writer", "w", "j", "main").request_id
    outcome = run_request(flow.queue, flow.spec("writer"), rid, "host:1", lambda _: True)
    assert outcome["outcome"] == "succeeded"
    assert flow.queue.get(rid).result == {"clock": 1}
    assert OpLog(clean_db).get_sub_doc("w", "doc").clock == 1


def test_a_completion_whose_answer_was_lost_is_recognised(clean_db: Engine, redis_url: str) -> None:
    """The retry after an ambiguous failure finds its own committed completion.

    The lost answer is made by committing the completion and then raising the error a
    dropped connection raises (the network part is the backend kills above).
    """
    from onceflow.errors import ConnectionLost

    flow = Flow(name="blip-landed-test")
    flow.stage("s", input=Empty, worker_class="wc")(lambda ctx, data: None)
    flow.stage("next", input=Empty, worker_class="wc2")(lambda ctx, data: None)
    rid = flow.enqueue("s", "w", "j", "main").request_id
    queue = flow.queue
    claim = queue.claim(rid, "host:1")
    assert claim is not None
    follow = [flow.new_request("next", "w", "j", "main")]
    done = threading.Event()

    def attempt() -> Any:
        if not done.is_set():
            done.set()
            queue.hand_off(claim, {"v": 1}, then=follow)
            raise ConnectionLost("the answer was lost with the connection")
        return queue.hand_off(claim, {"v": 1}, then=follow)

    def landed() -> Any:
        return queue._landed(claim, (Status.SUCCEEDED,))

    row = queue.fenced_retry(claim, attempt, landed)
    assert row.status is Status.SUCCEEDED and row.result == {"v": 1}
    [nxt] = queue.list(stage="next")
    assert nxt.dispatched_at is not None  # created once, by the first attempt
