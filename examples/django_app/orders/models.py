"""The example's one model."""

from django.db import models


class Order(models.Model):
    """An order; the ``confirm_order`` stage moves it from placed to confirmed."""

    workspace_id = models.CharField(max_length=200)
    sku = models.CharField(max_length=100)
    status = models.CharField(max_length=20, default="placed")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.sku}, {self.status})"
