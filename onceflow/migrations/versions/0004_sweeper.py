# Frozen history: Alembic's revision header repeats in every migration by design.
"""The sweeper: onceflow_sweeps (when each Flow last swept, by the database clock) and
workspace_process_requests.redispatch_count (the backoff of wake-up re-sends).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"


def upgrade() -> None:
    # A constant default: Postgres 11+ adds the column without rewriting the table, holding
    # its ACCESS EXCLUSIVE lock only for the catalog change. Deliberately no CHECK
    # (redispatch_count >= 0): adding one would scan the whole hot table under that lock,
    # and it would guard nothing — only the default and onceflow's own sweep statements
    # (which set 0 or add 1) ever write the column.
    op.add_column(
        TABLE,
        sa.Column("redispatch_count", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.create_table(
        "onceflow_sweeps",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("swept_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("swept_by", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_onceflow_sweeps")),
    )


def downgrade() -> None:
    op.drop_table("onceflow_sweeps")
    op.drop_column(TABLE, "redispatch_count")
