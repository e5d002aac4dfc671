# Frozen history: Alembic's revision header repeats in every migration by design.
"""The dashboard's request search indexes and the sweeper's per-minute rollup.

Two indexes on ``workspace_process_requests``, built ``CONCURRENTLY`` (enqueues, claims and
completions go on while they build; one partition at a time on a partitioned table):

* ``ix_wpr_created (created_at)``: every request, newest first, for the dashboard's search
  without a workspace or a job (filters on stage, class, status, time read it in order);
  the sweeper's rollup reads the last minutes' enqueues from it. ``created_at`` is never
  updated: the index costs each enqueue one entry and no claim or completion anything.
* ``ix_wpr_job (job_id, created_at)``: one job's requests, newest first, and a pasted job id.

Three plain tables (on a database split by workspace each shard keeps its own and the
dashboard sums them), written by each sweep and pruned with the requests by retention:

* ``onceflow_series``: per minute, worker class and stage — requests enqueued, claimed,
  finished by status, rescued, the pickup latency's count, sum and maximum, and the queue
  depth and running count sampled at the sweep;
* ``onceflow_series_spend``: per minute, workspace and provider — the spend ledger's calls,
  tokens, cost and saved cost;
* ``onceflow_series_savings``: per minute — compute-lock calls made and saved (the change of
  the Redis counters between sweeps), with the counters' totals as last read.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from onceflow.migrations import partitioning

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_process_requests"

# (name, columns)
INDEXES = (
    ("ix_wpr_created", "created_at"),
    ("ix_wpr_job", "job_id, created_at"),
)


def _count(name: str) -> sa.Column[object]:
    return sa.Column(name, sa.BigInteger(), server_default=sa.text("0"), nullable=False)


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "onceflow_series",
        sa.Column("bucket", tz, nullable=False),
        sa.Column("worker_class", sa.Text(), nullable=False),
        sa.Column("stage", sa.Text(), nullable=False),
        *(_count(n) for n in ("enqueued", "claimed", "succeeded", "dead", "cancelled")),
        _count("rescued"),
        _count("pickup_count"),
        sa.Column("pickup_sum", sa.Double(), server_default=sa.text("0"), nullable=False),
        sa.Column("pickup_max", sa.Double(), nullable=True),
        sa.Column("queued", sa.BigInteger(), nullable=True),
        sa.Column("running", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("bucket", "worker_class", "stage", name=op.f("pk_onceflow_series")),
    )
    op.create_table(
        "onceflow_series_spend",
        sa.Column("bucket", tz, nullable=False),
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("provider", sa.Text(), nullable=False),
        _count("calls"),
        _count("input_tokens"),
        _count("output_tokens"),
        sa.Column("cost", sa.Numeric(), nullable=True),
        sa.Column("saved_cost", sa.Numeric(), nullable=True),
        sa.PrimaryKeyConstraint(
            "bucket", "workspace_id", "provider", name=op.f("pk_onceflow_series_spend")
        ),
    )
    op.create_table(
        "onceflow_series_savings",
        sa.Column("bucket", tz, nullable=False),
        _count("made"),
        _count("saved"),
        sa.Column("totals", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("bucket", name=op.f("pk_onceflow_series_savings")),
    )
    with op.get_context().autocommit_block():
        for name, columns in INDEXES:
            partitioning.create_index_concurrently(name, TABLE, columns)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, _columns in reversed(INDEXES):
            partitioning.drop_index(name)
    op.drop_table("onceflow_series_savings")
    op.drop_table("onceflow_series_spend")
    op.drop_table("onceflow_series")
