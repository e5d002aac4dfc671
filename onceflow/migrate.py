"""Apply the shipped Alembic migrations (``onceflow migrate``); idempotent."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from onceflow.db import translate_errors
from onceflow.settings import get_settings

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config pointing at the shipped migrations and ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would read '%' in a password as a directive.
    url = database_url or get_settings().database_url
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(database_url: str | None = None, revision: str = "head") -> None:
    """Upgrade the database to ``revision``; running it again changes nothing."""
    with translate_errors(database_url):
        command.upgrade(alembic_config(database_url), revision)


def check(database_url: str | None = None) -> None:
    """Raise if the models and the migrated schema differ (``alembic check``)."""
    with translate_errors(database_url):
        command.check(alembic_config(database_url))
