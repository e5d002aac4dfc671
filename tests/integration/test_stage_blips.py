"""A database blip after a stage's body succeeded never undoes it.

The body kills every backend of the test database (its pooled connections included) just
before it returns, as a Postgres restart or a failover would: the completion meets a dead
connection. Before the fix the error went through ``fail``: the body ran again, or — with
``retry_on`` set — the request ended ``dead`` although its body succeeded.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

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
    """Repeating a completion that committed (its answer lost with the connection) returns
    the committed row instead of ``LeaseLost``; its hand-offs exist once and are marked for
    the sweeper's next wake-up (the lost attempt never sent theirs)."""
    flow = Flow(name="blip-landed-test")
    flow.stage("s", input=Empty, worker_class="wc")(lambda ctx, data: None)
    flow.stage("next", input=Empty, worker_class="wc2", dedupe=False)(lambda ctx, data: None)
    rid = flow.enqueue("s", "w", "j", "main").request_id
    queue = flow.queue
    claim = queue.claim(rid, "host:1")
    assert claim is not None
    follow = [flow.new_request("next", "w", "j", "main")]  # a random id, minted once
    _, [made] = queue.hand_off(claim, {"v": 1}, then=follow)
    assert made.created
    again, [same] = queue.hand_off(claim, {"v": 1}, then=follow)  # the "retry"
    assert again.status is Status.SUCCEEDED and again.result == {"v": 1}
    # The repeat gets the original answer: created by this claim's completion (as an op's
    # retry gets its original commit clock), so a caller whose first answer was lost learns it.
    assert same.request_id == made.request_id and same.created
    [nxt] = queue.list(stage="next")
    assert nxt.dispatched_at is None  # the next sweep sends its wake-up
    # Another claimant (a zombie) is still refused.
    other = queue.claim(rid, "host:2")
    assert other is None


def test_the_sdk_keeps_and_retries_an_op_through_a_database_blip(
    clean_db: Engine, redis_url: str, database_url: str, tmp_path: Any
) -> None:
    """In process, the database is the transport: a lost connection is not an answer."""
    from onceflow.oplog import InProcessTransport, WorkspaceClient

    client = WorkspaceClient(
        InProcessTransport(OpLog(clean_db)), "w", outbox=tmp_path / "o.db", backoff_base=0.01
    )
    first = client.apply("doc", {"type": "cell.set", "column": "a", "value": 1})
    assert first is not None and first.clock == 1
    assert kill_backends(database_url) >= 1  # the op log's pooled connection is dead
    second = client.apply("doc", {"type": "cell.set", "column": "b", "value": 2})
    assert second is not None and second.clock == 2 and not second.duplicate
    assert client.pending() == []
    assert OpLog(clean_db).get_sub_doc("w", "doc").state["cells"] == {"a": 1, "b": 2}


def test_a_completion_error_that_is_not_a_disconnect_is_retried_while_the_lease_holds(
    clean_db: Engine, redis_url: str
) -> None:
    """A failover's read-only error, a lock timeout, a pool timeout: not a lost connection,
    yet not an answer either. Retried while heartbeats still confirm the lease."""
    runs: list[int] = []
    flow = Flow(name="blip-store-error-test")

    @flow.stage("s", input=Empty, worker_class="wc", lease_seconds=3)
    def body(ctx: StageContext, data: Empty) -> dict[str, Any]:
        runs.append(ctx.attempt)
        return {"ok": True}

    with clean_db.begin() as conn:  # the completion fails 3 times, then goes through
        conn.execute(
            text("""
            CREATE SEQUENCE refuse_count;
            CREATE FUNCTION refuse_completion() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF nextval('refuse_count') <= 3 THEN
                    RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER refuse BEFORE UPDATE ON workspace_process_requests
            FOR EACH ROW WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION refuse_completion();
            """)
        )
    try:
        rid = flow.enqueue("s", "w", "j", "main").request_id
        outcome = run_request(flow.queue, flow.spec("s"), rid, "host:1", lambda _: True)
    finally:
        with clean_db.begin() as conn:
            conn.execute(text("DROP TRIGGER refuse ON workspace_process_requests"))
            conn.execute(text("DROP FUNCTION refuse_completion(); DROP SEQUENCE refuse_count"))
    assert outcome["outcome"] == "succeeded"
    row = flow.queue.get(rid)
    assert (row.status, row.attempts, row.result) == (Status.SUCCEEDED, 1, {"ok": True})
    assert runs == [1]


class Kind(BaseModel):
    kind: str


@pytest.mark.parametrize("kind", ["nul", "surrogate", "huge", "retry-later-nul"])
def test_an_error_the_store_cannot_take_is_recorded_not_run_again(
    clean_db: Engine, redis_url: str, kind: str
) -> None:
    """A stage raises an error whose text jsonb cannot store (a NUL from a provider's bytes,
    a lone surrogate from a bad decode) or that outgrows the payload limit: the failure is
    recorded, with its type and a storable message. Before: the store refused it, nothing
    was recorded, the row stayed running until its lease lapsed, and the sweeper ran the
    body again — a permanent error included."""
    from onceflow.errors import PermanentError, RetryLater

    runs: list[int] = []
    flow = Flow(name="unstorable-test")

    @flow.stage("boom", input=Kind, worker_class="wc", max_attempts=5)
    def boom(ctx: StageContext, data: Kind) -> None:
        runs.append(ctx.attempt)
        if data.kind == "nul":
            raise PermanentError("bad bytes from the provider: b'\x00\x01'")
        if data.kind == "surrogate":
            raise PermanentError("undecodable: \udcff")
        if data.kind == "huge":
            raise PermanentError("x" * 300_000)
        raise RetryLater(60, reason="provider said \x00")

    rid = flow.enqueue("boom", "w", f"j-{kind}", "main", {"kind": kind}).request_id
    outcome = run_request(flow.queue, flow.spec("boom"), rid, "host:1", lambda _: True)
    row = flow.queue.get(rid)
    assert runs == [1]
    assert row.lease_expires_at is None and row.error is not None
    if kind == "retry-later-nul":
        assert (outcome["outcome"], row.status) == ("retry", Status.QUEUED)
        assert row.error["message"] == "provider said \\x00"
    else:
        assert (outcome["outcome"], row.status) == ("dead", Status.DEAD)  # permanent: no retry
        assert row.error["type"] == "PermanentError"
        assert len(row.error["message"]) <= 2000
        assert (
            "\\x00" in row.error["message"] or "\\udcff" in row.error["message"] or (kind == "huge")
        )


def test_an_error_over_a_low_payload_limit_is_recorded_briefly(
    clean_db: Engine, redis_url: str
) -> None:
    """The payload limit set lower than an error's traceback: the failure is recorded with
    its type and a brief message (the retry decision kept), never left running."""
    from onceflow.errors import PermanentError
    from onceflow.settings import get_settings

    settings = get_settings().model_copy(update={"payload_limit_bytes": 1024})
    flow = Flow(name="low-limit-test", settings=settings)

    @flow.stage("boom", input=Empty, worker_class="wc")
    def boom(ctx: StageContext, data: Empty) -> None:
        raise PermanentError("y" * 1500)

    rid = flow.enqueue("boom", "w", "j-low", "main", {}).request_id
    outcome = run_request(flow.queue, flow.spec("boom"), rid, "host:1", lambda _: True)
    row = flow.queue.get(rid)
    assert (outcome["outcome"], row.status, row.lease_expires_at) == ("dead", Status.DEAD, None)
    assert row.error["type"] == "PermanentError"
    assert row.error["message"].startswith("not storable: ")
