# Frozen history: Alembic's revision header repeats in every migration by design.
"""Claim refs: a fenced write by ``(request_id, claim_token)`` alone, with nothing read first.

Three nullable columns, no defaults (catalog-only changes: no table rewrite, existing rows
kept as they are):

- ``lease_seconds``: the lease length the claim took (and the latest a heartbeat asked
  for), so a heartbeat by ref extends the lease by the claim's own length;
- ``run_deadline``: claim time + ``max_runtime`` (database clock; NULL for none), past
  which heartbeats stop extending the lease;
- ``ended_run``: the run id (a digest of the claim token, as ``onceflow.queue.sql.RUN_ID``)
  of the run whose own ``complete``/``fail`` ended the latest claim, so a fenced write whose
  answer was lost recognises its own outcome on retry from the token alone.

A row claimed before this migration has none of them: a heartbeat by ref falls back to the
queue's default lease (a :class:`~onceflow.Claim` still carries its own lease and deadline).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("lease_seconds", sa.Double(), nullable=True))
    op.add_column(TABLE, sa.Column("run_deadline", sa.DateTime(timezone=True), nullable=True))
    op.add_column(TABLE, sa.Column("ended_run", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column(TABLE, "ended_run")
    op.drop_column(TABLE, "run_deadline")
    op.drop_column(TABLE, "lease_seconds")
