"""The SQL of the metrics' database collector (``onceflow.metrics.collector``) and of the
queue's overview (``onceflow.queue.overview``).

Counts of live requests by worker class, stage and status read only the partial
indexes (index-only scans): ix_wpr_claim (queued: worker_class, priority, run_after
INCLUDE stage), ix_wpr_lease (running: worker_class, lease_expires_at INCLUDE stage)
and ix_wpr_dead (dead: finished_at INCLUDE worker_class, stage) — see migration 0005.
The cost follows the live backlog and the dead rows, never the table's finished
history: succeeded and cancelled rows are never counted here (their totals come from
the process counters, the table's size from ``pg_class.reltuples``, an estimate).
One branch per index: an OR across statuses would defeat the partial indexes. Each
branch reads at most a cap of index entries (:func:`live_counts`): exact below it, a
lower bound (flagged ``capped``) at it, so a huge backlog cannot make the read slow.
"""

from __future__ import annotations

from onceflow.connector.statement import Statement
from onceflow.models.tables import workspace_process_requests

TABLE = workspace_process_requests.name

#: Rows each branch (index) counts at most: past it the counts are lower bounds.
COUNT_CAP_DEFAULT = 100_000


def live_counts(cap: int = COUNT_CAP_DEFAULT, *, age_column: str = "oldest_due_age") -> str:
    """The live counts, each status's branch reading at most ``cap`` index entries.

    A branch that read ``cap`` entries answers ``capped`` true: its counts (and, for
    queued, the oldest due age) are LOWER BOUNDS, from the first ``cap`` entries of its
    index. The cost is bounded by the cap, not by the backlog. Each ``ORDER BY`` is its
    index's order: the planner walks the index (index-only) instead of reading the heap,
    even when most of the table is in that status.
    """
    cap = int(cap)
    if cap < 1:
        raise ValueError("the count cap must be at least 1")
    capped = f"sum(count(*)) OVER () >= {cap} AS capped"
    return f"""
WITH n AS (SELECT now() AS now)
SELECT w.worker_class, w.stage,
       count(*) FILTER (WHERE w.run_after <= n.now) AS queued,
       count(*) FILTER (WHERE w.run_after > n.now) AS scheduled,
       0::bigint AS running, 0::bigint AS dead,
       EXTRACT(EPOCH FROM n.now - min(w.run_after) FILTER (WHERE w.run_after <= n.now))::float8
           AS {age_column},
       {capped}
FROM (SELECT q.worker_class, q.stage, q.run_after FROM {TABLE} q
      WHERE q.status = 'queued'
      ORDER BY q.worker_class, q.priority DESC, q.run_after LIMIT {cap}) w, n
GROUP BY w.worker_class, w.stage, n.now
UNION ALL
SELECT w.worker_class, w.stage, 0, 0, count(*), 0, NULL, {capped}
FROM (SELECT r.worker_class, r.stage FROM {TABLE} r
      WHERE r.status = 'running'
      ORDER BY r.worker_class, r.lease_expires_at LIMIT {cap}) w
GROUP BY w.worker_class, w.stage
UNION ALL
SELECT w.worker_class, w.stage, 0, 0, 0, count(*), NULL, {capped}
FROM (SELECT d.worker_class, d.stage FROM {TABLE} d
      WHERE d.status = 'dead' ORDER BY d.finished_at DESC LIMIT {cap}) w
GROUP BY w.worker_class, w.stage
"""


def capped_statuses(rows: list[dict[str, object]]) -> list[str]:
    """The statuses whose counts are lower bounds (their branch hit the cap)."""
    out: set[str] = set()
    for r in rows:
        if r["capped"]:
            if r["running"]:
                out.add("running")
            elif r["dead"]:
                out.add("dead")
            else:
                out.update(("queued", "scheduled"))
    return sorted(out)


# The planner's estimate of the table's rows (-1 before its first ANALYZE on PG 14+). A table
# hash-partitioned by workspace (ONCEFLOW_PARTITIONS): the sum over its partitions, which
# autovacuum analyzes; the parent's own reltuples is set by a manual ANALYZE only, and goes
# stale (docs/sharding.md 2.4). Partitions never analyzed count 0; all of them: -1.
ESTIMATED_ROWS = Statement.write(
    "metrics.estimated_rows",
    f"""
SELECT CASE WHEN c.relkind = 'p' THEN (
           SELECT CASE WHEN bool_or(p.reltuples >= 0)
                       THEN sum(greatest(p.reltuples, 0))::float8 ELSE -1 END
           FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
           WHERE i.inhparent = c.oid)
       ELSE c.reltuples::float8 END AS estimate
FROM pg_class c WHERE c.oid = '{TABLE}'::regclass
""",
)

# The table's vacuum health, from the statistics views (no read of the table): its dead row
# versions (pg_stat_user_tables.n_dead_tup; on a partitioned table summed over the
# partitions, the parent holds none), the seconds since the last vacuum (by hand or by
# autovacuum) of the least recently vacuumed partition that holds dead rows (0 when none
# does, so a quiet partition that needs no vacuum does not count; NULL while one that
# does was never vacuumed), and the age of the oldest open transaction of a client holding
# a snapshot or a transaction id in this database, other than this one (0 if none; a
# vacuum's own holds no other back): while it runs no vacuum can clean a row it might see,
# and the claim index's front of claimed rows' entries only grows (docs/how-to/operate.md,
# "Autovacuum and claim_next loops"). pg_stat_activity shows another role's sessions' times
# only to a superuser or a member of pg_read_all_stats: without it, their transactions are
# not seen. Not seen either: prepared transactions, replication slots, a standby's feedback.
TABLE_HEALTH = Statement.write(
    "metrics.table_health",
    f"""
WITH parts AS (
    SELECT '{TABLE}'::regclass AS relid
    UNION ALL
    SELECT i.inhrelid FROM pg_inherits i WHERE i.inhparent = '{TABLE}'::regclass
),
s AS (
    SELECT st.* FROM pg_stat_user_tables st JOIN parts p ON p.relid = st.relid
    JOIN pg_class c ON c.oid = st.relid
    WHERE c.relkind <> 'p'  -- a partitioned parent has a row, but no storage to vacuum
)
SELECT (SELECT coalesce(sum(n_dead_tup), 0)::float8 FROM s) AS dead_rows,
       (SELECT coalesce(EXTRACT(EPOCH FROM now() - min(greatest(last_vacuum, last_autovacuum))
                                              FILTER (WHERE n_dead_tup > 0)), 0)::float8
        FROM s HAVING bool_and(n_dead_tup = 0
                               OR coalesce(last_vacuum, last_autovacuum) IS NOT NULL))
           AS vacuum_age,
       (SELECT coalesce(EXTRACT(EPOCH FROM now() - min(a.xact_start)), 0)::float8
        FROM pg_stat_activity a
        WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
          AND a.backend_type = 'client backend'
          AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)) AS oldest_xact_age
""",
)

Q_LIVE_COUNTS = live_counts()
