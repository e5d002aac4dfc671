"""Placing an order: the order row and its stage request commit together, or not at all."""

from django.db import transaction

from onceflow import EnqueueResult
from onceflow.integrations.django import enqueue
from orders.models import Order
from orders.stages import flow


def place_order(workspace_id: str, sku: str) -> tuple[Order, EnqueueResult]:
    """Create the order and enqueue ``confirm_order`` for it in one transaction.

    The wake-up goes to the ``orders`` workers only after the commit; if this
    transaction (or one around it) rolls back, neither the order nor the request exists.
    """
    with transaction.atomic():
        order = Order.objects.create(workspace_id=workspace_id, sku=sku)
        result = enqueue(
            flow,
            "confirm_order",
            workspace_id=workspace_id,
            job_id=f"order-{order.pk}",
            input={"order_id": order.pk},
        )
    return order, result
