"""The spend tables: the cost ledger, budgets, and the reservations of calls in flight.

All three are workspace tables (keyed workspace first, hash-partitioned with the others
under ``ONCEFLOW_PARTITIONS``). A ledger row is one settled provider call, keyed by its
permit's id: a settle repeated after a lost reply writes nothing twice. A reservation is a
call admitted and not yet settled, holding its estimate against the workspace's budgets
until it is settled, released, or its ``expires_at`` (database clock) has passed.
"""

from __future__ import annotations

# The column types each table module imports (alike by shape): imports, not logic.
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Numeric,
    Table,
    Text,
    text,
)

from onceflow.models.tables import metadata

#: What a ledger row says of its call.
LEDGER_OUTCOMES = ("ok", "failed", "rate_limited", "abandoned", "cache_hit")
#: A budget's period (UTC calendar day or month) and what a refused call does.
PERIODS = ("day", "month")
ON_EXCEEDED = ("fail", "wait")


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


# Alike by shape to the other tables on purpose: each table's own columns, workspace first.
spend_ledger = Table(
    "spend_ledger",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("permit_id", Text, primary_key=True),
    Column("stage", Text),
    Column("request_id", Text),
    Column("cell_key", Text),
    Column("provider", Text, nullable=False),
    Column("model", Text),
    Column("input_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("output_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("cost", Numeric),
    # A cache hit's row: what the call it spared cost when it was made (``cost`` is NULL,
    # nothing was paid).
    Column("saved_cost", Numeric),
    Column("outcome", Text, nullable=False),
    # Written under a claim: true when its lease was live at the write, false when it was
    # lost (the row is kept: the call was paid for), NULL without a claim.
    Column("fenced", Boolean),
    Column("started_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    # The database clock at the write: the periods of budgets and reports count by it.
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    CheckConstraint(f"outcome IN ({_in(LEDGER_OUTCOMES)})", name="outcome"),
    CheckConstraint("input_tokens >= 0 AND output_tokens >= 0", name="tokens"),
    CheckConstraint("cost IS NULL OR cost >= 0", name="cost"),
    # A workspace's spend in a period: index-only sums.
    Index(
        "ix_spend_ledger_workspace",
        "workspace_id",
        "recorded_at",
        postgresql_include=["input_tokens", "output_tokens", "cost"],
    ),
    # Spend by provider over a period, across workspaces.
    Index("ix_spend_ledger_provider", "provider", "recorded_at"),
    # A request's rows (the request page; 0014).
    Index(
        "ix_spend_ledger_request",
        "workspace_id",
        "request_id",
        postgresql_where=text("request_id IS NOT NULL"),
    ),
)

# Alike by shape to the other tables on purpose: each table's own columns, workspace first.
spend_budgets = Table(
    "spend_budgets",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("period", Text, primary_key=True),
    Column("limit_cost", Numeric),
    Column("limit_tokens", BigInteger),
    Column("on_exceeded", Text, nullable=False, server_default=text("'fail'")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    CheckConstraint(f"period IN ({_in(PERIODS)})", name="period"),
    CheckConstraint(f"on_exceeded IN ({_in(ON_EXCEEDED)})", name="on_exceeded"),
    CheckConstraint(
        "(limit_cost IS NOT NULL OR limit_tokens IS NOT NULL) "
        "AND (limit_cost IS NULL OR limit_cost >= 0) "
        "AND (limit_tokens IS NULL OR limit_tokens >= 0)",
        name="limits",
    ),
)

# Alike by shape to the other tables on purpose: each table's own columns, workspace first.
spend_reservations = Table(
    "spend_reservations",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("permit_id", Text, primary_key=True),
    Column("provider", Text, nullable=False),
    Column("stage", Text),
    Column("request_id", Text),
    Column("cell_key", Text),
    Column("tokens", BigInteger, nullable=False),
    Column("cost", Numeric),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("tokens >= 0 AND (cost IS NULL OR cost >= 0)", name="estimate"),
)
