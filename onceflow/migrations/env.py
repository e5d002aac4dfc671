"""Alembic environment: online migrations against the configured database."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from onceflow.db import make_engine
from onceflow.models import metadata
from onceflow.settings import get_settings

config = context.config


def _partitions(connection: Connection) -> set[str]:
    """Names of the tables that are partitions (of a table hash-partitioned by workspace)."""
    rows = connection.execute(
        text(
            "SELECT c.relname FROM pg_class c WHERE c.relispartition AND c.relkind IN ('r', 'p') "
            "AND c.relnamespace = to_regnamespace(current_schema())"
        )
    )
    return {r[0] for r in rows}


def _run(connection: Connection) -> None:
    partitions: list[set[str]] = []  # read on first use: nothing runs before the migrations

    def include_object(
        obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
    ) -> bool:
        # `alembic check` compares the models with the parents (columns and partitioned
        # indexes); their partitions are no table of the models (ONCEFLOW_PARTITIONS).
        if not (type_ == "table" and reflected and compare_to is None):
            return True
        if not partitions:
            partitions.append(_partitions(connection))
        return name not in partitions[0]

    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        version_table="onceflow_alembic_version",
        include_object=include_object,
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
