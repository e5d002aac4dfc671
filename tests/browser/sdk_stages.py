"""The stages of the SDK tests (``ONCEFLOW_APP=tests.browser.sdk_stages:flow``).

``t-tab*`` classes are pull classes: browser tabs claim them over HTTP with the SDK's
``PullWorker`` (``t-tabs-*``: the tests of many tabs sharing one connection per browser);
``t-tab-celery`` runs in a real Celery worker. The body of a pull-class
stage lives in the tab (JavaScript): the function here only declares the stage (its
input model, worker class and lease) and is never called.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from onceflow.demo.providers import llm_from_env
from onceflow.tasks import Flow, StageContext

flow = Flow()
app = flow.app
TAB = "t-tab"


class TabInput(BaseModel):
    value: int = 0


@flow.stage("tab_noop", input=TabInput, worker_class=TAB, lease_seconds=5.0)
def tab_noop(ctx: StageContext, data: TabInput) -> dict[str, Any]:
    """Run by a tab (this body is not called for a pull class)."""
    raise NotImplementedError("a pull-class stage runs in the browser")


# ------------------------------------------------------ the pull worker's tests (helper B)

#: Pull classes of tests/browser/test_sdk_worker.py: one per scenario, one per browser.
TAB_LEAD = "t-tab-lead"
TAB_CLOSE = "t-tab-close"
TAB_WAIT = "t-tab-wait"
TAB_EVAL = ("t-tab-eval-1", "t-tab-eval-2", "t-tab-eval-3")
#: A Celery class (a real worker process) computing the same cells as the tabs.
CELLS_CELERY = "t-tab-b-celery"
PULL_CLASSES = (TAB_LEAD, TAB_CLOSE, TAB_WAIT, *TAB_EVAL)


class EvalInput(BaseModel):
    """Which custom columns to evaluate (one LLM call per cell, paid once across callers)."""

    columns: list[str] = Field(min_length=1, max_length=20)


def _declared(name: str, worker_class: str, lease: float, model: type[BaseModel]) -> None:
    def body(ctx: StageContext, data: BaseModel) -> dict[str, Any]:
        raise NotImplementedError("a pull-class stage runs in the browser")

    body.__name__ = name
    flow.stage(name, input=model, worker_class=worker_class, lease_seconds=lease)(body)


_declared("tab_lead", TAB_LEAD, 5.0, TabInput)
_declared("tab_close", TAB_CLOSE, 2.0, TabInput)  # a short lease: a closed tab's lapses soon
_declared("tab_wait", TAB_WAIT, 5.0, EvalInput)
for _n, _wc in enumerate(TAB_EVAL, start=1):
    _declared(f"tab_eval_{_n}", _wc, 5.0, EvalInput)


def job_doc(job_id: str) -> str:
    """The sub-doc holding a job's cells (as the demo's)."""
    return f"job:{job_id}"


def eval_prompt(job_id: str, column: str) -> str:
    """The prompt of one cell: its first line is what the counting stand-in counts by."""
    return f"cell: {job_id}/eval:{column}\nScore job {job_id} on '{column}' from 0 to 1."


@flow.stage("celery_eval", input=EvalInput, worker_class=CELLS_CELERY, lease_seconds=4.0)
def celery_eval(ctx: StageContext, data: EvalInput) -> dict[str, Any]:
    """The demo's ``evaluate`` in a Celery worker: the same cells, the same compute locks."""
    job = ctx.request.job_id
    doc = job_doc(job)
    scores: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for column in data.columns:

        def check(column: str = column) -> Any:
            return ctx.read_sub_doc(doc).state.get("cells", {}).get(column)

        def compute(column: str = column) -> float:
            return float(json.loads(llm_from_env().complete(eval_prompt(job, column)))["score"])

        def store(value: Any, column: str = column) -> None:
            op = {"type": "cell.set", "column": column, "value": value}
            ctx.apply_op(doc, op, key=f"cell:{column}")

        outcome = ctx.compute_once(f"eval:{column}", check=check, compute=compute, store=store)
        scores[column] = outcome.value
        paths[column] = str(outcome.path)
    return {"scores": scores, "paths": paths}


# ------------------------------------------------ many tabs sharing one connection per browser

#: Pull classes of tests/browser/test_sdk_tabs.py: one class whose stage holds its claim for
#: a while (one leader per browser runs it), and one evaluation class per tab (every tab
#: claims one request, and they all race the same cells).
TABS_HOLD = "t-tabs-hold"
TABS_EVAL = tuple(f"t-tabs-eval-{n}" for n in range(1, 25))
TABS_CLASSES = (TABS_HOLD, *TABS_EVAL)

# A short lease: heartbeats every half second, through everything else the tabs send.
_declared("tabs_hold", TABS_HOLD, 1.5, TabInput)
for _n, _wc in enumerate(TABS_EVAL, start=1):
    _declared(f"tabs_eval_{_n}", _wc, 5.0, EvalInput)
