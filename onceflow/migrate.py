"""Apply the shipped Alembic migrations (``onceflow migrate``); idempotent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config

from onceflow.db import make_engine, translate_errors
from onceflow.errors import InvalidRequest, ShardMismatch
from onceflow.migrations import partitioning
from onceflow.settings import get_settings

if TYPE_CHECKING:
    from onceflow.shards import ShardMap

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

    Without ``database_url``: every database of the settings — each shard when
    ``ONCEFLOW_DATABASE_URLS`` / ``ONCEFLOW_SHARD_MAP`` name several (:func:`migrate_all`).

    ``partitions`` (default: ``ONCEFLOW_PARTITIONS``; 2 to 256) creates the workspace tables
    hash-partitioned by workspace in that many partitions — on a new database only. Unset,
    tables yet to be created follow the layout of those that exist. Asking for a layout the
    existing tables do not have raises :class:`~onceflow.errors.PartitionLayoutMismatch`
    before anything is written: no migration converts tables (docs/sharding.md 5.2).
    """
    if database_url is None:
        migrate_all(revision, partitions=partitions)
        return
    requested = partitions if partitions is not None else get_settings().partitions
    if requested is not None and not MIN_PARTITIONS <= requested <= MAX_PARTITIONS:
        raise InvalidRequest(
            f"partitions must be {MIN_PARTITIONS}..{MAX_PARTITIONS} (or unset), not {requested}"
        )
    cfg = alembic_config(database_url)
    with translate_errors(database_url):
        engine = make_engine(database_url, pool_size=1)
        try:
            with engine.connect() as conn:
                cfg.attributes[partitioning.ATTRIBUTE] = partitioning.resolve(conn, requested)
        finally:
            engine.dispose()
        command.upgrade(cfg, revision)


def migrate_all(
    revision: str = "head",
    report: Callable[[int, str], None] | None = None,
    *,
    partitions: int | None = None,
) -> None:
    """Upgrade each database of the configured shard map, in shard order (one database
    without one). Each shard has its own migration history: a failure on shard k leaves
    shards before it migrated and stops there (run it again once k is reachable; every
    revision is safe to run while other shards are one behind). ``report(k, url)`` is
    called after each shard (the URL without its password)."""
    from onceflow.db import redact_url
    from onceflow.shards import configured_map

    shard_map = configured_map()
    for index, url in enumerate(shard_map.urls):
        migrate(url, revision, partitions)
        if len(shard_map) > 1:
            register_shard(url, index, shard_map)
        if report is not None:
            report(index, redact_url(url))


def register_shard(url: str, index: int, shard_map: ShardMap) -> None:
    """Record in ``url``'s database that it is shard ``index`` of ``shard_map`` (migration
    0009's ``onceflow_shard``), which every router checks before it routes there. A database
    registered as another index is refused (:class:`~onceflow.errors.ShardMismatch`), never
    moved: its rows belong to the workspaces of that index. The same index under a changed
    map (a shard added at the end, ranges or overrides changed) is updated."""
    from onceflow.db import redact_url
    from onceflow.shards import IDENTITY_SQL, REGISTER_SQL, identity_problem

    params = {"index": index, "count": len(shard_map), "digest": shard_map.digest}
    engine = make_engine(url, pool_size=1)
    try:
        with translate_errors(url), engine.begin() as conn:
            done = conn.exec_driver_sql(REGISTER_SQL, params).first()
            current = None if done else conn.exec_driver_sql(IDENTITY_SQL).mappings().first()
    finally:
        engine.dispose()
    if done is None:
        row = None if current is None else dict(current)
        problem = identity_problem(row, index, shard_map) or "is registered as another shard"
        raise ShardMismatch(f"database {redact_url(url)} {problem}")


def check(database_url: str | None = None) -> None:
    """Raise if the models and the migrated schema differ (``alembic check``)."""
    with translate_errors(database_url):
        command.check(alembic_config(database_url))
