"""A pull-worker process: claims one request of a class and computes one cell on it.

``python -m tests.acceptance.pull_racer <api url> <worker key> <worker class>``; prints the
outcome of ``run_once`` (``succeeded``, …) and exits. It imports the pull worker and the
stand-in's client only (no Celery): two of these race for one cell in
``tests/acceptance/test_work_context.py``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from onceflow.integrations.pull import PullContext, PullWorker
from tests.integration.standin import call_provider, mark_waiting


def race_body(ctx: PullContext) -> dict[str, Any]:
    """Two claims of one job race for one cell: one provider call, one wait."""
    provider = ctx.input["provider"]
    doc = f"job:{ctx.job_id}"

    def stored() -> Any:
        return ctx.read_sub_doc(doc).state.get("cells", {}).get("race")

    def store(value: str) -> object:
        op = {"type": "cell.set", "column": "race", "value": value}
        return ctx.apply_op(doc, op, key="cell:race")

    outcome = ctx.compute_once(
        "eval:race",
        check=stored,
        compute=lambda: call_provider(provider, ctx.job_id),
        store=store,
        on_wait=lambda: mark_waiting(provider, ctx.job_id),
    )
    return {"value": outcome.value, "path": str(outcome.path), "served_by": outcome.served_by}


def main() -> None:
    api, key, worker_class = sys.argv[1:4]
    deadline = time.monotonic() + 60
    with PullWorker(api, key, worker_class, lease_seconds=10) as worker:
        outcome = None
        while outcome is None and time.monotonic() < deadline:
            outcome = worker.run_once(race_body, wait=5)  # a long poll, not a sleep
    print(outcome, flush=True)


if __name__ == "__main__":
    main()
