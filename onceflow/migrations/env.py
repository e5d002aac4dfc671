"""Alembic environment: online migrations against the configured database."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from onceflow.db import make_engine
from onceflow.models import metadata
from onceflow.settings import get_settings

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        version_table="onceflow_alembic_version",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run with a connection handed in by ``onceflow.migrate``, or one made from the URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or get_settings().database_url
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():  # pragma: no cover - we ship no offline SQL
    raise SystemExit("onceflow migrations run online only: use `onceflow migrate`")
run_migrations_online()
