"""onceflow.testing.run_until_idle: a Flow's stages run inline on the real queue.

Real Postgres and Redis; no Celery worker. Each case checks the rows (status, attempts),
not only the report: the runner must leave what a worker would.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine

from onceflow import Status
from onceflow.context import oplog_for
from onceflow.errors import PermanentError, RetryLater
from onceflow.tasks import Flow, StageContext
from onceflow.testing import RunReport, TooManyRuns, UnknownStageDue, run_until_idle


class Score(BaseModel):
    score: int = 0


class Hop(BaseModel):
    n: int = 0


def make_flow(calls: list[str]) -> Flow:
    flow = Flow(name="testing-runner")

    @flow.stage("first", input=Score, worker_class="t-a", hands_off_to=("second",))
    def first(ctx: StageContext, data: Score) -> dict[str, Any]:
        ctx.then("second", {"score": data.score + 1})
        return {"first": data.score}

    @flow.stage("second", input=Score, worker_class="t-b")
    def second(ctx: StageContext, data: Score) -> dict[str, Any]:
        return {"second": data.score}

    @flow.stage("later", input=Score, worker_class="t-a")
    def later(ctx: StageContext, data: Score) -> dict[str, Any]:
        if ctx.attempt == 1:
            raise RetryLater(300, "provider busy")
        return {"attempt": ctx.attempt}

    @flow.stage("never", input=Score, worker_class="t-a", max_attempts=3)
    def never(ctx: StageContext, data: Score) -> None:
        raise RetryLater(300, "never ready")

    @flow.stage("broken", input=Score, worker_class="t-a")
    def broken(ctx: StageContext, data: Score) -> None:
        raise PermanentError("bad input for good")

    @flow.stage("cell", input=Score, worker_class="t-a")
    def cell(ctx: StageContext, data: Score) -> dict[str, Any]:
        doc = f"job:{ctx.job_id}"

        def provider() -> int:  # the paid call a compute lock must make once
            calls.append(ctx.request_id)
            return 42

        outcome = ctx.compute_once(
            "eval:fit",
            check=lambda: ctx.read_sub_doc(doc).state.get("cells", {}).get("fit"),
            compute=provider,
            store=lambda v: ctx.apply_op(
                doc, {"type": "cell.set", "column": "fit", "value": v}, key="cell:fit"
            ),
        )
        return {"fit": outcome.value}

    @flow.stage("loop", input=Hop, worker_class="t-c", hands_off_to=("loop",))
    def loop(ctx: StageContext, data: Hop) -> None:
        # Each hop on a branch of its own: a deduplicated request would collapse onto itself.
        ctx.then("loop", {"n": data.n + 1}, branch_path=f"hop-{data.n + 1}")

    return flow


@pytest.fixture()
def calls() -> list[str]:
    return []


@pytest.fixture()
def flow(clean_db: Engine, redis_url: str, calls: list[str]) -> Flow:
    return make_flow(calls)


@pytest.fixture()
def ws() -> str:
    # A workspace of the test's own: compute locks live in Redis, beyond the truncated tables.
    return f"ws-runner-{secrets.token_hex(4)}"


def row(flow: Flow, request_id: str) -> Any:
    return flow.queue.get(request_id)


def test_a_hand_off_runs_to_the_end(flow: Flow, ws: str) -> None:
    made = flow.enqueue("first", ws, "j1", "main", {"score": 1})
    report = run_until_idle(flow, workspace_id=ws)
    assert [(r.stage, r.outcome) for r in report.runs] == [
        ("first", "succeeded"),
        ("second", "succeeded"),
    ]
    assert report.delayed == []
    first = row(flow, made.request_id)
    assert (first.status, first.attempts, first.result) == (Status.SUCCEEDED, 1, {"first": 1})
    [follow] = flow.queue.list(workspace_id=ws, stage="second")
    assert (follow.status, follow.attempts, follow.result) == (
        Status.SUCCEEDED,
        1,
        {"second": 2},
    )
    assert report.runs[1].request_id == follow.request_id
    assert report.summary() == "2 run(s): 2 succeeded; 0 delayed"
    # Nothing due any more: a second call runs nothing.
    assert run_until_idle(flow, workspace_id=ws).runs == []


def test_a_retry_later_is_reported_delayed_then_run_with_include_delayed(
    flow: Flow, ws: str
) -> None:
    made = flow.enqueue("later", ws, "j2", "main", {})
    report = run_until_idle(flow, workspace_id=ws)
    assert report.outcomes() == {"retry": 1}
    [waiting] = report.delayed
    assert waiting.request_id == made.request_id
    queued = row(flow, made.request_id)
    assert (queued.status, queued.attempts) == (Status.QUEUED, 1)
    assert queued.error["type"] == "RetryLater"
    assert queued.run_after == waiting.run_after

    # Not due: another plain call runs nothing, and leaves the row as it was.
    assert run_until_idle(flow, workspace_id=ws).runs == []
    assert row(flow, made.request_id).attempts == 1

    report = run_until_idle(flow, workspace_id=ws, include_delayed=True)
    assert [(r.request_id, r.attempt, r.outcome) for r in report.runs] == [
        (made.request_id, 2, "succeeded")
    ]
    done = row(flow, made.request_id)
    assert (done.status, done.attempts, done.result) == (Status.SUCCEEDED, 2, {"attempt": 2})
    assert report.delayed == []


def test_include_delayed_counts_attempts_to_max_attempts(flow: Flow, ws: str) -> None:
    made = flow.enqueue("never", ws, "j8", "main", {})
    report = run_until_idle(flow, workspace_id=ws, include_delayed=True)
    assert [(r.attempt, r.outcome) for r in report.runs] == [
        (1, "retry"),
        (2, "retry"),
        (3, "dead"),
    ]
    dead = row(flow, made.request_id)
    assert (dead.status, dead.attempts) == (Status.DEAD, 3)
    assert dead.error["type"] == "RetryLater"
    assert report.delayed == []


def test_a_permanent_error_ends_dead(flow: Flow, ws: str) -> None:
    made = flow.enqueue("broken", ws, "j3", "main", {})
    report = run_until_idle(flow, workspace_id=ws, include_delayed=True)
    assert report.outcomes() == {"dead": 1}
    dead = row(flow, made.request_id)
    assert (dead.status, dead.attempts) == (Status.DEAD, 1)
    assert dead.error["type"] == "PermanentError"
    assert "bad input for good" in dead.error["message"]


def test_ops_and_a_compute_lock_pay_once_for_two_requests_of_a_cell(
    flow: Flow, ws: str, calls: list[str]
) -> None:
    a = flow.enqueue("cell", ws, "j4", "a", {})
    b = flow.enqueue("cell", ws, "j4", "b", {})
    report = run_until_idle(flow, workspace_id=ws)
    assert report.outcomes() == {"succeeded": 2}
    assert len(calls) == 1  # the stand-in was called by the first run only
    for made in (a, b):
        done = row(flow, made.request_id)
        assert (done.status, done.attempts, done.result) == (Status.SUCCEEDED, 1, {"fit": 42})
    oplog = oplog_for(flow.queue)
    ops = oplog.ops_since(ws, "job:j4")
    # One op, written under the first run's claim: the second run only read it.
    assert [(op.op_type, op.payload.get("value")) for op in ops] == [("cell.set", 42)]
    assert ops[0].fence is not None
    assert oplog.get_sub_doc(ws, "job:j4").state["cells"]["fit"] == 42


def test_the_loop_guard_stops_an_endless_hand_off_chain(flow: Flow, ws: str) -> None:
    flow.enqueue("loop", ws, "j5", "main", {"n": 0})
    with pytest.raises(TooManyRuns, match="made 5 runs") as caught:
        run_until_idle(flow, workspace_id=ws, max_runs=5)
    assert [r.outcome for r in caught.value.report.runs] == ["succeeded"] * 5
    rows = flow.queue.list(workspace_id=ws, stage="loop")
    by_status = sorted(r.status.value for r in rows)
    # The sixth hop was claimed to see it was due, then handed back unrun.
    assert by_status == ["queued"] + ["succeeded"] * 5
    [left] = [r for r in rows if r.status is Status.QUEUED]
    assert (left.attempts, left.claimed_by, left.input) == (0, None, {"n": 5})


def test_a_due_request_of_an_undeclared_stage_is_handed_back(flow: Flow, ws: str) -> None:
    other = Flow(name="testing-runner-other")  # serves "t-b" with a stage of its own

    @other.stage("elsewhere", input=Score, worker_class="t-b")
    def elsewhere(ctx: StageContext, data: Score) -> None:
        raise AssertionError("not due in this test")

    flow.enqueue("first", ws, "j6", "main", {"score": 1})
    run_until_idle(flow, workspace_id=ws, worker_classes=["t-a"])
    [follow] = flow.queue.list(workspace_id=ws, stage="second")
    with pytest.raises(UnknownStageDue, match="'second'"):
        run_until_idle(other, workspace_id=ws)
    back = row(flow, follow.request_id)
    assert (back.status, back.attempts, back.claimed_by) == (Status.QUEUED, 0, None)


def test_the_pytest_fixture_runs_the_flow(flow: Flow, ws: str, onceflow_runner: Any) -> None:
    made = flow.enqueue("first", ws, "j7", "main", {"score": 3})
    report: RunReport = onceflow_runner(flow, workspace_id=ws)
    assert report.outcomes() == {"succeeded": 2}
    assert row(flow, made.request_id).status is Status.SUCCEEDED
