"""The SQL of the metrics' database collector (``onceflow.metrics.collector``).

Counts of live requests by worker class, stage and status read only the partial
indexes (index-only scans): ix_wpr_claim (queued: worker_class, priority, run_after
INCLUDE stage), ix_wpr_lease (running: worker_class, lease_expires_at INCLUDE stage)
and ix_wpr_dead (dead: finished_at INCLUDE worker_class, stage) — see migration 0005.
The cost follows the live backlog and the dead rows, never the table's finished
history: succeeded and cancelled rows are never counted here (their totals come from
the process counters, the table's size from ``pg_class.reltuples``, an estimate).
One branch per index: an OR across statuses would defeat the partial indexes.
"""

from __future__ import annotations

from sqlalchemy import text

from onceflow.db import render
from onceflow.queue.sql import TABLE

LIVE_COUNTS = text(f"""
WITH n AS (SELECT now() AS now)
SELECT w.worker_class, w.stage,
       count(*) FILTER (WHERE w.run_after <= n.now) AS queued,
       count(*) FILTER (WHERE w.run_after > n.now) AS scheduled,
       0::bigint AS running, 0::bigint AS dead,
       EXTRACT(EPOCH FROM n.now - min(w.run_after) FILTER (WHERE w.run_after <= n.now))::float8
           AS oldest_due_age
FROM {TABLE} w, n
WHERE w.status = 'queued'
GROUP BY w.worker_class, w.stage, n.now
UNION ALL
SELECT w.worker_class, w.stage, 0, 0, count(*), 0, NULL
FROM {TABLE} w
WHERE w.status = 'running'
GROUP BY w.worker_class, w.stage
UNION ALL
SELECT w.worker_class, w.stage, 0, 0, 0, count(*), NULL
FROM {TABLE} w
WHERE w.status = 'dead'
GROUP BY w.worker_class, w.stage
""")

# The planner's estimate of the table's rows (-1 before its first ANALYZE on PG 14+).
ESTIMATED_ROWS = text(f"""
SELECT c.reltuples::float8 AS estimate FROM pg_class c WHERE c.oid = '{TABLE}'::regclass
""")

Q_LIVE_COUNTS = render(LIVE_COUNTS)
Q_ESTIMATED_ROWS = render(ESTIMATED_ROWS)
