# Frozen history: Alembic's revision header repeats in every migration by design.
"""Layer 3: workspace_sub_docs and the op log workspace_sub_doc_ops.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from onceflow.migrations import partitioning

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    partitions = partitioning.target()  # ONCEFLOW_PARTITIONS: hash partitions by workspace
    op.create_table(
        "workspace_sub_docs",
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("sub_doc", sa.Text(), nullable=False),
        sa.Column("clock", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "state", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("pruned_clock", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "clock >= 0 AND pruned_clock >= 0 AND pruned_clock <= clock",
            name=op.f("ck_workspace_sub_docs_clocks"),
        ),
        sa.PrimaryKeyConstraint("workspace_id", "sub_doc", name=op.f("pk_workspace_sub_docs")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions("workspace_sub_docs", partitions)
    op.create_table(
        "workspace_sub_doc_ops",
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("sub_doc", sa.Text(), nullable=False),
        sa.Column("op_id", sa.Text(), nullable=False),
        sa.Column("clock", sa.BigInteger(), nullable=True),
        sa.Column("op_type", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("payload_hash", sa.Text(), nullable=False),
        sa.Column("result", postgresql.JSONB(), nullable=True),
        sa.Column("error", postgresql.JSONB(), nullable=True),
        sa.Column("fence", sa.Text(), nullable=True),
        sa.Column("committed_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "(clock IS NULL) = (error IS NOT NULL)",
            name=op.f("ck_workspace_sub_doc_ops_applied_or_rejected"),
        ),
        sa.PrimaryKeyConstraint(
            "workspace_id", "sub_doc", "op_id", name=op.f("pk_workspace_sub_doc_ops")
        ),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions("workspace_sub_doc_ops", partitions)
    op.create_index(
        "ix_ops_clock",
        "workspace_sub_doc_ops",
        ["workspace_id", "sub_doc", "clock"],
        unique=True,
        postgresql_where=sa.text("clock IS NOT NULL"),
    )
    op.create_index("ix_ops_committed", "workspace_sub_doc_ops", ["committed_at"])
    # Both tables take a write per op: vacuum them eagerly, like the queue table.
    for table in ("workspace_sub_docs", "workspace_sub_doc_ops"):
        partitioning.set_storage(
            table, "autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02"
        )


def downgrade() -> None:
    op.drop_table("workspace_sub_doc_ops")
    op.drop_table("workspace_sub_docs")
