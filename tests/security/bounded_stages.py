"""The stages of the bounded-claim attacks: served by HTTP pull workers only.

``leased`` declares a 20 s lease; ``short_run`` a 1 s lease and a 3 s ``max_runtime``, so a
claim that heartbeats without end meets its run deadline within the test.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from onceflow.tasks import Flow, StageContext

LEASED = "t-sec-leased"
SHORT = "t-sec-short"
LEASE = 20.0
SHORT_LEASE = 1.0
SHORT_RUNTIME = 3.0

flow = Flow(name="onceflow-sec-bounded", pull_worker_classes=(LEASED, SHORT))
app = flow.app


class Empty(BaseModel):
    pass


@flow.stage("leased", input=Empty, worker_class=LEASED, lease_seconds=LEASE)
def leased(ctx: StageContext, data: Empty) -> dict[str, Any]:
    return {}


@flow.stage(
    "short_run", input=Empty, worker_class=SHORT, lease_seconds=SHORT_LEASE,
    max_runtime=SHORT_RUNTIME,
)  # fmt: skip
def short_run(ctx: StageContext, data: Empty) -> dict[str, Any]:
    return {}
