"""All SQL of the op log, one named statement each (rendered once for psycopg)."""

from __future__ import annotations

from sqlalchemy import text

from onceflow.db import render

# Lock the sub-doc row: every writer of one sub-doc queues here, which is what makes its
# clock gapless and lets a retry that arrives mid-flight wait for the first attempt.
# The op id's row comes with it. Its snapshot is taken before the lock wait, so an attempt
# that commits this op id while we wait is not seen here: our INSERT then meets the primary
# key, and the caller reads the committed op instead (one round trip saved per apply).
LOCK_SUB_DOC = render(
    text("""
SELECT d.clock, d.state, d.pruned_clock,
       o.op_id IS NOT NULL AS op_found, o.clock AS op_clock, o.payload_hash,
       o.result, o.error, o.committed_at
FROM workspace_sub_docs d
LEFT JOIN workspace_sub_doc_ops o
       ON o.workspace_id = d.workspace_id AND o.sub_doc = d.sub_doc AND o.op_id = :op_id
WHERE d.workspace_id = :workspace_id AND d.sub_doc = :sub_doc
FOR UPDATE OF d
""")
)

CREATE_SUB_DOC = render(
    text("""
INSERT INTO workspace_sub_docs (workspace_id, sub_doc) VALUES (:workspace_id, :sub_doc)
ON CONFLICT (workspace_id, sub_doc) DO NOTHING
""")
)

# A replay's fast path (before any lock), and the re-read after a primary-key collision.
FIND_OP = render(
    text("""
SELECT clock, op_type, payload_hash, result, error, fence, committed_at
FROM workspace_sub_doc_ops
WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc AND op_id = :op_id
""")
)

# Applied: advance the clock and record the op in one statement.
RECORD_APPLIED = render(
    text("""
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
""")
)

# Rejected against the state: recorded with its error and no clock, so a retry gets the
# same answer; the sub-doc is unchanged.
RECORD_REJECTED = render(
    text("""
INSERT INTO workspace_sub_doc_ops
    (workspace_id, sub_doc, op_id, clock, op_type, payload, payload_hash, error, fence)
VALUES (:workspace_id, :sub_doc, :op_id, NULL, :op_type, CAST(:payload AS jsonb),
        :payload_hash, CAST(:error AS jsonb), :fence)
RETURNING committed_at
""")
)

GET_SUB_DOC = render(
    text("""
SELECT clock, state, pruned_clock FROM workspace_sub_docs
WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc
""")
)

OPS_SINCE = render(
    text("""
SELECT op_id, clock, op_type, payload, result, fence, committed_at
FROM workspace_sub_doc_ops
WHERE workspace_id = :workspace_id AND sub_doc = :sub_doc AND clock > :clock
ORDER BY clock
LIMIT :limit
""")
)

# Retention: delete op rows older than the window and raise each touched sub-doc's
# pruned_clock, so a replay based before it is refused instead of applied again.
PRUNE_OPS = render(
    text("""
WITH old AS (
    DELETE FROM workspace_sub_doc_ops
    WHERE ctid IN (
        SELECT ctid FROM workspace_sub_doc_ops
        WHERE committed_at <= coalesce(CAST(:now AS timestamptz), now())
                              - make_interval(secs => :age)
        LIMIT :limit
    )
    RETURNING workspace_id, sub_doc, clock
),
per_doc AS (
    SELECT workspace_id, sub_doc, max(clock) AS clock FROM old GROUP BY workspace_id, sub_doc
),
upd AS (
    UPDATE workspace_sub_docs d
    SET pruned_clock = greatest(d.pruned_clock, coalesce(p.clock, d.clock))
    FROM per_doc p
    WHERE d.workspace_id = p.workspace_id AND d.sub_doc = p.sub_doc
    RETURNING 1
)
SELECT (SELECT count(*) FROM old) AS deleted, (SELECT count(*) FROM upd) AS sub_docs
""")
)
