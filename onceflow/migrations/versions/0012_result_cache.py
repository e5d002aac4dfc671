# Frozen history: Alembic's revision header repeats in every migration by design.
"""The result cache across jobs, and what its hits saved in the spend ledger.

``result_cache``: the entries of workspace-scope keys, keyed ``(workspace_id, digest)``
(the key's sha256), created in the database's layout (hash-partitioned by workspace when
the other workspace tables are). ``result_cache_global``: the entries of global keys,
keyed by the digest alone, a plain table. Each entry holds its JSON value, what computing
it cost when known, and its expiry on the database clock. ``spend_ledger`` gains
``saved_cost``, NULL on every existing row: a ``cache_hit`` row's cost spared.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from onceflow.migrations import partitioning

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _entry_columns() -> list[sa.Column[object]]:
    tz = sa.DateTime(timezone=True)
    return [
        sa.Column("value", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("provider", sa.Text(), nullable=True),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("input_tokens", sa.BigInteger(), nullable=True),
        sa.Column("output_tokens", sa.BigInteger(), nullable=True),
        sa.Column("cost", sa.Numeric(), nullable=True),
        sa.Column("created_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", tz, nullable=False),
    ]


def upgrade() -> None:
    partitions = partitioning.target()  # ONCEFLOW_PARTITIONS: hash partitions by workspace
    op.create_table(
        "result_cache",
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        *_entry_columns(),
        sa.CheckConstraint("cost IS NULL OR cost >= 0", name=op.f("ck_result_cache_cost")),
        sa.PrimaryKeyConstraint("workspace_id", "digest", name=op.f("pk_result_cache")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions("result_cache", partitions)
    op.create_index("ix_result_cache_expires", "result_cache", ["expires_at"])
    op.create_table(
        "result_cache_global",
        sa.Column("digest", sa.Text(), nullable=False),
        *_entry_columns(),
        sa.CheckConstraint("cost IS NULL OR cost >= 0", name=op.f("ck_result_cache_global_cost")),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_result_cache_global")),
    )
    op.create_index("ix_result_cache_global_expires", "result_cache_global", ["expires_at"])
    # A nullable column without a default or a check: no rewrite and no scan of the ledger.
    op.add_column("spend_ledger", sa.Column("saved_cost", sa.Numeric(), nullable=True))


def downgrade() -> None:
    op.drop_column("spend_ledger", "saved_cost")
    op.drop_index("ix_result_cache_global_expires", table_name="result_cache_global")
    op.drop_table("result_cache_global")
    op.drop_index("ix_result_cache_expires", table_name="result_cache")
    op.drop_table("result_cache")
