# Frozen history: Alembic's revision header repeats in every migration by design.
"""Requests keyed workspace-first, step 1 of 2: a unique index on ``(workspace_id, request_id)``.

Built ``CONCURRENTLY`` (inserts, claims and completions go on while it builds; its
duration: docs/sharding.md 5.1.1), with a plain index on
``request_id`` beside it for callers that still name a request by its id alone (an old
wake-up, an HTTP client that does not send the workspace). Both builds run outside a
transaction; an ``INVALID`` index left by an interrupted earlier attempt is dropped and
built again.

Code of this release writes ``ON CONFLICT (workspace_id, request_id)``, which needs the new
index; code of the release before writes ``ON CONFLICT (request_id)``, which needs the old
primary key, dropped by 0008. A rolling upgrade therefore runs ``onceflow migrate --to 0007``,
deploys, then ``onceflow migrate`` once no process of the old release is left
(docs/how-to/operate.md, "Upgrading"). A table created partitioned (``ONCEFLOW_PARTITIONS``)
is keyed ``(workspace_id, request_id)`` from the start: only ``ix_wpr_request_id`` is built
there, one partition at a time ``CONCURRENTLY`` and attached to the parent's index (a
partitioned parent refuses ``CREATE INDEX CONCURRENTLY``; onceflow/migrations/partitioning.py).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from collections.abc import Sequence

from alembic import op

from onceflow.migrations import partitioning

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"

# (name, unique, columns)
INDEXES = (
    ("uq_wpr_workspace_request", True, "workspace_id, request_id"),
    ("ix_wpr_request_id", False, "request_id"),
)


def upgrade() -> None:
    partitioned = partitioning.is_partitioned(TABLE)
    with op.get_context().autocommit_block():
        for name, unique, columns in INDEXES:
            if unique and partitioned:
                continue  # its primary key is (workspace_id, request_id) already (0001)
            partitioning.create_index_concurrently(name, TABLE, columns, unique=unique)


def downgrade() -> None:
    partitioned = partitioning.is_partitioned(TABLE)
    with op.get_context().autocommit_block():
        for name, unique, _columns in reversed(INDEXES):
            if unique and partitioned:
                continue
            partitioning.drop_index(name)
