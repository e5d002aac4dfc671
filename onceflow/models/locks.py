"""The ``compute_locks`` table: layer 2's SQL backend, for deployments without Redis.

One row per held compute lock, keyed ``(workspace_id, job_id, task)`` with the
workspace first, so a workspace's rows stay together when the database is split by
workspace (docs/sharding.md). ``expires_at`` is set from the
database clock at acquisition; an expired row is replaced by the next
acquisition in the same statement, so a crashed holder blocks nobody past its
TTL and no sweeper is needed.
"""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Table, Text, text

from onceflow.models.tables import metadata

# Alike by shape to the other tables on purpose: each table's own columns, workspace first.
compute_locks = Table(
    "compute_locks",
    metadata,
    Column("workspace_id", Text, primary_key=True),
    Column("job_id", Text, primary_key=True),
    Column("task", Text, primary_key=True),
    # The owner's token: release and extend compare it, so nobody deletes another's lock.
    Column("token", Text, nullable=False),
    Column("acquired_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)
