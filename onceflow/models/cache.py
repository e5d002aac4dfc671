"""The result cache's tables: one entry per key digest, per workspace or for every workspace.

``result_cache`` holds the entries of workspace-scope keys: a workspace table (keyed
workspace first, hash-partitioned with the others under ``ONCEFLOW_PARTITIONS``), in the
workspace's own database. ``result_cache_global`` holds the entries of global keys, shared
by every workspace: a plain table, in the first database of a split deployment. An entry
lives until ``expires_at`` (database clock) and keeps what computing it cost, when known.
"""

from __future__ import annotations

# The column types each table module imports (alike by shape): imports, not logic.
from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Numeric,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from onceflow.models.tables import metadata


def _entry_columns() -> list[Column[object]]:
    """What an entry holds besides its key: the value, what computing it cost, its times."""
    return [
        Column("value", JSONB, nullable=False),
        Column("provider", Text),
        Column("model", Text),
        Column("input_tokens", BigInteger),
        Column("output_tokens", BigInteger),
        Column("cost", Numeric),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("expires_at", DateTime(timezone=True), nullable=False),
    ]


result_cache = Table(
    "result_cache",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("digest", Text, primary_key=True),
    *_entry_columns(),
    CheckConstraint("cost IS NULL OR cost >= 0", name="cost"),
    # Expired entries are purged by expiry (`onceflow cache purge`).
    Index("ix_result_cache_expires", "expires_at"),
)

result_cache_global = Table(
    "result_cache_global",
    metadata,
    Column("digest", Text, primary_key=True),
    *_entry_columns(),
    CheckConstraint("cost IS NULL OR cost >= 0", name="cost"),
    Index("ix_result_cache_global_expires", "expires_at"),
)
