# Frozen history: Alembic's revision header repeats in every migration by design.
"""Requests keyed workspace-first, step 2 of 2: the primary key becomes ``(workspace_id,
request_id)``, taken over from 0007's unique index.

``ADD CONSTRAINT … PRIMARY KEY USING INDEX`` scans nothing (both columns are ``NOT NULL``
already) and renames the index to ``pk_workspace_process_requests``; the ``ACCESS
EXCLUSIVE`` lock is held for catalog changes only (about a millisecond, whatever the
table's size: docs/sharding.md 5.1.1). ``lock_timeout`` keeps it from queueing behind a long
transaction (and every statement behind it): on a timeout the migration fails and can simply be run
again. Request ids are unchanged; the old key's index on ``request_id`` alone goes with
it, and 0007's ``ix_wpr_request_id`` serves lookups by id from then on.

After this revision, code of the release before 0007 can no longer enqueue (its
``ON CONFLICT (request_id)`` has no arbiter): run it once every process runs this release.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from onceflow.migrations import partitioning

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"
PK = "pk_workspace_process_requests"


def _pk_columns() -> list[str]:
    rows = op.get_bind().execute(
        sa.text(
            """SELECT a.attname FROM pg_constraint c
               JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord) ON true
               JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
               WHERE c.conrelid = to_regclass(:t) AND c.contype = 'p' ORDER BY k.ord"""
        ),
        {"t": TABLE},
    )
    return [r[0] for r in rows]


def upgrade() -> None:
    if _pk_columns() == ["workspace_id", "request_id"]:
        return  # created so (a partitioned table), or migrated already
    op.execute("SET LOCAL lock_timeout = '5s'")
    op.execute(
        f"ALTER TABLE {TABLE} DROP CONSTRAINT {PK}, "
        f"ADD CONSTRAINT {PK} PRIMARY KEY USING INDEX uq_wpr_workspace_request"
    )


def downgrade() -> None:
    if _pk_columns() != ["workspace_id", "request_id"] or partitioning.is_partitioned(TABLE):
        return  # not migrated; or partitioned, where no key without workspace_id is allowed
    # Back to (request_id): unique by construction (ids embed the workspace or are random).
    op.execute("SET LOCAL lock_timeout = '5s'")
    op.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT {PK}")
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {PK} PRIMARY KEY (request_id)")
    op.execute(
        f"CREATE UNIQUE INDEX uq_wpr_workspace_request ON {TABLE} (workspace_id, request_id)"
    )
