"""``manage.py onceflow_migrate``: apply onceflow's migrations to Django's database."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DEFAULT_DB_ALIAS

from onceflow.integrations.django import database_url
from onceflow.migrate import migrate


class Command(BaseCommand):
    """Run ``onceflow migrate`` against a Django database alias (idempotent)."""

    help = "Apply onceflow's migrations (Alembic) to the Django database; idempotent."

    def add_arguments(self, parser: CommandParser) -> None:
        """``--database ALIAS`` (default: ``default``)."""
        parser.add_argument("--database", default=DEFAULT_DB_ALIAS, help="Database alias.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Upgrade the database to onceflow's latest migration."""
        migrate(database_url(options["database"]))
        self.stdout.write(f"onceflow: database {options['database']!r} is at the latest migration")
