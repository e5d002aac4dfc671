"""The optional Django app: ``INSTALLED_APPS += ["onceflow.integrations.django"]``.

It adds ``manage.py onceflow_migrate`` and the system check ``onceflow.W001``
(Django and onceflow configured with different databases). :func:`enqueue`
works without it.
"""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks


class OnceflowConfig(AppConfig):
    """onceflow's Django app (label ``onceflow``); it declares no models."""

    name = "onceflow.integrations.django"
    label = "onceflow"
    verbose_name = "onceflow"

    def ready(self) -> None:
        """Register the system check."""
        checks.register(check_same_database)


def check_same_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Warn when Django's default database is not ``ONCEFLOW_DATABASE_URL``'s database."""
    from django.db import DEFAULT_DB_ALIAS, connections

    from onceflow.integrations.django import database_url, same_database
    from onceflow.settings import get_settings

    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        return [
            checks.Error(
                "onceflow needs Django's default database to be PostgreSQL.",
                hint="Use database_settings() from onceflow.integrations.django.",
                id="onceflow.E001",
            )
        ]
    if same_database(database_url(DEFAULT_DB_ALIAS), get_settings().database_url):
        return []
    return [
        checks.Warning(
            "Django's default database and ONCEFLOW_DATABASE_URL name different databases: "
            "requests enqueued from Django would not reach onceflow's workers.",
            hint='Set DATABASES = {"default": database_settings()} '
            "(onceflow.integrations.django), or point ONCEFLOW_DATABASE_URL at Django's database.",
            id="onceflow.W001",
        )
    ]
