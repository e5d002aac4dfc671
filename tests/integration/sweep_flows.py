"""Two Flows on one broker, with different names and worker classes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from onceflow.tasks import Flow


class Empty(BaseModel):
    pass


flow_a = Flow(name="sd-flow-a")
flow_b = Flow(name="sd-flow-b")


@flow_a.stage("sd_a", input=Empty, worker_class="sd-a")
def stage_a(ctx: Any, data: Empty) -> dict[str, Any]:
    return {}


@flow_b.stage("sd_b", input=Empty, worker_class="sd-b")
def stage_b(ctx: Any, data: Empty) -> dict[str, Any]:
    return {}
