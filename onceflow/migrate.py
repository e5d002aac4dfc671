"""Apply the shipped Alembic migrations (``onceflow migrate``); idempotent."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from onceflow.db import make_engine, translate_errors
from onceflow.errors import InvalidRequest
from onceflow.migrations import partitioning
from onceflow.settings import get_settings

MIGRATIONS = Path(__file__).parent / "migrations"
#: The partition counts ``ONCEFLOW_PARTITIONS`` / ``migrate(partitions=…)`` accept.
MIN_PARTITIONS, MAX_PARTITIONS = 2, 256


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config pointing at the shipped migrations and ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would read '%' in a password as a directive.
    url = database_url or get_settings().database_url
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(
    database_url: str | None = None, revision: str = "head", partitions: int | None = None
) -> None:
    """Upgrade the database to ``revision``; running it again changes nothing.

    ``partitions`` (default: ``ONCEFLOW_PARTITIONS``; 2 to 256) creates the workspace tables
    hash-partitioned by workspace in that many partitions — on a new database only. Unset,
    tables yet to be created follow the layout of those that exist. Asking for a layout the
    existing tables do not have raises :class:`~onceflow.errors.PartitionLayoutMismatch`
    before anything is written: no migration converts tables (docs/sharding.md 5.2).
    """
    requested = partitions if partitions is not None else get_settings().partitions
    if requested is not None and not MIN_PARTITIONS <= requested <= MAX_PARTITIONS:
        raise InvalidRequest(
            f"partitions must be {MIN_PARTITIONS}..{MAX_PARTITIONS} (or unset), not {requested}"
        )
    cfg = alembic_config(database_url)
    with translate_errors(database_url):
        engine = make_engine(database_url or get_settings().database_url, pool_size=1)
        try:
            with engine.connect() as conn:
                cfg.attributes[partitioning.ATTRIBUTE] = partitioning.resolve(conn, requested)
        finally:
            engine.dispose()
        command.upgrade(cfg, revision)


def check(database_url: str | None = None) -> None:
    """Raise if the models and the migrated schema differ (``alembic check``)."""
    with translate_errors(database_url):
        command.check(alembic_config(database_url))
