"""One stage body for both contexts (``tests/acceptance/test_work_context.py``).

:func:`shared_body` takes a :class:`~onceflow.context.WorkContext` only: a real Celery
worker runs it as the ``ctx_body`` stage (a :class:`~onceflow.context.StageContext`), and a
Python ``PullWorker`` runs the very same function on a claim of the pull class (a
``PullContext``). It calls the counting stand-in provider (``tests/integration/standin.py``)
through ``ctx.compute_once``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from onceflow.context import WorkContext
from onceflow.tasks import Flow, StageContext
from tests.integration.standin import call_provider

flow = Flow()
app = flow.app
CELERY = "t-ctx"
PULL = "t-ctx-pull"
IDLE = "t-ctx-idle"  # served by no one: hand-offs land there and stay queued


class BodyInput(BaseModel):
    value: int
    provider: str


def cell(ctx: WorkContext, column: str) -> Any:
    """The stored value of a column of the job's cells, or None (a fenced read)."""
    return ctx.read_sub_doc(f"job:{ctx.job_id}").state.get("cells", {}).get(column)


def store(ctx: WorkContext, column: str, value: Any) -> object:
    op = {"type": "cell.set", "column": column, "value": value}
    return ctx.apply_op(f"job:{ctx.job_id}", op, key=f"cell:{column}")


def shared_body(ctx: WorkContext) -> dict[str, Any]:
    """Every member of the interface, used the same way under either context."""
    ids = [ctx.request_id, ctx.workspace_id, ctx.job_id, ctx.stage, ctx.branch_path]
    ctx.check()
    ctx.heartbeat()
    provider = ctx.input["provider"]
    doc = f"job:{ctx.job_id}"
    before = ctx.read_sub_doc(doc)
    written = store(ctx, "a", ctx.input["value"])
    after = ctx.read_sub_doc(doc)
    runs = []
    for _ in range(2):  # computed, then the pre-flight finds it stored
        outcome = ctx.compute_once(
            "eval:b",
            check=lambda: cell(ctx, "b"),
            compute=lambda: call_provider(provider, ctx.job_id),
            store=lambda value: store(ctx, "b", value),
        )
        runs.append({"value": outcome.value, "path": str(outcome.path)})
    ctx.then("ctx_next", {"value": ctx.input["value"] + 1}, branch_path="next")
    return {
        "interface": isinstance(ctx, WorkContext),
        "ids": ids,
        "claim_request_id": ctx.claim.request_id,
        "token_is_str": isinstance(ctx.claim.token, str),
        "attempt": ctx.attempt,
        "input": ctx.input,
        "lease_lost": ctx.lease_lost,
        "cancel_requested": ctx.cancel_requested,
        "before": [type(before).__name__, before.clock, before.state],
        "written": [type(written).__name__, written.clock, written.duplicate],
        "after": [type(after).__name__, after.clock, after.state.get("cells")],
        "compute_once": runs,
    }


@flow.stage(
    "ctx_body", input=BodyInput, worker_class=CELERY, alternate_worker_classes=(PULL,),
    hands_off_to=("ctx_next",),
)  # fmt: skip
def ctx_body(ctx: StageContext, data: BodyInput) -> dict[str, Any]:
    return shared_body(ctx)


@flow.stage("ctx_race", input=BodyInput, worker_class=PULL, lease_seconds=10.0)
def ctx_race(ctx: StageContext, data: BodyInput) -> dict[str, Any]:
    """Run by ``tests/acceptance/pull_racer.py`` processes (a pull class: never called here)."""
    raise NotImplementedError("a pull-class stage runs in the pull worker")


class NextInput(BaseModel):
    value: int


@flow.stage("ctx_next", input=NextInput, worker_class=IDLE)
def ctx_next(ctx: StageContext, data: NextInput) -> None:
    raise NotImplementedError("never run: the tests only look at the hand-off")
