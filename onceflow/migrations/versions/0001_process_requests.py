# Frozen history: the Alembic revision header and table boilerplate repeat by design.
"""workspace_process_requests: the durable stage queue.

With ``ONCEFLOW_PARTITIONS=N`` on a new database the table is created ``PARTITION BY HASH
(workspace_id)`` in N partitions (onceflow/migrations/partitioning.py), keyed
``(workspace_id, request_id)`` from the start: a partitioned table accepts no key without
the partition column, so 0007/0008 find nothing left to do.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from onceflow.migrations import partitioning

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    partitions = partitioning.target()
    key = ["request_id"] if partitions is None else ["workspace_id", "request_id"]
    op.create_table(
        TABLE,
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("job_id", sa.Text(), nullable=False),
        sa.Column("branch_path", sa.Text(), nullable=False),
        sa.Column("stage", sa.Text(), nullable=False),
        sa.Column("dedupe", sa.Boolean(), nullable=False),
        sa.Column("input", postgresql.JSONB(), nullable=False),
        sa.Column("input_hash", sa.Text(), nullable=False),
        sa.Column("worker_class", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("claim_token", sa.Text(), nullable=True),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("lease_expires_at", tz, nullable=True),
        sa.Column("heartbeat_at", tz, nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("crash_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("max_crash_attempts", sa.Integer(), nullable=False),
        sa.Column("run_after", tz, server_default=sa.text("now()"), nullable=False),
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "cancel_requested", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("dispatched_at", tz, nullable=True),
        sa.Column("result", postgresql.JSONB(), nullable=True),
        sa.Column("error", postgresql.JSONB(), nullable=True),
        sa.Column("created_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", tz, nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'dead', 'cancelled')",
            name=op.f("ck_workspace_process_requests_status"),
        ),
        sa.CheckConstraint(
            "attempts >= 0 AND crash_attempts >= 0",
            name=op.f("ck_workspace_process_requests_attempts"),
        ),
        sa.CheckConstraint(
            "max_attempts >= 1 AND max_crash_attempts >= 1",
            name=op.f("ck_workspace_process_requests_max_attempts"),
        ),
        sa.CheckConstraint(
            "(status = 'running') = (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name=op.f("ck_workspace_process_requests_running_has_claim"),
        ),
        sa.PrimaryKeyConstraint(*key, name=op.f("pk_workspace_process_requests")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions(TABLE, partitions)
    op.create_index(
        "ix_wpr_claim",
        TABLE,
        ["worker_class", sa.text("priority DESC"), "run_after"],
        postgresql_where=sa.text("status = 'queued'"),
    )
    op.create_index(
        "ix_wpr_lease",
        TABLE,
        ["worker_class", "lease_expires_at"],
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_index("ix_wpr_workspace", TABLE, ["workspace_id", "created_at"])
    op.create_index(
        "ix_wpr_finished",
        TABLE,
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    # A queue table churns: every claim, heartbeat and completion leaves a dead tuple.
    # Vacuum and analyze it far more eagerly than the 20% default so the claim index stays
    # small and plans stay right (Oban's and Hatchet's guidance; River issue #59).
    # (Set per partition on a partitioned table: its parent takes no storage parameters.)
    partitioning.set_storage(
        TABLE,
        "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 500, "
        "autovacuum_analyze_scale_factor = 0.02, autovacuum_analyze_threshold = 500, "
        "autovacuum_vacuum_cost_delay = 1",
    )


def downgrade() -> None:
    op.drop_table(TABLE)
