"""The orders app."""

from django.apps import AppConfig


class OrdersConfig(AppConfig):
    """Orders of the example shop."""

    name = "orders"
    default_auto_field = "django.db.models.BigAutoField"
