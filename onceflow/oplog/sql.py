"""All SQL of the op log, one named statement each (``oplog.<name>``).

Each is a :class:`~onceflow.connector.statement.Statement`: what the op log's operations
yield to a connector, rendered once for psycopg.
"""

from __future__ import annotations

from onceflow.connector.statement import Statement
from onceflow.queue.sql import IN_WORKSPACES

# Lock the sub-doc row: every writer of one sub-doc queues here, which is what makes its
# clock gapless and lets a retry that arrives mid-flight wait for the first attempt.
# The op id's row comes with it. Its snapshot is taken before the lock wait, so an attempt
# that commits this op id while we wait is not seen here: our INSERT then meets the primary
# key, and the caller reads the committed op instead (one round trip saved per apply).
LOCK_SUB_DOC = Statement.write(
    "oplog.lock_sub_doc",
    """
SELECT d.clock, d.state, d.pruned_clock,
       o.op_id IS NOT NULL AS op_found, o.clock AS op_clock, o.payload_hash,
       o.result, o.error, o.committed_at
FROM workspace_sub_docs d
LEFT JOIN workspace_sub_doc_ops o
       ON o.workspace_id = d.workspace_id AND o.sub_doc = d.sub_doc AND o.op_id = :op_id
WHERE d.workspace_id = :workspace_id AND d.sub_doc = :sub_doc
FOR UPDATE OF d
""",
)

CREATE_SUB_DOC = Statement.write(
    "oplog.create_sub_doc",
    """
INSERT INTO workspace_sub_docs (workspace_id, sub_doc) VALUES (:workspace_id, :sub_doc)
ON CONFLICT (workspace_id, sub_doc) DO NOTHING
""",
)

# A replay's fast path (before any lock), and the re-read after a primary-key collision.
FIND_OP = Statement.write(
    "oplog.find_op",
    """
SELECT clock, op_type, payload_hash, result, error, fence, committed_at
FROM workspace_sub_doc_ops
WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc AND op_id = :op_id
""",
)

# A client's retry whose fence was refused (its claim is over): the op it may have written
# under that claim, found by the fence the op row keeps — in the fenced request's workspace
# unless one is given (a by-reference write names none), within the reference's worker
# classes and workspaces. Found: the retry is a replay of a committed write; not found:
# LeaseLost.
FIND_FENCED_OP = Statement.write(
    "oplog.find_fenced_op",
    f"""
SELECT o.workspace_id, o.clock, o.op_type, o.payload_hash, o.result, o.error, o.fence,
       o.committed_at
FROM workspace_process_requests w
JOIN workspace_sub_doc_ops o
  ON o.workspace_id = w.workspace_id
 AND o.sub_doc = :sub_doc AND o.op_id = :op_id AND o.fence = w.request_id
-- The fence's row by its key: the op's workspace (a fenced op is written in the fence's
-- workspace only), else the row found by its id.
WHERE w.workspace_id = coalesce(CAST(:workspace_id AS text),
        (SELECT min(r.workspace_id) FROM workspace_process_requests r WHERE r.request_id = :fence
         HAVING count(*) = 1))
  AND w.request_id = :fence
  AND (CAST(:worker_classes AS text[]) IS NULL
       OR w.worker_class = ANY(CAST(:worker_classes AS text[])))
  AND (CAST(:ws_exact AS text[]) IS NULL OR {IN_WORKSPACES})
""",
)

# Applied: advance the clock and record the op in one statement.
RECORD_APPLIED = Statement.write(
    "oplog.record_applied",
    """
WITH doc AS (
    UPDATE workspace_sub_docs
    SET clock = :clock, state = CAST(:state AS jsonb), updated_at = now()
    WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc
)
INSERT INTO workspace_sub_doc_ops
    (workspace_id, sub_doc, op_id, clock, op_type, payload, payload_hash, result, fence)
VALUES (:workspace_id, :sub_doc, :op_id, :clock, :op_type, CAST(:payload AS jsonb),
        :payload_hash, CAST(:result AS jsonb), :fence)
RETURNING committed_at
""",
)

# Rejected against the state: recorded with its error and no clock, so a retry gets the
# same answer; the sub-doc is unchanged.
RECORD_REJECTED = Statement.write(
    "oplog.record_rejected",
    """
INSERT INTO workspace_sub_doc_ops
    (workspace_id, sub_doc, op_id, clock, op_type, payload, payload_hash, error, fence)
VALUES (:workspace_id, :sub_doc, :op_id, NULL, :op_type, CAST(:payload AS jsonb),
        :payload_hash, CAST(:error AS jsonb), :fence)
RETURNING committed_at
""",
)

GET_SUB_DOC = Statement.write(
    "oplog.get_sub_doc",
    """
SELECT clock, state, pruned_clock FROM workspace_sub_docs
WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc
""",
)

OPS_SINCE = Statement.write(
    "oplog.ops_since",
    """
SELECT op_id, clock, op_type, payload, result, fence, committed_at
FROM workspace_sub_doc_ops
WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc AND clock > :clock
ORDER BY clock
LIMIT :limit
""",
)

# Retention, bounded by :limit and one pruner at a time (a second one finds the gate shut).
# committed_at is the transaction's start, not monotonic in clock, so age alone cannot
# decide which applied ops go: per sub-doc the horizon is the highest clock among its
# applied ops past the window (the oldest batch, via ix_ops_committed), every applied op
# at or below it goes (ix_ops_clock), and pruned_clock rises to it. The log then holds
# every applied op above pruned_clock, which is what lets apply_op tell a new op based at
# or after the horizon from a pruned one. Rejected ops (clock NULL) go by age and leave
# pruned_clock where it is.
PRUNE_OPS = Statement.write(
    "oplog.prune",
    """
WITH gate AS (
    SELECT pg_try_advisory_xact_lock(hashtext('onceflow'), hashtext('oplog.prune')) AS ok
),
aged AS (
    SELECT workspace_id, sub_doc, op_id, clock
    FROM workspace_sub_doc_ops
    WHERE committed_at <= coalesce(CAST(:now AS timestamptz), now())
                          - make_interval(secs => :age)
      AND (SELECT ok FROM gate)
    ORDER BY committed_at
    LIMIT :limit
),
horizons AS (
    SELECT workspace_id, sub_doc, max(clock) AS horizon
    FROM aged WHERE clock IS NOT NULL
    GROUP BY workspace_id, sub_doc
),
doomed AS (
    SELECT workspace_id, sub_doc, op_id FROM aged WHERE clock IS NULL
    UNION ALL
    SELECT o.workspace_id, o.sub_doc, o.op_id
    FROM horizons h
    JOIN workspace_sub_doc_ops o
      ON o.workspace_id = h.workspace_id AND o.sub_doc = h.sub_doc AND o.clock <= h.horizon
),
gone AS (
    DELETE FROM workspace_sub_doc_ops o
    USING doomed d
    WHERE o.workspace_id = d.workspace_id AND o.sub_doc = d.sub_doc AND o.op_id = d.op_id
    RETURNING 1
),
upd AS (
    UPDATE workspace_sub_docs s
    SET pruned_clock = greatest(s.pruned_clock, h.horizon)
    FROM horizons h
    WHERE s.workspace_id = h.workspace_id AND s.sub_doc = h.sub_doc
      AND s.pruned_clock < h.horizon
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM upd) AS sub_docs
""",
)
