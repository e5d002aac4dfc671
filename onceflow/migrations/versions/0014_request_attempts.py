# Frozen history: Alembic's revision header repeats in every migration by design.
"""Each request's history: how each of its claims ended, and what else moved it.

``workspace_request_attempts``: append-only, keyed ``(workspace_id, request_id, seq)``
(``seq`` from its own sequence: the order of a request's rows). A row is written by the
same statement that ends a claim (a completion or hand-off, a failure, the sweeper's rescue
of a lapsed lease or an overrun) or that moves a request without a claim (an operator's
requeue or cancel), so the history never disagrees with the request's row. Retention
deletes a request's rows with the request. Created in the database's layout
(hash-partitioned by workspace when the other workspace tables are).

Two indexes for the request page's reads, built ``CONCURRENTLY`` (writes go on while they
build): ``ix_ops_fence`` finds the ops a request's claims wrote (``fence``, partial: ops
written outside a claim are not in it), ``ix_spend_ledger_request`` the ledger rows of a
request.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from onceflow.migrations import partitioning

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "workspace_request_attempts"
SEQUENCE = "workspace_request_attempts_seq"

# (name, table, columns, condition)
INDEXES = (
    ("ix_ops_fence", "workspace_sub_doc_ops", "workspace_id, fence", "fence IS NOT NULL"),
    (
        "ix_spend_ledger_request",
        "spend_ledger",
        "workspace_id, request_id",
        "request_id IS NOT NULL",
    ),
)


def upgrade() -> None:
    partitions = partitioning.target()  # ONCEFLOW_PARTITIONS: hash partitions by workspace
    tz = sa.DateTime(timezone=True)
    op.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}")
    op.create_table(
        TABLE,
        sa.Column("workspace_id", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column(
            "seq", sa.BigInteger(), server_default=sa.text(f"nextval('{SEQUENCE}')"), nullable=False
        ),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("next_status", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("claimed_at", tz, nullable=True),
        sa.Column("lease_seconds", sa.Double(), nullable=True),
        sa.Column("heartbeat_at", tz, nullable=True),
        sa.Column("ended_at", tz, nullable=False),
        sa.Column("error_type", sa.Text(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("handed_to", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("locks", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.PrimaryKeyConstraint(
            "workspace_id", "request_id", "seq", name=op.f("pk_workspace_request_attempts")
        ),
        **partitioning.partition_by(partitions),
    )
    partitioning.create_partitions(TABLE, partitions)
    op.execute(f"ALTER SEQUENCE {SEQUENCE} OWNED BY {TABLE}.seq")
    op.create_index("ix_wra_ended", TABLE, ["workspace_id", "ended_at"])
    with op.get_context().autocommit_block():
        for name, table, columns, where in INDEXES:
            partitioning.create_index_concurrently(name, table, columns, where=where)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, _table, _columns, _where in reversed(INDEXES):
            partitioning.drop_index(name)
    op.drop_index("ix_wra_ended", table_name=TABLE)
    op.drop_table(TABLE)  # its sequence (OWNED BY) with it
