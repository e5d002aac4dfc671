"""The stages of the end-to-end tracing test (``test_tracing_e2e.py``), run by a real Celery
worker that exports its spans over OTLP to the test's receiver.

``traced_cell`` computes one cell once through the compute lock, calling the counting
stand-in provider (``tests/integration/standin.py``) under a spend permit, and stores the
answer as an op. With ``kill_first`` its first attempt kills its own process (kill -9): the
sweeper rescues the row after its lease (or, when the kill comes after the lease ran out,
the redelivered wake-up's claim takes the row over), and the second attempt serves it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from pydantic import BaseModel

from onceflow.spend import Provider, Usage, register
from onceflow.tasks import Flow, StageContext
from tests.integration.standin import call_provider, mark_waiting

flow = Flow()
app = flow.app
TRACED = "t-traced"
PROVIDER = register(Provider("trace-llm", rpm=10_000))


class CellInput(BaseModel):
    column: str
    provider_url: str
    kill_first: bool = False


def _cell(ctx: StageContext, column: str) -> Any:
    return ctx.read_sub_doc(f"job:{ctx.job_id}").state.get("cells", {}).get(column)


def _store(ctx: StageContext, column: str, value: Any) -> object:
    op = {"type": "cell.set", "column": column, "value": value}
    return ctx.apply_op(f"job:{ctx.job_id}", op, key=f"cell:{column}")


def _ask(ctx: StageContext, data: CellInput) -> str:
    with ctx.permit(PROVIDER, tokens=100, cell_key=f"eval:{data.column}") as permit:
        answer = call_provider(data.provider_url, data.column)
        permit.settle(Usage(input_tokens=90, output_tokens=10))
    return answer


@flow.stage(
    "traced_cell", input=CellInput, worker_class=TRACED, lease_seconds=3.0,
    max_crash_attempts=3, sub_docs=("job:{job_id}",),
)  # fmt: skip
def traced_cell(ctx: StageContext, data: CellInput) -> dict[str, Any]:
    if data.kill_first and ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    outcome = ctx.compute_once(
        f"eval:{data.column}",
        check=lambda: _cell(ctx, data.column),
        compute=lambda: _ask(ctx, data),
        store=lambda value: _store(ctx, data.column, value),
        on_wait=lambda: mark_waiting(data.provider_url, data.column),
    )
    return {"value": outcome.value, "path": str(outcome.path)}
