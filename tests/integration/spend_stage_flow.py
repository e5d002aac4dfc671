"""The stages of the spend-in-a-stage tests (``tests/integration/test_spend_stage.py``): each
calls a stand-in LLM server through ``ctx.permit`` and settles the usage it answered.

One Flow, imported by the test process (the standalone Worker, ``onceflow.testing``) and by
a real Celery worker (``tests.integration.spend_stage_flow:flow``). Every stage is declared
for the Celery worker class and for the in-process runners' classes, which get no Celery
wake-ups.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel

from onceflow.cache import CacheKey
from onceflow.context import WorkContext
from onceflow.spend import Price, Provider, Usage
from onceflow.tasks import Flow

CELERY = "sp-celery"
WORKER = "sp-worker"
INLINE = "sp-inline"
flow = Flow(pull_worker_classes=(WORKER, INLINE))

#: The provider every process declares the same: a price, so ledger rows carry a cost.
LLM = Provider("stage-llm", rpm=10_000, concurrency=8, price=Price("1", "2"), cold_start="empty")
#: What the stand-in answers: tokens in and out of one call (the stages estimate the sum).
USAGE = Usage(12, 8)
ESTIMATE = USAGE.input_tokens + USAGE.output_tokens


class Ask(BaseModel):
    url: str


def ask(ctx: WorkContext, data: Ask) -> dict[str, Any]:
    with ctx.permit(LLM, tokens=ESTIMATE, cell_key=f"cell:{ctx.request_id}") as permit:
        answer = httpx.post(data.url, json={}, timeout=10)
        answer.raise_for_status()
        reply = answer.json()
        permit.settle(Usage(reply["input_tokens"], reply["output_tokens"]))
    return {"text": reply["text"]}


ALTERNATES = (WORKER, INLINE)
flow.stage("ask", input=Ask, worker_class=CELERY, alternate_worker_classes=ALTERNATES)(ask)
# The budget's refusal as the stage declares it; one attempt each, so a budget wait that
# counted as an attempt would leave the request dead.
flow.stage("ask_fail", input=Ask, on_budget="fail", max_attempts=1,
           worker_class=CELERY, alternate_worker_classes=ALTERNATES)(ask)  # fmt: skip
flow.stage("ask_wait", input=Ask, on_budget="wait", max_attempts=1,
           worker_class=CELERY, alternate_worker_classes=ALTERNATES)(ask)  # fmt: skip


def ask_cached(ctx: WorkContext, data: Ask) -> dict[str, Any]:
    """``ask`` through the result cache: an identical call of the workspace is paid once."""
    out = ctx.compute_once(
        "answer", check=lambda: None, compute=lambda: ask(ctx, data), store=lambda v: None,
        cache=CacheKey("workspace", data.url, ttl=600),
    )  # fmt: skip
    return {**out.value, "path": out.path.value}


flow.stage("ask_cached", input=Ask, worker_class=CELERY, alternate_worker_classes=ALTERNATES)(
    ask_cached
)
app = flow.app
