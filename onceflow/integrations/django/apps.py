"""The optional Django app: ``INSTALLED_APPS += ["onceflow.integrations.django"]``.

It adds:

* onceflow's tables to ``manage.py migrate`` (its migration ``0001_onceflow_schema``
  runs onceflow's Alembic upgrade on the database being migrated), so Django's test
  database has them too; ``manage.py onceflow_migrate`` runs the upgrade again after
  a package upgrade;
* onceflow's settings from Django's: ``ONCEFLOW = {"lease_seconds": 30, ...}`` in
  ``settings.py`` (field names of :class:`onceflow.settings.Settings`), read when
  Django's apps are ready. An ``ONCEFLOW_*`` environment variable that is set wins over
  the same name in ``ONCEFLOW``: the code carries the project's defaults, the
  deployment's environment has the last word (one image, many environments);
* the system check ``onceflow.W001`` (Django and onceflow configured with different
  databases).

:func:`enqueue` works without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.apps import AppConfig
from django.core import checks


class OnceflowConfig(AppConfig):
    """onceflow's Django app (label ``onceflow``); it declares no models."""

    name = "onceflow.integrations.django"
    label = "onceflow"
    verbose_name = "onceflow"

    def ready(self) -> None:
        """Take onceflow's settings from ``settings.ONCEFLOW``; register the system check."""
        apply_django_settings()
        checks.register(check_same_database)


def apply_django_settings() -> None:
    """Use ``settings.ONCEFLOW`` (a dict of onceflow's setting names) beneath the
    environment (:func:`onceflow.settings.use_defaults`); without it, nothing changes."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from onceflow.settings import use_defaults

    values = getattr(settings, "ONCEFLOW", None)
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise ImproperlyConfigured("settings.ONCEFLOW must be a dict of onceflow settings")
    try:
        use_defaults(values)
    except ValueError as exc:  # an unknown name, or a value its field refuses
        raise ImproperlyConfigured(f"settings.ONCEFLOW: {exc}") from None


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
