"""The stages the dashboard tests run in a real Celery worker (worker class ``t-dash``)."""

from __future__ import annotations

import os
from typing import Any

import redis
from pydantic import BaseModel

from onceflow.locks import get_backend
from onceflow.tasks import Flow, StageContext

flow = Flow()
app = flow.app
WC = "t-dash"
FIXED = "onceflow-test:dash:fixed:"  # + job id: set by the test, the stage then succeeds
CELLS = "onceflow-test:dash:cell:"  # + job id: the stored value of the expensive call


def r() -> redis.Redis:
    return redis.Redis.from_url(os.environ["ONCEFLOW_REDIS_URL"])


class CellInput(BaseModel):
    value: int = 0


@flow.stage("cell", input=CellInput, worker_class=WC)
def cell(ctx: StageContext, data: CellInput) -> dict[str, Any]:
    """One compute-locked call per job: the first run computes, later runs are pre-flight hits."""
    key = CELLS + ctx.request.job_id
    outcome = ctx.compute_once(
        "cell",
        check=lambda: r().get(key),
        compute=lambda: data.value,
        store=lambda value: r().set(key, value),
    )
    get_backend().flush_counters()  # pre-flight hits reach Redis now, not at the next lock
    op = {"type": "cell.set", "column": "c", "value": data.value}
    ctx.apply_op(f"job:{ctx.request.job_id}", op, key=f"cell:{ctx.request.branch_path}")
    return {"value": data.value, "path": str(outcome.path)}


@flow.stage("flaky", input=CellInput, worker_class=WC, max_attempts=1)
def flaky(ctx: StageContext, data: CellInput) -> dict[str, Any]:
    """Fails (dead at once: one attempt) until the test sets the job's fixed flag."""
    if not r().exists(FIXED + ctx.request.job_id):
        raise RuntimeError(f"not fixed yet: job {ctx.request.job_id}")
    return {"fixed": True}


HOLD_WC = "t-dash-hold"
RELEASE = "onceflow-test:dash:release:"  # + job id: set by the test, the stage then returns


@flow.stage("hold", input=CellInput, worker_class=HOLD_WC, lease_seconds=6.0)
def hold(ctx: StageContext, data: CellInput) -> dict[str, Any]:
    """Runs (heartbeating) until the test releases it or an operator asks it to stop."""
    while not ctx.cancel_requested and r().blpop([RELEASE + ctx.request.job_id], 0.2) is None:
        pass
    return {"stopped": ctx.cancel_requested}


@flow.stage("split", input=CellInput, worker_class=WC)
def split(ctx: StageContext, data: CellInput) -> dict[str, Any]:
    """Hands off to ``value`` cells of its job (branches s0, s1, …): they share one call."""
    for i in range(data.value):
        ctx.then("cell", {"value": 7}, branch_path=f"s{i}")
    return {"handed_off": data.value}
