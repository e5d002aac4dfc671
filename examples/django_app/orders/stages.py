"""The example's stages: what Celery workers run, declared once for web app and workers."""

from typing import Any

from pydantic import BaseModel

from onceflow.tasks import Flow, StageContext
from orders.models import Order

flow = Flow()


class ConfirmOrder(BaseModel):
    """Input of ``confirm_order``."""

    order_id: int


@flow.stage("confirm_order", input=ConfirmOrder, worker_class="orders")
def confirm_order(ctx: StageContext, data: ConfirmOrder) -> dict[str, Any]:
    """Confirm the order (the expensive part — payment, stock — would go here).

    Setting the status is idempotent, so a retry after a crash writes the same thing.
    """
    ctx.check()  # stop before writing if the lease was lost or a cancel was requested
    updated = Order.objects.filter(pk=data.order_id).update(status="confirmed")
    return {"order_id": data.order_id, "confirmed": bool(updated)}
