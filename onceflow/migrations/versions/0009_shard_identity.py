# Frozen history: Alembic's revision header repeats in every migration by design.
"""Each database of a sharded deployment knows which shard it is: ``onceflow_shard``.

One row at most: the shard's index in the shard map, the map's shard count and its digest
(``ShardMap.digest``: ranges and overrides, never the URLs). ``onceflow migrate`` writes it
on every shard of ``ONCEFLOW_DATABASE_URLS`` / ``ONCEFLOW_SHARD_MAP``; a process's router
reads it at its first statement on each shard and refuses a database that is not the
shard its map names (URLs listed in another order, a map changed on one host only) rather
than misroute. A database used alone keeps the table empty and never reads it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "onceflow_shard",
        sa.Column("one", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("shard_count", sa.Integer(), nullable=False),
        sa.Column("map_digest", sa.Text(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("one", name="ck_onceflow_shard_one"),
        sa.CheckConstraint(
            "shard_index >= 0 AND shard_index < shard_count", name="ck_onceflow_shard_index"
        ),
        sa.PrimaryKeyConstraint("one", name="pk_onceflow_shard"),
    )


def downgrade() -> None:
    op.drop_table("onceflow_shard")
