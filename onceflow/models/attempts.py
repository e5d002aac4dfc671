"""The history of each request: how each of its claims ended, and what else moved it (0014)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from onceflow.models.tables import metadata

#: The ``event`` of a history row: how a claim ended (``attempt`` set) or, for an
#: operator's requeue or cancel of a row no claim held, what moved it (``attempt`` NULL).
EVENTS = (
    "succeeded",
    "handed_off",
    "failed",
    "rescued",
    "overran",
    "cancelled",
    "cancel_requested",
    "requeued",
)

#: Longest error message kept on a history row (the request's own error is kept whole).
ERROR_MESSAGE_CAP = 500

# Append-only: written by the statement that ends the claim or moves the row (onceflow.queue.sql),
# so it never disagrees with the request; deleted with its request by retention.
workspace_request_attempts = Table(
    "workspace_request_attempts",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("request_id", Text, primary_key=True),
    # The order of a request's rows (one sequence for the table).
    Column(
        "seq",
        BigInteger,
        primary_key=True,
        server_default=text("nextval('workspace_request_attempts_seq'::regclass)"),
    ),
    Column("event", Text, nullable=False),
    # The request's status after the event (queued again, dead, cancelled, succeeded).
    Column("next_status", Text, nullable=False),
    # Which run of the request the claim was (the row's attempts then); NULL: no claim ended.
    Column("attempt", Integer),
    Column("claimed_by", Text),
    Column("claimed_at", DateTime(timezone=True)),
    Column("lease_seconds", Double),
    Column("heartbeat_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True), nullable=False),
    Column("error_type", Text),
    Column("error_message", Text),
    # A hand-off's follow-up requests (same workspace).
    Column("handed_to", ARRAY(Text)),
    # The run's compute-lock outcomes: [{"cell": ..., "outcome": "paid|waited|stored"}], capped.
    Column("locks", JSONB),
    # A workspace's rows by end time: the hand-off that created a request (its created_at is
    # the parent's end, one transaction).
    Index("ix_wra_ended", "workspace_id", "ended_at"),
)
