# Frozen history: Alembic's revision header repeats in every migration by design.
"""Observability: live and dead requests countable by worker class and stage from indexes alone.

The partial indexes of queued (ix_wpr_claim) and running (ix_wpr_lease) rows gain
``INCLUDE (stage)``, so ``/metrics`` and the dashboard count live requests by worker class
and stage with index-only scans: the cost follows the live backlog, never the table's
finished history. A new partial index of dead rows (ix_wpr_dead: newest first, with class
and stage) serves the dead count and the dashboard's list of dead requests; dead rows are
few and only a terminal failure writes to it.

A nullable ``claimed_at`` column (no default: a catalog-only change, no table rewrite)
records when the latest claim was taken, on the database clock: pickup latency is due →
``claimed_at`` and a run's duration ``claimed_at`` → finish, whatever heartbeats did to
``updated_at`` and ``heartbeat_at`` in between.

Each index is rebuilt under a new name first and the old one dropped after, so the claim
and rescue queries always have an index. On a large table run this migration in a quiet
moment: ``CREATE INDEX`` blocks writes to the table while it builds.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"


def _swap(name: str, columns: list[sa.TextClause | str], where: str, include: list[str]) -> None:
    op.create_index(
        f"{name}_new",
        TABLE,
        columns,
        postgresql_where=sa.text(where),
        postgresql_include=include,
    )
    op.drop_index(name, table_name=TABLE)
    op.execute(f"ALTER INDEX {name}_new RENAME TO {name}")


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True))
    _swap(
        "ix_wpr_claim",
        ["worker_class", sa.text("priority DESC"), "run_after"],
        "status = 'queued'",
        ["stage"],
    )
    _swap("ix_wpr_lease", ["worker_class", "lease_expires_at"], "status = 'running'", ["stage"])
    op.create_index(
        "ix_wpr_dead",
        TABLE,
        [sa.text("finished_at DESC")],
        postgresql_where=sa.text("status = 'dead'"),
        postgresql_include=["worker_class", "stage"],
    )


def downgrade() -> None:
    op.drop_index("ix_wpr_dead", table_name=TABLE)
    _swap("ix_wpr_lease", ["worker_class", "lease_expires_at"], "status = 'running'", [])
    _swap(
        "ix_wpr_claim",
        ["worker_class", sa.text("priority DESC"), "run_after"],
        "status = 'queued'",
        [],
    )
    op.drop_column(TABLE, "claimed_at")
