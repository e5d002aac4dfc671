"""The stages of the payload-limit attacks: free-form inputs, served by pull workers only.

``free`` keeps whatever it is given (its model allows extra fields), so a deep or
non-finite value would reach the table if nothing refused it; ``ratio`` is a float
field the model would happily parse from the string ``"Infinity"``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from onceflow.tasks import Flow, StageContext

PULL = "t-sec-pull"

flow = Flow(name="onceflow-sec-payloads", pull_worker_classes=(PULL,))
app = flow.app


class FreeInput(BaseModel):
    model_config = ConfigDict(extra="allow")
    ratio: float = 0.0


# It may hand off to itself: the hand-off payload attacks reach the input checks.
@flow.stage("free", input=FreeInput, worker_class=PULL, hands_off_to=("free",))
def free(ctx: StageContext, data: FreeInput) -> dict[str, Any]:
    return {"ran": True}
