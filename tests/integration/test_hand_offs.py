"""Hand-offs take the target stage's declaration — one builder for every entry point.

``ctx.then("tailor", …)`` used to build a bare request (worker class
``default``, input unchecked, dedupe/priority/attempts dropped), so with workers started
for their classes every hand-off stayed queued forever.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine

from onceflow import NewRequest, Status
from onceflow.errors import InvalidRequest, UnknownStage
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.runtime import run_request


class Score(BaseModel):
    score: int


class Empty(BaseModel):
    pass


def make_flow() -> Flow:
    flow = Flow(name="handoff-test")

    @flow.stage("second", input=Score, worker_class="wc-b", dedupe=False, priority=5,
                max_attempts=7, max_crash_attempts=4,
                alternate_worker_classes=("wc-c",))  # fmt: skip
    def second(ctx: StageContext, data: Score) -> dict[str, Any]:
        return {"got": data.score}

    @flow.stage("first", input=Empty, worker_class="wc-a")
    def first(ctx: StageContext, data: Empty) -> dict[str, Any]:
        ctx.then("second", {"score": "41"})  # coerced by the target's model
        return {"ok": True}

    @flow.stage("bad_input_then", input=Empty, worker_class="wc-a")
    def bad_input_then(ctx: StageContext, data: Empty) -> None:
        ctx.then("second", {"score": "not a number"})

    @flow.stage("unknown_then", input=Empty, worker_class="wc-a")
    def unknown_then(ctx: StageContext, data: Empty) -> None:
        ctx.then("no_such_stage", {})

    return flow


@pytest.fixture()
def flow(clean_db: Engine, redis_url: str) -> Flow:
    return make_flow()


def run(flow: Flow, stage: str, job: str) -> tuple[str, dict[str, Any]]:
    result = flow.enqueue(stage, "w", job, "main", {})
    spec = flow.spec(stage)
    outcome = run_request(flow.queue, spec, result.request_id, "host:1", lambda _: True)
    return result.request_id, outcome


def test_ctx_then_takes_the_target_declaration(flow: Flow) -> None:
    _, outcome = run(flow, "first", "j1")
    assert outcome["outcome"] == "succeeded"
    [row] = flow.queue.list(stage="second")
    assert row.worker_class == "wc-b"  # was "default": a queue nobody reads
    assert (row.priority, row.max_attempts, row.max_crash_attempts) == (5, 7, 4)
    assert row.dedupe is False and row.input == {"score": 41}
    # And a worker of the target's class claims it.
    [claim] = flow.queue.claim_next("wc-b", "host:2")
    assert claim.request_id == row.request_id


@pytest.mark.parametrize(
    ("stage", "error"), [("bad_input_then", "InvalidRequest"), ("unknown_then", "UnknownStage")]
)
def test_a_hand_off_that_does_not_fit_fails_the_stage_and_writes_nothing(
    flow: Flow, stage: str, error: str
) -> None:
    rid, outcome = run(flow, stage, "j2")
    assert outcome["outcome"] == "dead"  # a clear error, not retried
    row = flow.queue.get(rid)
    assert row.status is Status.DEAD and row.error["type"] == error
    assert row.attempts == 1
    assert flow.queue.list(stage="second") == []
    assert flow.queue.list(stage="no_such_stage") == []


def test_queue_complete_then_on_a_flow_queue_resolves_the_declaration(flow: Flow) -> None:
    flow.enqueue("first", "w", "j3", "main")
    [claim] = flow.queue.claim_next("wc-a", "host:1")
    flow.queue.complete(claim, {"ok": 1}, then=[NewRequest("w", "j3", "second", "main",
                                                           input={"score": 1})])  # fmt: skip
    [row] = flow.queue.list(stage="second")
    assert (row.worker_class, row.priority, row.max_attempts) == ("wc-b", 5, 7)


def test_queue_complete_then_with_an_undeclared_stage_changes_nothing(flow: Flow) -> None:
    flow.enqueue("first", "w", "j4", "main")
    [claim] = flow.queue.claim_next("wc-a", "host:1")
    with pytest.raises(UnknownStage):
        flow.queue.complete(claim, {}, then=[NewRequest("w", "j4", "nope")])
    with pytest.raises(InvalidRequest, match="invalid"):
        flow.queue.complete(claim, {}, then=[NewRequest("w", "j4", "second", input={})])
    assert flow.queue.get(claim.request_id).status is Status.RUNNING  # not completed
    assert flow.queue.list(stage="second") == []


def test_explicit_options_override_the_declaration_within_its_classes(flow: Flow) -> None:
    item = flow.new_request("second", "w", "j5", "", {"score": 2}, worker_class="wc-c",
                            priority=-1)  # fmt: skip
    assert (item.worker_class, item.priority, item.dedupe) == ("wc-c", -1, False)
    # Only a class the stage declares: a caller never routes work anywhere else.
    with pytest.raises(InvalidRequest, match="served by worker class 'wc-b' or 'wc-c'"):
        flow.new_request("second", "w", "j5", "", {"score": 2}, worker_class="unacked_index")
    with pytest.raises(InvalidRequest, match="unexpected keyword"):
        flow.new_request("second", "w", "j5", "", {"score": 2}, colour="red")


def test_a_hand_off_into_another_workspace_is_refused_and_changes_nothing(
    clean_db: Engine, redis_url: str
) -> None:
    """A hand-off completes the parent and enqueues its follow-ups in one transaction, so
    they stay in the parent's workspace (one shard when the database is split by
    workspace). Refused before anything is written with a Claim (it knows its workspace),
    and inside the transaction, rolled back, with a bare reference (it may not)."""
    from onceflow import ClaimRef, Queue

    queue = Queue(clean_db)
    rid = queue.enqueue("s", "w1", "j").request_id
    claim = queue.claim(rid, "worker")
    assert claim is not None
    other = NewRequest(workspace_id="w2", job_id="j", stage="t")
    for fence in (claim, ClaimRef(rid, claim.token)):
        with pytest.raises(InvalidRequest, match="workspace 'w1', not 'w2'"):
            queue.hand_off(fence, {"ok": True}, then=[other])
    assert queue.get(rid).status is Status.RUNNING  # the completion was rolled back
    assert queue.list(workspace_id="w2") == []
    same = NewRequest(workspace_id="w1", job_id="j", stage="t")
    done, followed = queue.hand_off(claim, {"ok": True}, then=[same])
    assert done.status is Status.SUCCEEDED and followed[0].workspace_id == "w1"
