# Frozen history: Alembic's revision header repeats in every migration by design.
"""Spend control: the cost ledger, budgets per workspace and period, and reservations.

``spend_ledger``: one row per settled provider call (workspace, stage, request, cell,
provider, model, tokens, cost, outcome, times), keyed ``(workspace_id, permit_id)``: a
settle repeated after a lost reply inserts nothing. ``spend_budgets``: a workspace's limit
per UTC day or month, in money or tokens or both, and what a refused call does.
``spend_reservations``: the estimates of calls admitted and not settled yet, which count
against the budgets until settled, released, or expired (database clock). Three new
workspace tables, created in the database's layout (hash-partitioned by workspace when the
others are); nothing existing is touched.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from onceflow.migrations import partitioning

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    partitions = partitioning.target()  # ONCEFLOW_PARTITIONS: hash partitions by workspace
    op.create_table(
        "spend_ledger",
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("permit_id", sa.Text(), nullable=False),
        sa.Column("stage", sa.Text(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("cell_key", sa.Text(), nullable=True),
        sa.Column("provider", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("input_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("cost", sa.Numeric(), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("fenced", sa.Boolean(), nullable=True),
        sa.Column("started_at", tz, nullable=True),
        sa.Column("ended_at", tz, nullable=True),
        sa.Column("recorded_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "outcome IN ('ok', 'failed', 'rate_limited', 'abandoned', 'cache_hit')",
            name=op.f("ck_spend_ledger_outcome"),
        ),
        sa.CheckConstraint(
            "input_tokens >= 0 AND output_tokens >= 0", name=op.f("ck_spend_ledger_tokens")
        ),
        sa.CheckConstraint("cost IS NULL OR cost >= 0", name=op.f("ck_spend_ledger_cost")),
        sa.PrimaryKeyConstraint("workspace_id", "permit_id", name=op.f("pk_spend_ledger")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions("spend_ledger", partitions)
    op.create_index(
        "ix_spend_ledger_workspace",
        "spend_ledger",
        ["workspace_id", "recorded_at"],
        postgresql_include=["input_tokens", "output_tokens", "cost"],
    )
    op.create_index("ix_spend_ledger_provider", "spend_ledger", ["provider", "recorded_at"])
    op.create_table(
        "spend_budgets",
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("period", sa.Text(), nullable=False),
        sa.Column("limit_cost", sa.Numeric(), nullable=True),
        sa.Column("limit_tokens", sa.BigInteger(), nullable=True),
        sa.Column("on_exceeded", sa.Text(), server_default=sa.text("'fail'"), nullable=False),
        sa.Column("updated_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("period IN ('day', 'month')", name=op.f("ck_spend_budgets_period")),
        sa.CheckConstraint(
            "on_exceeded IN ('fail', 'wait')", name=op.f("ck_spend_budgets_on_exceeded")
        ),
        sa.CheckConstraint(
            "(limit_cost IS NOT NULL OR limit_tokens IS NOT NULL) "
            "AND (limit_cost IS NULL OR limit_cost >= 0) "
            "AND (limit_tokens IS NULL OR limit_tokens >= 0)",
            name=op.f("ck_spend_budgets_limits"),
        ),
        sa.PrimaryKeyConstraint("workspace_id", "period", name=op.f("pk_spend_budgets")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions("spend_budgets", partitions)
    op.create_table(
        "spend_reservations",
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("permit_id", sa.Text(), nullable=False),
        sa.Column("provider", sa.Text(), nullable=False),
        sa.Column("stage", sa.Text(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("cell_key", sa.Text(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.Numeric(), nullable=True),
        sa.Column("created_at", tz, server_default=sa.text("now()"), nullable=False),
        sa.Column("expires_at", tz, nullable=False),
        sa.CheckConstraint(
            "tokens >= 0 AND (cost IS NULL OR cost >= 0)",
            name=op.f("ck_spend_reservations_estimate"),
        ),
        sa.PrimaryKeyConstraint("workspace_id", "permit_id", name=op.f("pk_spend_reservations")),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions("spend_reservations", partitions)
    # Every admitted call inserts a reservation and its settle deletes it: vacuumed eagerly.
    partitioning.set_storage(
        "spend_reservations",
        "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 500",
    )


def downgrade() -> None:
    op.drop_table("spend_reservations")
    op.drop_table("spend_budgets")
    op.drop_index("ix_spend_ledger_provider", table_name="spend_ledger")
    op.drop_index("ix_spend_ledger_workspace", table_name="spend_ledger")
    op.drop_table("spend_ledger")
