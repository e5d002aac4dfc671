"""The stages of the claim-scope attacks: pull-worker stages, and a paid Celery-class stage.

``tab_eval`` declares nothing: its claims reach its job's sub-docs (the default) and hand
off nowhere. ``tab_board`` declares other sub-docs; ``tab_step`` declares one hand-off
target, ``tab_next``. ``paid_call`` stands for a stage that makes paid LLM calls on Celery
workers: a pull worker's completion must never create its rows (no worker serves it here,
so a row created would wait in the table and its wake-up in the broker queue).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from onceflow.tasks import Flow, StageContext

PULL = "t-scope-tab"
PAID = "t-scope-llm"

flow = Flow(name="onceflow-sec-scopes", pull_worker_classes=(PULL,))
app = flow.app


class StepInput(BaseModel):
    value: int = 0


def _served_over_http(ctx: StageContext, data: StepInput) -> dict[str, Any]:
    raise AssertionError("a pull-worker stage: claimed over HTTP, never run in Python")


flow.stage("tab_eval", input=StepInput, worker_class=PULL)(_served_over_http)
flow.stage(
    "tab_board", input=StepInput, worker_class=PULL,
    sub_docs=("job:{job_id}", "board:{workspace_id}", "notes:{request_id}:*"),
)(_served_over_http)  # fmt: skip
flow.stage("tab_step", input=StepInput, worker_class=PULL, hands_off_to=("tab_next",))(
    _served_over_http
)
flow.stage("tab_next", input=StepInput, worker_class=PULL)(_served_over_http)


@flow.stage("paid_call", input=StepInput, worker_class=PAID)
def paid_call(ctx: StageContext, data: StepInput) -> dict[str, Any]:
    raise AssertionError("the paid stage is never run by these tests")
