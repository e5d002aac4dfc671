"""The sweeper's per-minute rollup, the dashboard's time series (migration 0015).

Plain tables (not workspace tables): on a database split by workspace each shard keeps the
rollup of its own rows, and the dashboard sums the shards'. Pruned with the requests by
retention (:mod:`onceflow.queue.series`).
"""

from __future__ import annotations

# The column types each table module imports (alike by shape): imports, not logic.
from sqlalchemy import BigInteger, Column, DateTime, Double, Numeric, Table, Text, text
from sqlalchemy.dialects.postgresql import JSONB

from onceflow.models.tables import metadata


def _count(name: str) -> Column[int]:
    return Column(name, BigInteger, nullable=False, server_default=text("0"))


# Per minute, worker class and stage: what happened to requests in that minute.
onceflow_series = Table(
    "onceflow_series",
    metadata,
    Column("bucket", DateTime(timezone=True), primary_key=True),
    Column("worker_class", Text, primary_key=True),
    Column("stage", Text, primary_key=True),
    _count("enqueued"),  # rows created in the minute
    _count("claimed"),  # latest claims taken in the minute
    _count("succeeded"),  # rows finished in the minute, by status
    _count("dead"),
    _count("cancelled"),
    _count("rescued"),  # lapsed leases the sweeper requeued in the minute
    # Pickup latency (claimed_at - run_after) of the minute's claims still on their row.
    _count("pickup_count"),
    Column("pickup_sum", Double, nullable=False, server_default=text("0")),
    Column("pickup_max", Double),
    # Sampled at the minute's latest sweep (NULL: no sweep sampled it).
    Column("queued", BigInteger),
    Column("running", BigInteger),
)

# Per minute, workspace and provider: the spend ledger's rows recorded in the minute.
onceflow_series_spend = Table(
    "onceflow_series_spend",
    metadata,
    Column("bucket", DateTime(timezone=True), primary_key=True),
    Column("workspace_id", Text, primary_key=True),
    Column("provider", Text, primary_key=True),
    _count("calls"),
    _count("input_tokens"),
    _count("output_tokens"),
    Column("cost", Numeric),
    Column("saved_cost", Numeric),
)

# Per minute: compute-lock calls made and saved (the Redis counters' change between sweeps),
# and the counters' per-workspace totals as the minute's latest sweep read them.
onceflow_series_savings = Table(
    "onceflow_series_savings",
    metadata,
    Column("bucket", DateTime(timezone=True), primary_key=True),
    _count("made"),
    _count("saved"),
    Column("totals", JSONB, nullable=False),
)
