# Frozen history: Alembic's revision header repeats in every migration by design.
"""The trace context a request was enqueued under.

``workspace_process_requests.trace_context``: the W3C ``traceparent`` (and ``tracestate``)
of the span that enqueued the row, or NULL (no tracing, or the row predates this revision).
The run that serves the row continues that trace, however late and wherever it runs; a
duplicate enqueue links to it. A nullable column without a default: adding it rewrites
nothing, and on a table partitioned by workspace it is added to every partition.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE workspace_process_requests ADD COLUMN IF NOT EXISTS trace_context text")


def downgrade() -> None:
    op.execute("ALTER TABLE workspace_process_requests DROP COLUMN IF EXISTS trace_context")
