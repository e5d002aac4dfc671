"""onceflow's tables through ``manage.py migrate``: Alembic's upgrade to the package's head.

onceflow's schema is versioned by its own Alembic migrations (``onceflow migrate``), in
the table ``onceflow_alembic_version``; this Django migration runs that upgrade on the
database Django is migrating, so ``manage.py migrate`` — and the test database Django's
test runner or pytest-django creates — gets onceflow's tables too. The upgrade is
idempotent: a database ``onceflow migrate`` already upgraded is left as it is.

After an upgrade of the package, ``manage.py onceflow_migrate`` (or ``onceflow migrate``)
applies its new migrations: Django runs this one once per database.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations


def upgrade(apps: Any, schema_editor: Any) -> None:
    """Upgrade the database of Django's connection to onceflow's head (nothing logged: the
    URL carries the password)."""
    from onceflow.integrations.django import database_url
    from onceflow.migrate import migrate

    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return  # onceflow lives in PostgreSQL only (the system check onceflow.E001 says so)
    migrate(database_url(connection.alias))


def refuse_downgrade(apps: Any, schema_editor: Any) -> None:
    """Unapplying would drop every request and op: onceflow never does that for you."""
    raise RuntimeError(
        "onceflow's tables are not dropped by `manage.py migrate onceflow zero`: they hold "
        "the requests and ops. Drop them by hand if you mean to (docs/integration-django-mcp.md)."
    )


class Migration(migrations.Migration):
    """Apply onceflow's Alembic migrations on Django's database."""

    # Alembic works on a connection of its own: no transaction of Django's is held open
    # around it (the upgrade commits each step itself).
    atomic = False
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[migrations.RunPython]] = [
        migrations.RunPython(upgrade, refuse_downgrade)
    ]
