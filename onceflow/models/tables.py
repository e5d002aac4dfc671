"""SQLAlchemy table definitions: the schema the migrations create, and ``alembic check`` compares.

Constraint names come from ``NAMING_CONVENTION`` so that errors can be translated
by name at the boundary (``onceflow.db``). Run-time code never calls ``create_all()``:
the schema is owned by the Alembic migrations shipped in ``onceflow/migrations``.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from onceflow.models.status import Status

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

_STATUSES = ", ".join(f"'{s.value}'" for s in Status)

# Alike by shape to the other tables on purpose: each table's own columns, workspace first.
workspace_process_requests = Table(
    "workspace_process_requests",
    metadata,
    # Keyed workspace first (migrations 0007/0008), like every table of a workspace: a
    # table partitioned or distributed by workspace (Citus) accepts only such keys. The
    # request id alone is unique too (a hash over the workspace, or random).
    Column("workspace_id", Text, primary_key=True),
    Column("request_id", Text, primary_key=True),
    Column("job_id", Text, nullable=False),
    Column("branch_path", Text, nullable=False),
    Column("stage", Text, nullable=False),
    Column("dedupe", Boolean, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("input_hash", Text, nullable=False),
    Column("worker_class", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'queued'")),
    Column("claim_token", Text),
    Column("claimed_by", Text),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("heartbeat_at", DateTime(timezone=True)),
    # When the latest claim was taken (database clock): pickup latency and run duration.
    Column("claimed_at", DateTime(timezone=True)),
    # The claim's lease length (the latest a heartbeat asked for) and run deadline (claim
    # time + max_runtime): a heartbeat by (request_id, token) alone reads them here (0006).
    Column("lease_seconds", Double),
    Column("run_deadline", DateTime(timezone=True)),
    # The run id (digest of the token) whose own complete/fail ended the latest claim: a
    # retried write whose answer was lost recognises its outcome by its token (0006).
    Column("ended_run", Text),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("crash_attempts", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False),
    Column("max_crash_attempts", Integer, nullable=False),
    Column("run_after", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("cancel_requested", Boolean, nullable=False, server_default=text("false")),
    Column("dispatched_at", DateTime(timezone=True)),
    # Wake-ups the sweeper re-sent since the row's first one: the exponent of their backoff.
    # No CHECK: see migration 0004 (it would scan the table under an exclusive lock).
    Column("redispatch_count", Integer, nullable=False, server_default=text("0")),
    # Someone waits for the row's end (Queue.wait): its end sends NOTIFY onceflow_done (0010).
    Column("waited", Boolean, nullable=False, server_default=text("false")),
    # The W3C trace context the row was enqueued under (traceparent, then tracestate after a
    # newline), NULL without tracing: the run that serves it continues that trace (0013).
    Column("trace_context", Text),
    Column("result", JSONB),
    Column("error", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("finished_at", DateTime(timezone=True)),
    CheckConstraint(f"status IN ({_STATUSES})", name="status"),
    CheckConstraint("attempts >= 0 AND crash_attempts >= 0", name="attempts"),
    CheckConstraint("max_attempts >= 1 AND max_crash_attempts >= 1", name="max_attempts"),
    # A running row always has a token and a lease; no other row has a live claim.
    CheckConstraint(
        "(status = 'running') = (claim_token IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="running_has_claim",
    ),
    # The claim query's index: queued rows of one worker class, best priority first, due first.
    Index(
        "ix_wpr_claim",
        "worker_class",
        text("priority DESC"),
        "run_after",
        postgresql_where=text("status = 'queued'"),
        postgresql_include=["stage"],  # live counts by class and stage, index-only (0005)
    ),
    # The rescue query's index: running rows by lease expiry.
    Index(
        "ix_wpr_lease",
        "worker_class",
        "lease_expires_at",
        postgresql_where=text("status = 'running'"),
        postgresql_include=["stage"],
    ),
    # Dead rows, newest first, with class and stage: the dead count and the dashboard's list.
    Index(
        "ix_wpr_dead",
        text("finished_at DESC"),
        postgresql_where=text("status = 'dead'"),
        postgresql_include=["worker_class", "stage"],
    ),
    # A request named by its id alone (an old wake-up, a client that does not send the
    # workspace): found without knowing its workspace (0007). Not unique: a partitioned or
    # distributed table accepts it.
    Index("ix_wpr_request_id", "request_id"),
    # Listing a workspace's requests, newest first; workspace first, as every key of a workspace.
    Index("ix_wpr_workspace", "workspace_id", "created_at"),
    # Every request newest first (the dashboard's search; the rollup's enqueues) (0015).
    Index("ix_wpr_created", "created_at"),
    # One job's requests newest first, and a pasted job id (the dashboard's search) (0015).
    Index("ix_wpr_job", "job_id", "created_at"),
    # Retention: finished rows by age.
    Index(
        "ix_wpr_finished",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
    ),
)

# When each Flow last swept, by the database clock: a sweep begins with a compare-and-set on
# its row, so sweeps sent by beat do not pile up and workers take over when beat is gone.
onceflow_sweeps = Table(
    "onceflow_sweeps",
    metadata,
    Column("name", Text, primary_key=True),
    Column("swept_at", DateTime(timezone=True), nullable=False),
    Column("swept_by", Text, nullable=False),
)

# Which shard this database is, when workspaces are split over several (migration 0009):
# written by `onceflow migrate` under a shard map, checked by every process's router at its
# first statement on the database (onceflow.connector.sharded). At most one row.
onceflow_shard = Table(
    "onceflow_shard",
    metadata,
    Column("one", Boolean, primary_key=True, server_default=text("true")),
    Column("shard_index", Integer, nullable=False),
    Column("shard_count", Integer, nullable=False),
    Column("map_digest", Text, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    CheckConstraint("one", name="one"),
    CheckConstraint("shard_index >= 0 AND shard_index < shard_count", name="index"),
)
