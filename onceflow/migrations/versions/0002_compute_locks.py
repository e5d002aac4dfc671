# Frozen history: the Alembic revision header and table boilerplate repeat by design.
"""compute_locks: layer 2's SQL backend (one row per held compute lock).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from onceflow.migrations import partitioning

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "compute_locks"


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    partitions = partitioning.target()  # ONCEFLOW_PARTITIONS: hash partitions by workspace
    op.create_table(
        TABLE,
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("token", sa.Text(), nullable=False),
        sa.Column("acquired_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", tz, nullable=False),
        sa.PrimaryKeyConstraint("workspace_id", "job_id", "task", name=op.f("pk_compute_locks")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions(TABLE, partitions)
    # Every acquisition inserts or updates and every release deletes: a churning table,
    # vacuumed as eagerly as the queue table (0001).
    partitioning.set_storage(
        TABLE,
        "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 500, "
        "autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 500, "
        "autovacuum_vacuum_cost_delay = 1",
    )


def downgrade() -> None:
    op.drop_table(TABLE)
