"""Layer 3's tables: sub-docs with their commit clocks, and the op log that dedups writes."""

from __future__ import annotations

from sqlalchemy import BigInteger, CheckConstraint, Column, DateTime, Index, Table, Text, text
from sqlalchemy.dialects.postgresql import JSONB

from onceflow.models.tables import metadata

workspace_sub_docs = Table(
    "workspace_sub_docs",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("sub_doc", Text, primary_key=True),
    # The commit clock: the number of ops applied, so clocks run 1, 2, 3… without gaps.
    Column("clock", BigInteger, nullable=False, server_default=text("0")),
    Column("state", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # Highest clock whose op row retention has deleted: replays based before it are refused.
    Column("pruned_clock", BigInteger, nullable=False, server_default=text("0")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    CheckConstraint("clock >= 0 AND pruned_clock >= 0 AND pruned_clock <= clock", name="clocks"),
)

# Alike by shape to the other tables on purpose: each table's own columns, workspace first.
workspace_sub_doc_ops = Table(
    "workspace_sub_doc_ops",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("sub_doc", Text, primary_key=True),
    Column("op_id", Text, primary_key=True),
    # NULL for an op that was rejected against the state: it took no clock.
    Column("clock", BigInteger),
    Column("op_type", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("payload_hash", Text, nullable=False),
    Column("result", JSONB),
    Column("error", JSONB),
    # The request_id of the stage whose claim fenced this write, if any.
    Column("fence", Text),
    Column("committed_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    CheckConstraint("(clock IS NULL) = (error IS NOT NULL)", name="applied_or_rejected"),
    # Catching up after a reconnect: a sub-doc's ops since a clock, in order.
    Index(
        "ix_ops_clock",
        "workspace_id",
        "sub_doc",
        "clock",
        unique=True,
        postgresql_where=text("clock IS NOT NULL"),
    ),
    Index("ix_ops_committed", "committed_at"),
    # The ops a request's claims wrote (the request page; 0014).
    Index("ix_ops_fence", "workspace_id", "fence", postgresql_where=text("fence IS NOT NULL")),
)
