# Over ~400 lines on purpose: all SQL of the queue, one named statement each, in one place.
"""All SQL of the layer-1 queue, one named statement each.

Every statement takes ``:now`` (NULL in production): ``coalesce(:now, now())`` makes
the database clock the only clock, while tests inject time without sleeping
(River's pattern). Every fenced statement names the claim token and requires a
live lease (``lease_expires_at > now``); zero rows means the lease is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from onceflow.connector.statement import Statement
from onceflow.connector.steps import Query
from onceflow.models.requests import _REQUEST_FIELDS

TABLE = "workspace_process_requests"

#: The columns a :class:`~onceflow.models.Request` is built from (never the claim token).
RETURNING = ", ".join(f"w.{name}" for name in _REQUEST_FIELDS)

#: The statement's time: the caller's :now (tests, a clock-skew check), else the transaction's
#: start. As an expression, not a CTE's column, where it must bound an index scan.
_NOW_EXPR = "coalesce(CAST(:now AS timestamptz), now())"
_NOW = f"SELECT {_NOW_EXPR} AS now"

# A request is addressed by (workspace_id, request_id), its key (migrations 0007/0008): the
# form a table partitioned or distributed by workspace can route. A caller that knows only
# the id (a wake-up sent before the workspace was in it, an HTTP client that does not send
# it) passes :workspace_id NULL, and the workspace is read from the row by its id
# (ix_wpr_request_id); coalesce never evaluates that lookup when the workspace is given.
# An id that names rows of several workspaces (possible only with ids the callers chose)
# names none of them: NULL, so the statement matches nothing rather than another
# workspace's row (`_ws_of_id`; the same rule as the router's look-up).


def _ws_of_id(rid: str) -> str:
    """The workspace of the one row whose id is the SQL expression ``rid`` (else NULL)."""
    return f"""SELECT min(o.workspace_id) FROM workspace_process_requests o
    WHERE o.request_id = {rid} HAVING count(*) = 1"""


# The row's workspace in a statement's two forms: given, or read from the row by its id.
_WS_GIVEN = "CAST(:workspace_id AS text)"
_WS_OF_ID = f"""coalesce(CAST(:workspace_id AS text),
    ({_ws_of_id(":request_id")}))"""


def _by_id(ws: str) -> str:
    """The row of :request_id in the workspace ``ws`` (``_WS_GIVEN`` or ``_WS_OF_ID``)."""
    return f"w.workspace_id = {ws}\n  AND w.request_id = :request_id"


def _by_key(name: str) -> Callable[[Callable[[str], str]], Statement]:
    """Makes the function below it the statement ``name`` that finds its row by ``_by_id``:
    the function writes the SQL for a workspace expression, and the statement is its SQL
    keyed (``_WS_GIVEN``), with its form by id (``_WS_OF_ID``) as ``by_id``."""

    def statement(build: Callable[[str], str]) -> Statement:
        return Statement.write(name, build(_WS_GIVEN), by_id=build(_WS_OF_ID))

    return statement


# Each statement that finds its row by _by_id runs in two forms (`_by_key`): with the
# workspace given, `w.workspace_id = :workspace_id`; the coalesce form only for a caller
# that names the row by id alone. With the coalesce, Postgres costed the generic plan of a
# prepared statement with the id lookup in it and a custom plan without it (the workspace
# known, coalesce folds): when the table's statistics were those of an empty table (a new
# install), the custom plan won every time, and every claim and completion was planned
# again, which roughly doubled the backend's CPU per stage.

# _NOW for claims and heartbeats: with :lazy true, this statement's own transaction commits
# without waiting for the WAL flush (synchronous_commit = off, SET LOCAL: it ends with the
# transaction). Only on a pooled connection in autocommit (the operation asks `Pooled`):
# inside a caller's transaction it would make the caller's commit lazy too, so :lazy is
# false there and the setting is set to what it already is. Why a lost claim or heartbeat
# is safe and a completion is not: docs/reliability.md, "Lazy commits for claims".
_NOW_LAZY = f"""{_NOW}, set_config('synchronous_commit',
        CASE WHEN CAST(:lazy AS boolean) THEN 'off' ELSE current_setting('synchronous_commit')
        END, true) AS commit_mode"""

#: The channel of work wake-ups (payload: a worker class). Postgres delivers a NOTIFY when
#: the sending transaction commits, never if it rolls back. See onceflow.queue.notify.
NOTIFY_CHANNEL = "onceflow_work"


def _notify(rows: str, where: str = "true") -> str:
    """A CTE body: one NOTIFY per distinct worker class of ``rows`` matching ``where``; for
    statements of many rows (one row's statement: ``_notify_one``, cheaper).

    Sent only when ``:notify`` is true (the ``notify`` setting). A CTE that is not
    referenced is never run: the statement's final SELECT names it (``_SENT``).
    """
    return f"""SELECT count(pg_notify('{NOTIFY_CHANNEL}', d.worker_class)) AS sent
    FROM (SELECT DISTINCT r.worker_class FROM {rows} r, n
          WHERE CAST(:notify AS boolean) AND ({where})) AS d"""


# Always true; makes the final SELECT read the `sig` CTE, so its NOTIFYs are sent.
_SENT = "(SELECT sent FROM sig) >= 0"


def _notify_one(row: str, where: str) -> str:
    """A WHERE condition, always true, that sends ``row``'s NOTIFY when ``where`` holds and
    ``:notify`` is true: for statements of one row (a CASE evaluates its branches in order,
    so the notify runs exactly when its condition holds; a duplicate NOTIFY in one
    transaction is folded by Postgres anyway)."""
    return f"""CASE WHEN CAST(:notify AS boolean) AND ({where})
      THEN CAST(pg_notify('{NOTIFY_CHANNEL}', {row}.worker_class) AS text) = ''
      ELSE true END"""


#: The history table: one row per ended claim or operator move, written by the statement
#: that ends or moves the row (migration 0014), so it never disagrees with the row.
ATTEMPTS = "workspace_request_attempts"

#: Longest error message copied to a history row (the row keeps its whole error).
_MESSAGE_CAP = 500


def _history(rows: str, event: str, **values: str) -> str:
    """A CTE body: one history row (``ATTEMPTS``) per row of ``rows`` (a data-modifying CTE
    returning the ``h_`` columns of ``_HISTORY_RETURNING``), its event ``event`` (an SQL
    expression over ``r``, the row). ``values`` overrides a column's expression (``attempt``,
    ``error``: the error JSON, ``handed_to``, ``locks``); a claim's columns come from the
    row unless ``claimless`` is given."""
    claimless = "claimless" in values
    claim = (
        "NULL, NULL, NULL, NULL"
        if claimless
        else "r.h_claimed_by, r.h_claimed_at, r.h_lease_seconds, r.h_heartbeat_at"
    )
    attempt = values.get("attempt", "NULL" if claimless else "r.h_attempts")
    error = values.get("error")
    errors = (
        "NULL, NULL"
        if error is None
        else f"left({error} ->> 'type', 200), left({error} ->> 'message', {_MESSAGE_CAP})"
    )
    return f"""INSERT INTO {ATTEMPTS} (workspace_id, request_id, event, next_status, attempt,
        claimed_by, claimed_at, lease_seconds, heartbeat_at, ended_at, error_type,
        error_message, handed_to, locks)
    SELECT r.h_workspace_id, r.h_request_id, {event}, r.h_status, {attempt}, {claim},
           r.h_updated_at, {errors},
           {values.get("handed_to", "NULL")}, {values.get("locks", "NULL")}
    FROM {rows} r"""


#: What a statement writing history returns of its row (after the write) for ``_history``.
_HISTORY_RETURNING = """w.workspace_id AS h_workspace_id, w.request_id AS h_request_id,
    w.status AS h_status, w.attempts AS h_attempts, w.claimed_by AS h_claimed_by,
    w.claimed_at AS h_claimed_at, w.lease_seconds AS h_lease_seconds,
    w.heartbeat_at AS h_heartbeat_at, w.updated_at AS h_updated_at"""


def _outer(returning: str) -> str:
    """``returning`` (columns of ``w``) as the same columns of the CTE ``upd``."""
    return returning.replace("w.", "upd.")


#: A run's compute-lock outcomes, as the run's end sends them (:locks: JSON text or NULL).
_LOCKS = "CAST(:locks AS jsonb)"


# The rows come as one JSON text (:rows, built by EnqueueOps._enqueue_params): an array of
# [request_id, workspace_id, job_id, branch_path, stage, dedupe, input_hash, worker_class,
#  priority, max_attempts, max_crash_attempts, delay, input], the input as its canonical JSON.
# One parameter instead of thirteen arrays: psycopg dumps a list element by element in
# Python, which costs more than the statement itself. `json`,
# not `jsonb`, for the envelope: parsed, not normalised; each input becomes jsonb on its own.
ENQUEUE = Statement.write(
    "queue.enqueue",
    f"""
WITH n AS ({_NOW}),
items AS (
    SELECT e->>0 AS request_id, e->>1 AS workspace_id, e->>2 AS job_id, e->>3 AS branch_path,
           e->>4 AS stage, CAST(e->>5 AS boolean) AS dedupe, e->>6 AS input_hash,
           e->>7 AS worker_class, CAST(e->>8 AS integer) AS priority,
           CAST(e->>9 AS integer) AS max_attempts, CAST(e->>10 AS integer) AS max_crash_attempts,
           CAST(e->>11 AS float8) AS delay, CAST(e->12 AS jsonb) AS input
    FROM json_array_elements(CAST(:rows AS json)) AS e
),
ins AS (
    INSERT INTO {TABLE} AS w (
        request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
        worker_class, priority, max_attempts, max_crash_attempts,
        run_after, dispatched_at, created_at, updated_at, trace_context)
    SELECT i.request_id, i.workspace_id, i.job_id, i.branch_path, i.stage, i.dedupe, i.input,
           i.input_hash, i.worker_class, i.priority, i.max_attempts, i.max_crash_attempts,
           n.now + make_interval(secs => i.delay), n.now, n.now, n.now,
           CAST(:trace_context AS text)
    FROM items i, n
    ON CONFLICT (workspace_id, request_id) DO NOTHING
    RETURNING w.request_id, w.workspace_id, w.status, w.input_hash, w.worker_class, w.run_after
),
sig AS ({_notify("ins", "r.run_after <= n.now")})
-- Rows this statement inserted, then rows that already existed. The second SELECT reads
-- the statement's snapshot, so it never sees the rows of `ins`; a row committed by a
-- concurrent enqueue after the snapshot is found by ENQUEUE_LOOKUP in the caller. It probes
-- the table only for ids `ins` did not insert (a hashed NOT IN): a batch of new rows costs
-- no index lookups. The probe is a LATERAL
-- lookup by primary key with a LIMIT, which the planner cannot turn into a join: as a plain
-- join, the generic plan psycopg's prepared statement keeps from a small table hashed the
-- whole table on every enqueue, new rows too, until an ANALYZE re-planned it, so an
-- enqueue grew slower with the table.
SELECT request_id, workspace_id, true AS created, status, input_hash,
       CAST(NULL AS text) AS trace_context
FROM ins WHERE {_SENT}
UNION ALL
SELECT w.request_id, r.workspace_id, false AS created, w.status, w.input_hash, w.trace_context
FROM items r
CROSS JOIN LATERAL (
    SELECT o.request_id, o.status, o.input_hash, o.trace_context FROM {TABLE} o
    WHERE o.workspace_id = r.workspace_id AND o.request_id = r.request_id LIMIT 1
) w
-- The pair as one text (ids hold no control character): a NOT IN over one column is hashed.
WHERE r.workspace_id || chr(1) || r.request_id
      NOT IN (SELECT workspace_id || chr(1) || request_id FROM ins)
""",
)

# ENQUEUE for one row (Queue.enqueue, a batch or a hand-off of one): the row's values as
# parameters, no JSON envelope to unpack. The existing row is probed by its key only when
# nothing was inserted, so a new row never pays for the probe, under any plan.
# Its one possible NOTIFY is sent by the result row's own filter (`_notify_one`), not by a
# `sig` CTE: the CTE's aggregate over a DISTINCT cost about a tenth of the statement, and
# an `n` CTE is not needed either (now() is the transaction's start however often it is
# read). Its row is what the caller does not know: whether it inserted, the row's status,
# the stored input hash (its own when it inserted); not the key it sent.


ENQUEUE_ONE = Statement.write(
    "queue.enqueue_one",
    f"""
WITH ins AS (
    INSERT INTO {TABLE} AS w (
        request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash,
        worker_class, priority, max_attempts, max_crash_attempts,
        run_after, dispatched_at, created_at, updated_at, trace_context)
    VALUES (CAST(:request_id AS text), CAST(:workspace_id AS text), CAST(:job_id AS text),
            CAST(:branch_path AS text), CAST(:stage AS text), CAST(:dedupe AS boolean),
            CAST(:input AS jsonb), CAST(:input_hash AS text), CAST(:worker_class AS text),
            CAST(:priority AS integer), CAST(:max_attempts AS integer),
            CAST(:max_crash_attempts AS integer),
            {_NOW_EXPR} + make_interval(secs => CAST(:delay AS float8)),
            {_NOW_EXPR}, {_NOW_EXPR}, {_NOW_EXPR}, CAST(:trace_context AS text))
    ON CONFLICT (workspace_id, request_id) DO NOTHING
    RETURNING w.status, w.worker_class, w.run_after
)
SELECT true AS created, ins.status, CAST(:input_hash AS text) AS input_hash,
       CAST(NULL AS text) AS trace_context
FROM ins
WHERE {_notify_one("ins", f"ins.run_after <= {_NOW_EXPR}")}
UNION ALL
SELECT false AS created, o.status, o.input_hash, o.trace_context
FROM {TABLE} o
WHERE o.workspace_id = CAST(:workspace_id AS text) AND o.request_id = CAST(:request_id AS text)
  AND NOT EXISTS (SELECT FROM ins)
""",
)

ENQUEUE_LOOKUP = Statement.write(
    "queue.enqueue_lookup",
    f"""
SELECT w.request_id, w.workspace_id, false AS created, w.status, w.input_hash, w.created_at,
       w.trace_context
FROM {TABLE} w
JOIN unnest(CAST(:workspace_ids AS text[]), CAST(:request_ids AS text[])) AS k(workspace_id,
                                                                          request_id)
  ON w.workspace_id = k.workspace_id AND w.request_id = k.request_id
""",
)

# A claim's terms per stage: :terms is NULL or a JSON object {stage: [lease, max_runtime]}
# (max_runtime null for none). A row of a stage it names takes that stage's lease and run
# bound; any other row :lease_seconds and :max_runtime. (What an HTTP pull worker's claim
# of a worker class gets: the stage is known only once the row is picked.)
_STAGE_TERMS = "CAST(:terms AS jsonb) -> w.stage"
_LEASE = f"""(CASE WHEN {_STAGE_TERMS} IS NULL THEN CAST(:lease_seconds AS float8)
         ELSE CAST({_STAGE_TERMS} ->> 0 AS float8) END)"""
_RUNTIME = f"""(CASE WHEN {_STAGE_TERMS} IS NULL THEN CAST(:max_runtime AS float8)
         ELSE CAST({_STAGE_TERMS} ->> 1 AS float8) END)"""

# What a claim records beside its token, for fenced writes by (request_id, token) alone: its
# lease length and run deadline (claim time + the run bound; NULL for none), and no run
# ended yet (ended_run: see COMPLETE). Heartbeats never extend the lease past the deadline.
_CLAIM_SETS = f"""lease_seconds = {_LEASE},
    lease_expires_at = n.now + make_interval(secs => {_LEASE}),
    run_deadline = n.now + make_interval(secs => {_RUNTIME}),
    ended_run = NULL"""


# A running row whose lease ended at (or past) its run deadline: the run went past its
# max_runtime, not a crash. Never taken over by a claim (nor waited for as claimable): the
# sweeper records it as a failed attempt retried after the backoff (RESCUE_EXPIRED; the
# outcome table's rule, onceflow.lifecycle.outcome).
_OVERRAN = "(w.run_deadline IS NOT NULL AND w.lease_expires_at >= w.run_deadline)"


# Claim one request by id: queued and due, or running under a lease that lapsed (a crash,
# counted in crash_attempts) while attempts and the crash budget remain. One statement:
# a concurrent claimer blocks on the row lock, re-checks the WHERE and gets nothing.
@_by_key("queue.claim")
def CLAIM(ws: str) -> str:
    return f"""
WITH n AS ({_NOW_LAZY})
UPDATE {TABLE} AS w SET
    status = 'running',
    claim_token = :token,
    claimed_by = :worker_id,
    attempts = w.attempts + 1,
    crash_attempts = w.crash_attempts + CASE WHEN w.status = 'running' THEN 1 ELSE 0 END,
    heartbeat_at = n.now,
    claimed_at = n.now,
    {_CLAIM_SETS},
    updated_at = n.now
FROM n
WHERE {_by_id(ws)}
  AND (CAST(:stage AS text) IS NULL OR w.stage = :stage)
  AND (
        (w.status = 'queued' AND w.run_after <= n.now)
     OR (w.status = 'running' AND w.lease_expires_at <= n.now
         AND NOT w.cancel_requested
         AND w.attempts < w.max_attempts
         AND w.crash_attempts + 1 < w.max_crash_attempts
         AND NOT {_OVERRAN})
  )
-- The row as this statement's snapshot saw it (a statement never sees its own changes):
-- running means this claim took over a lapsed lease (metrics only). The trace context the
-- row was enqueued under: the run continues that trace.
RETURNING {RETURNING}, w.trace_context,
    (SELECT o.status = 'running' FROM {TABLE} o
     WHERE o.workspace_id = w.workspace_id AND o.request_id = w.request_id) AS took_over
"""


# Claim up to :limit requests of one worker class. Each candidate set is read through its
# own partial index (no OR across states, which defeats partial indexes); lapsed leases
# first, since they have waited longest. Tokens are minted by the caller (`secrets`, hex)
# and handed out by row number from one space-separated text (no array to dump).
# The candidates compare with the time as an expression (`_NOW_EXPR`), not the `n` CTE's
# column. With `n.now` the planner kept the index's order for ORDER BY … LIMIT and joined
# `n` inside the loop, so the comparison was a join filter: the lapsed scan read every
# running row of the class on ix_wpr_lease and dropped the live ones, and each claim cost
# O(requests in flight). On ix_wpr_lease (worker_class, lease_expires_at) the expression is a bound
# of the scan. On ix_wpr_claim (worker_class, priority DESC, run_after) it can only filter
# index entries (priority comes between): delayed rows of a higher priority than the first
# due one are still visited in the index, but not read from the heap. now() is the
# transaction's start, the same value as n.now.
# A worker scoped to some workspaces (a tenant's worker key or minted token) claims with
# IN_WORKSPACES added to both candidate sets, inside the SKIP LOCKED select: a row of
# another workspace is never locked, let alone claimed. The unscoped statement has nothing
# added. The limit is a literal (`claim_next_query`).
#: A row's workspace is one of :ws_exact or starts with one of :ws_prefixes (both lists).
IN_WORKSPACES = """(w.workspace_id = ANY(CAST(:ws_exact AS text[]))
           OR EXISTS (SELECT FROM unnest(CAST(:ws_prefixes AS text[])) AS p(prefix)
                      WHERE starts_with(w.workspace_id, p.prefix)))"""


def _claim_next(limit: int, scope: str) -> str:
    """CLAIM_NEXT of at most ``limit`` rows, ``scope`` added to both candidate sets."""
    return f"""
WITH n AS ({_NOW_LAZY}),
lapsed AS (
    SELECT w.workspace_id, w.request_id
    FROM {TABLE} w
    WHERE w.status = 'running'
      AND w.worker_class = :worker_class
      AND w.lease_expires_at <= {_NOW_EXPR}
      AND NOT w.cancel_requested
      AND w.attempts < w.max_attempts
      AND w.crash_attempts + 1 < w.max_crash_attempts
      AND NOT {_OVERRAN}{scope}
    ORDER BY w.lease_expires_at
    LIMIT {limit}
    FOR UPDATE OF w SKIP LOCKED
),
queued AS (
    SELECT w.workspace_id, w.request_id
    FROM {TABLE} w
    WHERE w.status = 'queued'
      AND w.worker_class = :worker_class
      AND w.run_after <= {_NOW_EXPR}{scope}
    ORDER BY w.priority DESC, w.run_after
    LIMIT {limit}
    FOR UPDATE OF w SKIP LOCKED
),
picked AS (
    SELECT workspace_id, request_id, took_over, row_number() OVER () AS rn
    FROM (SELECT workspace_id, request_id, true AS took_over FROM lapsed
          UNION ALL SELECT workspace_id, request_id, false FROM queued) AS u
    LIMIT {limit}
)
UPDATE {TABLE} AS w SET
    status = 'running',
    claim_token = split_part(CAST(:tokens AS text), ' ', CAST(picked.rn AS integer)),
    claimed_by = :worker_id,
    attempts = w.attempts + 1,
    crash_attempts = w.crash_attempts + CASE WHEN w.status = 'running' THEN 1 ELSE 0 END,
    heartbeat_at = n.now,
    claimed_at = n.now,
    {_CLAIM_SETS},
    updated_at = n.now
FROM picked, n
WHERE w.workspace_id = picked.workspace_id AND w.request_id = picked.request_id
RETURNING {RETURNING}, w.trace_context, picked.rn, picked.took_over
"""


@lru_cache(maxsize=64)
def claim_next_query(limit: int, scoped: bool = False) -> Statement:
    """CLAIM_NEXT of at most ``limit`` rows, as the statement ``queue.claim_next`` (``scoped``:
    ``queue.claim_next_scoped``, filtered by workspace, with :ws_exact and :ws_prefixes).

    ``limit`` is a literal: a bound LIMIT makes Postgres cost every generic plan at 10% of
    the rows, so it re-plans the claim on each call (about as long as running it); a literal
    lets the prepared statement keep one generic plan. ``limit`` is an int, checked by the
    caller.
    """
    if scoped:
        return Statement.write(
            "queue.claim_next_scoped", _claim_next(int(limit), f"\n      AND {IN_WORKSPACES}")
        )
    return Statement.write("queue.claim_next", _claim_next(int(limit), ""))


def claim_next_sql(limit: int, scoped: bool = False) -> str:
    """The psycopg SQL of :func:`claim_next_query`."""
    return claim_next_query(limit, scoped).sql


# :worker_classes (NULL for none) scopes a fenced write (and a read by reference) to a
# principal's worker classes (an HTTP worker key), and :ws_exact / :ws_prefixes (NULL for
# none) to its workspaces: a token of another class's or another workspace's request is
# fenced off like a wrong token.
_IN_SCOPE = f"""(CAST(:worker_classes AS text[]) IS NULL
       OR w.worker_class = ANY(CAST(:worker_classes AS text[])))
  AND (CAST(:ws_exact AS text[]) IS NULL
       OR {IN_WORKSPACES})"""


def _fence(ws: str) -> str:
    """A fenced write's condition: the row (``_by_id(ws)``) runs under :token's live lease."""
    return f"""
  {_by_id(ws)}
  AND w.claim_token = :token
  AND w.status = 'running'
  AND w.lease_expires_at > n.now
  AND {_IN_SCOPE}
"""


def _run_of(token: str) -> str:
    """The run id (RUN_ID) of the claim token ``token``, an SQL text expression."""
    return f"left(encode(sha256(convert_to({token}, 'UTF8')), 'hex'), 32)"


#: A run's public identity: a digest of its claim token (new at every claim, takeovers
#: included; the token itself never leaves the workers). The dashboard shows it and fences
#: its cancel on it (a running row's updated_at moves with every heartbeat).
RUN_ID = _run_of("w.claim_token")

# RUN_ID of the :token parameter (what a fenced write's retry compares with ended_run).
_RUN_OF_TOKEN = _run_of("CAST(:token AS text)")


def _released_run_of(token: str) -> str:
    """What a release records as ``ended_run`` for the claim token ``token``: a digest of the
    token under another name than its run id. A hand-back and a failure both leave the row
    queued (or cancelled): a retry of one must not take the other, by the same claim, for its
    own landed write. Tokens are hex (``new_claim_token``): no token starts with the prefix."""
    return _run_of(f"'release-' || {token}")


# Extends the lease by :lease_seconds when given (a Claim's; kept as the row's lease for
# later heartbeats), else by the row's own (a ClaimRef's heartbeat), else by
# :default_lease (a row claimed before migration 0006). Never past the run's deadline (the
# row's, else :deadline; NULL for none: least() ignores NULL): a hung body's heartbeats
# stop extending its lease, and the sweeper rescues it.
@_by_key("queue.heartbeat")
def HEARTBEAT(ws: str) -> str:
    return f"""
WITH n AS ({_NOW_LAZY})
UPDATE {TABLE} AS w SET
    lease_expires_at = least(
        n.now + make_interval(secs => coalesce(CAST(:lease_seconds AS float8), w.lease_seconds,
                                               CAST(:default_lease AS float8))),
        coalesce(w.run_deadline, CAST(:deadline AS timestamptz))),
    lease_seconds = coalesce(CAST(:lease_seconds AS float8), w.lease_seconds),
    heartbeat_at = n.now,
    updated_at = n.now
FROM n
WHERE {_fence(ws)}
RETURNING w.lease_expires_at, w.cancel_requested
"""


# Used by fenced writes of other layers (the op log) inside their own transaction: the row
# lock (FOR SHARE) holds off a concurrent rescue until that transaction commits.
@_by_key("queue.fence_check")
def FENCE_CHECK(ws: str) -> str:
    return f"""
WITH n AS ({_NOW})
SELECT w.request_id, w.workspace_id, w.job_id, w.stage FROM {TABLE} w, n
WHERE {_fence(ws)}
FOR SHARE OF w
"""


# A completion records its run in the history (`_history`): a hand-off when :handed_to (the
# follow-ups' ids, NULL for none) names any, with the run's lock outcomes (:locks).
_COMPLETED = """CASE WHEN cardinality(CAST(:handed_to AS text[])) > 0 THEN 'handed_off'
                ELSE 'succeeded' END"""


def _complete(ws: str, returning: str) -> str:
    """COMPLETE of the row ``_by_id(ws)``, returning the columns ``returning``."""
    return f"""
WITH n AS ({_NOW}),
upd AS (
UPDATE {TABLE} AS w SET
    status = 'succeeded',
    result = CAST(:result AS jsonb),
    ended_run = {RUN_ID},
    claim_token = NULL,
    lease_expires_at = NULL,
    finished_at = n.now,
    updated_at = n.now
FROM n
WHERE {_fence(ws)}
RETURNING {returning}, {_HISTORY_RETURNING}
),
hist AS ({_history("upd", _COMPLETED, handed_to="CAST(:handed_to AS text[])", locks=_LOCKS)})
SELECT {_outer(returning)} FROM upd
"""


COMPLETE = _by_key("queue.complete")(lambda ws: _complete(ws, RETURNING))

# COMPLETE for a caller that holds the claimed request (a Claim): only the columns its
# claim may not have seen come back (RUN_COLUMNS, with the workspace); the caller takes
# the rest from its Claim. The input alone can be 256 KiB of JSON, and decoding the 15
# columns that cannot change under a live claim (set at enqueue, or by a statement that
# ends the claim) again at every completion was a fifth of a completion's client CPU.
#: The columns of a claimed row that may differ from what its claim returned once it is
#: completed: the completion's own writes, a heartbeat's and a cancel's (which keep the
#: claim), and what the claim set (read back, not trusted to the caller's Claim).
RUN_COLUMNS = (
    "status", "result", "claimed_by", "lease_expires_at", "heartbeat_at", "claimed_at",
    "attempts", "crash_attempts", "cancel_requested", "updated_at", "finished_at",
)  # fmt: skip
_RUN_RETURNING = ", ".join(f"w.{c}" for c in RUN_COLUMNS)
COMPLETE_CHANGED = _by_key("queue.complete_changed")(
    lambda ws: _complete(ws, f"w.workspace_id, {_RUN_RETURNING}")
)

# COMPLETE for a caller that keeps nothing of the row (Queue.finish: a Celery stage, the
# Worker's hand-offs): what a run's metrics need (its class, stage, claim time and end time) and
# the workspace a hand-off's follow-ups are checked against; no result decoded back, no
# Request built from the row.
_FINISH_RETURNING = "w.workspace_id, w.worker_class, w.stage, w.claimed_at, w.updated_at"
FINISH = _by_key("queue.finish")(lambda ws: _complete(ws, _FINISH_RETURNING))


def _backoff(attempts: str) -> str:
    """The backoff of a failed run's retry before its jitter, an SQL expression: exponential
    in the attempt number ``attempts`` from :backoff_base, capped at :backoff_max (as
    Queue.backoff)."""
    return f"""least(CAST(:backoff_max AS float8),
          CAST(:backoff_base AS float8) * power(2, least(greatest({attempts} - 1, 0), 60)))"""


# The next status of a failed run: cancelled if cancel was requested, queued again if
# retryable with attempts left (or its attempt given back: :uncounted), else dead. The
# error is always kept. Queued again after :delay seconds, or (NULL) after the backoff of
# the row's attempt number: exponential from :backoff_base, capped at :backoff_max, with
# equal jitter (as Queue.backoff).
@_by_key("queue.fail")
def FAIL(ws: str) -> str:
    return f"""
WITH n AS ({_NOW}),
nxt AS (
    SELECT CASE
        WHEN w.cancel_requested THEN 'cancelled'
        WHEN :retryable AND (w.attempts < w.max_attempts OR CAST(:uncounted AS boolean))
            THEN 'queued'
        ELSE 'dead'
    END AS status,
    {_backoff("w.attempts")}
        AS backoff,
    w.attempts
    FROM {TABLE} w WHERE {_by_id(ws)}
    FOR UPDATE OF w
),
upd AS (
UPDATE {TABLE} AS w SET
    status = nxt.status,
    -- A retry that gives its attempt back (a budget wait), as RELEASE does.
    attempts = w.attempts - CASE WHEN CAST(:uncounted AS boolean) AND nxt.status = 'queued'
                                 THEN 1 ELSE 0 END,
    run_after = CASE WHEN nxt.status = 'queued'
                     THEN n.now + make_interval(secs => coalesce(CAST(:delay AS float8),
                                                nxt.backoff / 2 + random() * nxt.backoff / 2))
                     ELSE w.run_after END,
    error = CAST(:error AS jsonb),
    ended_run = {RUN_ID},
    claim_token = NULL,
    lease_expires_at = NULL,
    dispatched_at = NULL,
    finished_at = CASE WHEN nxt.status = 'queued' THEN NULL ELSE n.now END,
    updated_at = n.now
FROM n, nxt
WHERE {_fence(ws)}
RETURNING {RETURNING}, {_HISTORY_RETURNING}, nxt.attempts AS h_attempt
),
hist AS ({_history("upd", "'failed'", attempt="r.h_attempt", error="r.error", locks=_LOCKS)})
SELECT {_outer(RETURNING)} FROM upd, n
WHERE {_notify_one("upd", "upd.status = 'queued' AND upd.run_after <= n.now")}
"""


# A cancel is recorded in the history (no claim of it ends: a running run is asked to stop,
# and its own end records it).
_CANCELLED = "CASE WHEN r.h_status = 'cancelled' THEN 'cancelled' ELSE 'cancel_requested' END"


@_by_key("queue.cancel")
def CANCEL(ws: str) -> str:
    return f"""
WITH n AS ({_NOW}),
upd AS (
UPDATE {TABLE} AS w SET
    cancel_requested = true,
    status = CASE WHEN w.status = 'queued' THEN 'cancelled' ELSE w.status END,
    finished_at = CASE WHEN w.status = 'queued' THEN n.now ELSE w.finished_at END,
    updated_at = n.now
FROM n
WHERE {_by_id(ws)}
  -- a running row asked to stop already is no new transition: left as it is
  AND (w.status = 'queued' OR (w.status = 'running' AND NOT w.cancel_requested))
  -- fenced (an operator's cancel): only the row / the run as the operator saw it
  AND (CAST(:expect AS timestamptz) IS NULL OR w.updated_at = CAST(:expect AS timestamptz))
  AND (CAST(:expect_run AS text) IS NULL
       OR (w.status = 'running' AND {RUN_ID} = CAST(:expect_run AS text)))
RETURNING {RETURNING}, {_HISTORY_RETURNING}
),
hist AS ({_history("upd", _CANCELLED, claimless="")})
SELECT {_outer(RETURNING)} FROM upd
"""


# The SET list is alike only by shape to keyword calls elsewhere (StageSpec, NewRequest).
@_by_key("queue.requeue")
def REQUEUE(ws: str) -> str:
    return f"""
WITH n AS ({_NOW}),
upd AS (
UPDATE {TABLE} AS w SET
    status = 'queued',
    attempts = 0,
    crash_attempts = 0,
    cancel_requested = false,
    run_after = n.now,
    result = NULL,
    error = NULL,
    claimed_by = NULL,
    heartbeat_at = NULL,
    claimed_at = NULL,
    ended_run = NULL,
    finished_at = NULL,
    dispatched_at = n.now,
    updated_at = n.now
FROM n
WHERE {_by_id(ws)} AND w.status IN ('succeeded', 'dead', 'cancelled')
  -- fenced (an operator's requeue): only the dead/cancelled row as the operator saw it
  AND (CAST(:expect AS timestamptz) IS NULL
       OR (w.status IN ('dead', 'cancelled') AND w.updated_at = CAST(:expect AS timestamptz)))
RETURNING {RETURNING}, {_HISTORY_RETURNING}
),
hist AS ({_history("upd", "'requeued'", claimless="")})
SELECT {_outer(RETURNING)} FROM upd WHERE {_notify_one("upd", "true")}
"""


# For Queue.wait_for_work: seconds (database clock) until the next request of these worker
# classes may be claimable — the earliest run_after of a queued row (<= 0: due now), or the
# earliest lapse of a claimable running row's lease; NULL when none is known. Per class, each
# minimum is read at the front of its partial index, not over the class's rows (a wait cost
# O(queued + in flight) otherwise):
# the lease's as the first claimable row of ix_wpr_lease (worker_class, lease_expires_at);
# the due time's by a loose scan of ix_wpr_claim (worker_class, priority DESC, run_after),
# the first row of each priority in turn: one index probe per distinct priority of the
# class's queued rows (per partition, on a partitioned table).
# NEXT_WORK_SCOPED: the same for a waiter scoped to some workspaces (IN_WORKSPACES in each
# probe): work of other workspaces neither wakes it nor counts as due for it.


def _next_work(scope: str) -> str:
    """NEXT_WORK, ``scope`` added to each probe."""
    return f"""
WITH RECURSIVE n AS (SELECT now() AS now),
c AS (SELECT DISTINCT unnest(CAST(:worker_classes AS text[])) AS wc),
due AS (
    SELECT c.wc, f.priority, f.run_after FROM c, LATERAL (
        SELECT w.priority, w.run_after FROM {TABLE} w
        WHERE w.status = 'queued' AND w.worker_class = c.wc{scope}
        ORDER BY w.priority DESC, w.run_after LIMIT 1) f
    UNION ALL
    SELECT due.wc, f.priority, f.run_after FROM due, LATERAL (
        SELECT w.priority, w.run_after FROM {TABLE} w
        WHERE w.status = 'queued' AND w.worker_class = due.wc AND w.priority < due.priority{scope}
        ORDER BY w.priority DESC, w.run_after LIMIT 1) f
)
SELECT CAST(EXTRACT(EPOCH FROM least(
    (SELECT min(run_after) FROM due),
    (SELECT min(l.lease_expires_at) FROM c, LATERAL (
        SELECT w.lease_expires_at FROM {TABLE} w
        WHERE w.status = 'running' AND w.worker_class = c.wc
          AND NOT w.cancel_requested
          AND w.attempts < w.max_attempts
          AND w.crash_attempts + 1 < w.max_crash_attempts
          AND NOT {_OVERRAN}{scope}
        ORDER BY w.lease_expires_at LIMIT 1) l)
) - n.now) AS float8) AS next_in
FROM n
"""


NEXT_WORK = Statement.write("queue.next_work", _next_work(""))
NEXT_WORK_SCOPED = Statement.write(
    "queue.next_work_scoped", _next_work(f"\n          AND {IN_WORKSPACES}")
)

# For the API's line of long-poll claimers (onceflow.queue.claim_line): how many requests of
# one worker class are claimable now, per workspace — what CLAIM_NEXT would take (queued and
# due, or running under a lapsed lease within its budgets), at most :limit of each kind.
# Rows a concurrent claim holds locked are counted (a woken waiter may then find nothing).
CLAIMABLE = Statement.write(
    "queue.claimable",
    f"""
WITH q AS (
    SELECT w.workspace_id FROM {TABLE} w
    WHERE w.status = 'queued' AND w.worker_class = :worker_class AND w.run_after <= now()
    LIMIT :limit
),
l AS (
    SELECT w.workspace_id FROM {TABLE} w
    WHERE w.status = 'running' AND w.worker_class = :worker_class
      AND w.lease_expires_at <= now()
      AND NOT w.cancel_requested
      AND w.attempts < w.max_attempts
      AND w.crash_attempts + 1 < w.max_crash_attempts
      AND NOT {_OVERRAN}
    LIMIT :limit
)
SELECT u.workspace_id, count(*) AS n FROM (SELECT * FROM q UNION ALL SELECT * FROM l) AS u
GROUP BY u.workspace_id
""",
)

GET = _by_key("queue.get")(lambda ws: f"SELECT {RETURNING} FROM {TABLE} w WHERE {_by_id(ws)}")


# (The statements by key below are alike by shape; each is its own, with its own plan.)
# A wait marks the row it waits for (its end then sends NOTIFY onceflow_done, migration
# 0010) and reads it in the same statement: RETURNING shows the row as locked, so an end
# committed before the mark is read here and one committed after it sees the mark.
@_by_key("queue.wait_mark")
def WAIT_MARK(ws: str) -> str:
    return f"""
UPDATE {TABLE} w SET waited = true
WHERE {_by_id(ws)} AND NOT w.waited AND w.status NOT IN ('succeeded', 'dead', 'cancelled')
RETURNING {RETURNING}
"""


# A live claim: the row runs under this token and its lease has not lapsed (DB clock).
@_by_key("queue.live_claim")
def LIVE_CLAIM(ws: str) -> str:
    return f"""
WITH n AS ({_NOW})
SELECT {RETURNING} FROM {TABLE} w, n
WHERE {_fence(ws)}
"""


# A claim whose answer was lost: the row already runs under our token.
@_by_key("queue.own_claim")
def OWN_CLAIM(ws: str) -> str:
    return f"""
SELECT {RETURNING}, w.trace_context FROM {TABLE} w
WHERE {_by_id(ws)} AND w.claim_token = :token AND w.status = 'running'
"""


# A fenced write whose answer was lost (LeaseLost on its retry): the row, if the run of
# :token ended it (ended_run) with one of :statuses. A later claim, a requeue or a rescue
# of a run that never ended would have left ended_run NULL or another run's. Within the
# reference's worker classes: a key of another class holding the token learns nothing.
@_by_key("queue.landed")
def LANDED(ws: str) -> str:
    return f"""
SELECT {RETURNING} FROM {TABLE} w
WHERE {_by_id(ws)}
  AND w.ended_run = {_RUN_OF_TOKEN}
  AND w.status = ANY(CAST(:statuses AS text[]))
  AND {_IN_SCOPE}
"""


# The request a hand-off's follow-ups are named after: under :token's live claim (the
# fence), or completed by :token's run (a retried hand-off whose answer was lost, which
# the hand-off then recognises as landed). One statement: no window between the two reads.
@_by_key("queue.claim_parent")
def CLAIM_PARENT(ws: str) -> str:
    return f"""
WITH n AS ({_NOW})
SELECT {RETURNING} FROM {TABLE} w, n
WHERE {_by_id(ws)}
  AND {_IN_SCOPE}
  AND ((w.claim_token = :token AND w.status = 'running' AND w.lease_expires_at > n.now)
       OR (w.ended_run = {_RUN_OF_TOKEN} AND w.status = 'succeeded'))
"""


COUNTS = Statement.write(
    "queue.counts",
    f"""
SELECT w.status, w.worker_class, count(*) AS n
FROM {TABLE} w
GROUP BY w.status, w.worker_class
ORDER BY w.worker_class, w.status
""",
)

# Rows of the sweeping Flow's stages only (a Flow can send wake-ups for no others);
# NULL (a bare Queue's sweep) means every stage.
_STAGES = "(CAST(:stages AS text[]) IS NULL OR w.stage = ANY(CAST(:stages AS text[])))"

#: Re-sends of one wake-up back off: the k-th waits redispatch_after * 2^min(k, this).
REDISPATCH_MAX_DOUBLINGS = 5

# A wake-up sent (dispatched_at) longer ago than its backoff, without a claim since.
_STALE = f"""w.dispatched_at <= n.now - make_interval(secs => CAST(:redispatch_after AS float8)
    * power(2, least(w.redispatch_count, {REDISPATCH_MAX_DOUBLINGS})))"""

# Lapsed leases, in one compare-and-set statement (never read-then-update): each row is
# requeued, or quarantined as dead past its attempts or crash budget, or cancelled if that
# was requested. Only rows whose *current* lease lapsed are touched. The next status is read
# from the row as locked (FOR UPDATE re-reads a row changed since the statement's snapshot),
# never from another scan of the table: a cancel committed after the statement began,
# before this row was locked, is seen. A requeued row gets a
# fresh wake-up from the sweeper (its re-send count starts again). A run whose lease ended
# at its run deadline (_OVERRAN) is no crash: it is failed as the outcome table fails a run
# past max_runtime — :overran_error kept, queued again after the backoff of its attempt
# (as FAIL's) or dead at max_attempts, crash_attempts unchanged; its retry's wake-up is
# sent once due.
RESCUE_EXPIRED = Statement.write(
    "queue.rescue_expired",
    f"""
WITH n AS ({_NOW}),
nxt AS (
    SELECT w.workspace_id, w.request_id, w.attempts, o.overran, CASE
        WHEN w.cancel_requested THEN 'cancelled'
        WHEN o.overran THEN CASE WHEN w.attempts < w.max_attempts THEN 'queued' ELSE 'dead' END
        WHEN w.crash_attempts + 1 >= w.max_crash_attempts OR w.attempts >= w.max_attempts
            THEN 'dead'
        ELSE 'queued'
    END AS status
    FROM {TABLE} w, n, LATERAL (SELECT {_OVERRAN} AS overran) o
    WHERE w.status = 'running' AND w.lease_expires_at <= n.now
      AND {_STAGES}
      AND (CAST(:worker_classes AS text[]) IS NULL
           OR w.worker_class = ANY(CAST(:worker_classes AS text[])))
    ORDER BY w.lease_expires_at
    LIMIT :limit
    FOR UPDATE OF w SKIP LOCKED
),
upd AS (
UPDATE {TABLE} AS w SET
    status = nxt.status,
    crash_attempts = w.crash_attempts + CASE WHEN nxt.overran THEN 0 ELSE 1 END,
    claim_token = NULL,
    lease_expires_at = NULL,
    run_after = CASE WHEN nxt.status <> 'queued' THEN w.run_after
                     WHEN nxt.overran THEN n.now + make_interval(secs => b.backoff / 2
                                                                 + random() * b.backoff / 2)
                     ELSE n.now END,
    -- An overrun's retry is sent once due, as a failure's (dispatched_at NULL).
    dispatched_at = CASE WHEN nxt.status <> 'queued' THEN w.dispatched_at
                         WHEN nxt.overran THEN NULL ELSE n.now END,
    redispatch_count = CASE WHEN nxt.status = 'queued' THEN 0 ELSE w.redispatch_count END,
    finished_at = CASE WHEN nxt.status = 'queued' THEN NULL ELSE n.now END,
    error = CASE WHEN nxt.overran THEN CAST(:overran_error AS jsonb)
                 WHEN nxt.status = 'dead' THEN jsonb_build_object(
        'type', 'LeaseLapsed',
        'message', 'lease lapsed without completion ' || (w.crash_attempts + 1)
                   || ' time(s); attempts ' || w.attempts || '/' || w.max_attempts
                   || ', crash budget ' || w.max_crash_attempts,
        'previous', w.error) ELSE w.error END,
    updated_at = n.now
FROM nxt, n, LATERAL (SELECT {_backoff("nxt.attempts")} AS backoff) b
WHERE w.workspace_id = nxt.workspace_id AND w.request_id = nxt.request_id
RETURNING w.request_id, w.workspace_id, w.status, w.stage, w.worker_class, nxt.overran,
    w.run_after, w.attempts, w.crash_attempts, w.trace_context, w.error, {_HISTORY_RETURNING}
),
hist AS ({
        _history(
            "upd",
            "CASE WHEN r.overran THEN 'overran' ELSE 'rescued' END",
            error="CASE WHEN r.overran OR r.status = 'dead' THEN r.error END",
        )
    }),
sig AS ({_notify("upd", "r.status = 'queued' AND r.run_after <= n.now")})
SELECT upd.request_id, upd.workspace_id, upd.status, upd.stage, upd.worker_class, upd.overran,
    upd.run_after, upd.attempts, upd.crash_attempts, upd.trace_context
FROM upd WHERE {_SENT}
""",
)


def _wake_ups(name: str, which: str, order: str, count: str) -> Statement:
    """A statement of wake-ups: up to :limit queued, due rows of the sweeping Flow's stages
    that match ``which``, in ``order``, marked dispatched now with the re-send count
    ``count`` and returned; their classes' NOTIFYs are sent."""
    return Statement.write(
        name,
        f"""
WITH n AS ({_NOW}),
due AS (
    SELECT w.workspace_id, w.request_id
    FROM {TABLE} w, n
    WHERE w.status = 'queued'
      AND w.run_after <= n.now
      AND {which}
      AND {_STAGES}
    ORDER BY {order}
    LIMIT :limit
    FOR UPDATE OF w SKIP LOCKED
),
upd AS (
UPDATE {TABLE} AS w SET dispatched_at = n.now, redispatch_count = {count}
FROM due, n
WHERE w.workspace_id = due.workspace_id AND w.request_id = due.request_id
RETURNING w.request_id, w.workspace_id, w.stage, w.worker_class, w.trace_context
),
sig AS ({_notify("upd", "true")})
SELECT * FROM upd WHERE {_SENT}
""",
    )


# Queued, due rows that never had a wake-up (a send that failed, a retry that became due):
# always sent. Marked dispatched in the same statement, so two sweepers never both send one.
DUE_UNSENT = _wake_ups("queue.due_unsent", "w.dispatched_at IS NULL", "w.run_after", "0")

# Per worker class: queued, due rows, those of them whose wake-up is stale (past its
# backoff), and those never sent. The sweeper compares the first with the broker's queue
# length: a row merely waiting behind a backlog still has its message in the queue, and a
# never-sent row has none without any having been lost.
DUE_COUNTS = Statement.write(
    "queue.due_counts",
    f"""
WITH n AS ({_NOW})
SELECT w.worker_class, count(*) AS due, count(*) FILTER (WHERE {_STALE}) AS stale,
       count(*) FILTER (WHERE w.dispatched_at IS NULL) AS unsent
FROM {TABLE} w, n
WHERE w.status = 'queued' AND w.run_after <= n.now AND {_STAGES}
GROUP BY w.worker_class
""",
)

# Up to :limit rows (of one worker class, or of all with NULL) whose wake-up is stale, the
# longest-waiting first, re-sent: marked dispatched again with one more re-send counted.
DUE_FOR_DISPATCH = _wake_ups(
    "queue.due_for_dispatch",
    f"""{_STALE}
      AND (CAST(:worker_class AS text) IS NULL OR w.worker_class = :worker_class)""",
    "w.dispatched_at",
    "w.redispatch_count + 1",
)

# A sweep begins with a compare-and-set on its Flow's row, by the database clock only: it
# wins if the last sweep began at least :min_gap seconds ago (or the row is missing, or
# stamped implausibly far in the future). A concurrent contender waits on the row lock and
# re-checks, so one wins. `next_in`: seconds until a contender with this gap could win.
BEGIN_SWEEP = Statement.write(
    "queue.begin_sweep",
    """
WITH n AS (SELECT now() AS now),
won AS (
    INSERT INTO onceflow_sweeps AS s (name, swept_at, swept_by)
    SELECT :name, n.now, :swept_by FROM n
    ON CONFLICT (name) DO UPDATE SET swept_at = EXCLUDED.swept_at, swept_by = EXCLUDED.swept_by
    WHERE s.swept_at <= EXCLUDED.swept_at - make_interval(secs => CAST(:min_gap AS float8))
       OR s.swept_at > EXCLUDED.swept_at + interval '1 minute'
    RETURNING s.swept_at
)
SELECT EXISTS (SELECT 1 FROM won) AS won,
       EXTRACT(EPOCH FROM coalesce(
           (SELECT swept_at FROM won),
           (SELECT swept_at FROM onceflow_sweeps WHERE name = :name), n.now)
         + make_interval(secs => CAST(:min_gap AS float8)) - n.now) AS next_in
FROM n
""",
)

# Retention, in two steps. Succeeded rows first lose their payloads but keep their key,
# status and input_hash: a tombstone that still collapses duplicates (and still detects an
# input mismatch). After the dedup window, succeeded and cancelled rows are deleted. Dead
# rows are never deleted: their error is what an operator needs.
PRUNE_PAYLOADS = Statement.write(
    "queue.prune_payloads",
    f"""
WITH n AS ({_NOW}),
old AS (
    SELECT w.workspace_id, w.request_id
    FROM {TABLE} w, n
    WHERE w.finished_at <= n.now - make_interval(secs => :age)
      AND w.status = 'succeeded'
      AND (w.input <> 'null'::jsonb OR w.result IS NOT NULL)
    LIMIT :limit
    FOR UPDATE OF w SKIP LOCKED
)
UPDATE {TABLE} AS w SET input = 'null'::jsonb, result = NULL, updated_at = n.now
FROM old, n
WHERE w.workspace_id = old.workspace_id AND w.request_id = old.request_id
""",
)

DELETE_FINISHED = Statement.write(
    "queue.delete_finished",
    f"""
WITH n AS ({_NOW}),
old AS (
    SELECT w.workspace_id, w.request_id
    FROM {TABLE} w, n
    WHERE w.finished_at <= n.now - make_interval(secs => :age)
      AND w.status IN ('succeeded', 'cancelled')
    LIMIT :limit
    FOR UPDATE OF w SKIP LOCKED
),
-- with its history: the requests' rows are locked (FOR UPDATE), no end can add to it now
hist AS (
    DELETE FROM {ATTEMPTS} AS a USING old
    WHERE a.workspace_id = old.workspace_id AND a.request_id = old.request_id
)
DELETE FROM {TABLE} AS w USING old
WHERE w.workspace_id = old.workspace_id AND w.request_id = old.request_id
""",
)

MARK_UNDISPATCHED_MANY = Statement.write(
    "queue.mark_undispatched_many",
    f"""
UPDATE {TABLE} AS w SET dispatched_at = NULL
FROM unnest(CAST(:workspace_ids AS text[]), CAST(:request_ids AS text[])) AS k(workspace_id,
                                                                          request_id)
WHERE w.workspace_id = k.workspace_id AND w.request_id = k.request_id AND w.status = 'queued'
""",
)


@_by_key("queue.mark_undispatched")
def MARK_UNDISPATCHED(ws: str) -> str:
    return f"""
UPDATE {TABLE} AS w SET dispatched_at = NULL
WHERE {_by_id(ws)} AND w.status = 'queued'
"""


# ======================================================================= batches (BatchOps)
# Statements of onceflow/queue/batch.py: fenced writes of many claims in one round trip, a
# release, and a cheap depth. Each fenced batch joins unnest(ids, tokens, …) to the table
# and applies the same per-row fence as _FENCE: a row whose fence fails is simply not
# updated (and not returned); the caller reports it as LeaseLost. Rows are locked in id
# order first (`locked`): the same worker's heartbeat and completion batches both hold the
# rows' live tokens, and without one lock order they could deadlock. The sweeper and
# claimers lock with SKIP LOCKED.

# A batch row's workspace: the claim's (t.ws), else (a reference by id alone) the row's.
_WS_OF_ROW = f"""coalesce(t.ws, ({_ws_of_id("t.request_id")}))"""


def _batch_rows(arrays: str = "", columns: str = "") -> str:
    """The CTEs of a fenced batch: ``i``, its rows (ids, tokens, the arrays ``arrays`` as
    ``columns``, each row with its workspace), and ``locked``, their rows locked in order."""
    return f"""i AS (
    SELECT {_WS_OF_ROW} AS workspace_id, t.* FROM unnest(
        CAST(:request_ids AS text[]), CAST(:tokens AS text[]),{arrays}
        CAST(:workspace_ids AS text[])) AS t(request_id, token, {columns}ws)
),
locked AS (
    -- Row locks in one order (by key) for every batch: two batches on the same rows (a
    -- worker's heartbeats and its completions) queue up instead of deadlocking.
    SELECT w.workspace_id, w.request_id FROM {TABLE} w JOIN i USING (workspace_id, request_id)
    ORDER BY w.workspace_id, w.request_id
    FOR NO KEY UPDATE OF w
)"""


_BATCH_FENCE = """
  w.workspace_id = i.workspace_id
  AND w.request_id = i.request_id
  AND w.claim_token = i.token
  AND w.status = 'running'
  AND w.lease_expires_at > n.now
"""


def _notify_after(rows: str) -> str:
    """A CTE ``notified`` sending one NOTIFY per worker class that ``rows`` made claimable now.

    ``rows`` is a data-modifying CTE returning ``status``, ``run_after`` and ``worker_class``;
    the final SELECT must reference ``notified`` (a plain CTE runs only when referenced).
    Guarded by the bound boolean ``:notify``. NOTIFY is delivered at commit.
    """
    return f"""notified AS (
    SELECT count(pg_notify('onceflow_work', d.c)) AS sent
    FROM (SELECT DISTINCT r.worker_class AS c FROM {rows} r, n
          WHERE CAST(:notify AS boolean) AND r.status = 'queued' AND r.run_after <= n.now) AS d
)"""


_COMPLETE_ROWS = _batch_rows(
    " CAST(:results AS jsonb[]), CAST(:locks AS jsonb[]),", "result, locks, "
)
COMPLETE_MANY = Statement.write(
    "queue.complete_many",
    f"""
WITH n AS ({_NOW}),
{_COMPLETE_ROWS},
upd AS (
UPDATE {TABLE} AS w SET
    status = 'succeeded',
    result = i.result,
    ended_run = {RUN_ID},
    claim_token = NULL,
    lease_expires_at = NULL,
    finished_at = n.now,
    updated_at = n.now
FROM i JOIN locked USING (workspace_id, request_id), n
WHERE {_BATCH_FENCE}
RETURNING w.workspace_id, w.request_id, {_RUN_RETURNING}, {_HISTORY_RETURNING},
    i.locks AS h_locks
),
hist AS ({_history("upd", "'succeeded'", locks="r.h_locks")})
SELECT upd.workspace_id, upd.request_id, {_outer(_RUN_RETURNING)} FROM upd
""",
    binary=("request_ids", "tokens", "results", "workspace_ids"),
)
# complete_many takes Claims only, which hold the claimed rows: like COMPLETE_CHANGED, it
# reads back the key and what a run changes (RUN_COLUMNS), not the input again.

# FAIL's next-status rule, per row (:retryables[i], :delays[i], :uncounted[i]).
_FAIL_NEXT = """CASE
        WHEN w.cancel_requested THEN 'cancelled'
        WHEN i.retryable AND (w.attempts < w.max_attempts OR i.uncounted) THEN 'queued'
        ELSE 'dead'
    END"""

_FAIL_ROWS = _batch_rows(
    " CAST(:errors AS jsonb[]),"
    "\n        CAST(:retryables AS boolean[]), CAST(:delays AS float8[]),"
    " CAST(:uncounted AS boolean[]), CAST(:locks AS jsonb[]),",
    "error, retryable, delay, uncounted, locks, ",
)
FAIL_MANY = Statement.write(
    "queue.fail_many",
    f"""
WITH n AS ({_NOW}),
{_FAIL_ROWS},
upd AS (
    UPDATE {TABLE} AS w SET
        status = {_FAIL_NEXT},
        attempts = w.attempts - CASE WHEN i.uncounted AND {_FAIL_NEXT} = 'queued'
                                     THEN 1 ELSE 0 END,
        run_after = CASE WHEN {_FAIL_NEXT} = 'queued'
                         THEN n.now + make_interval(secs => i.delay) ELSE w.run_after END,
        error = i.error,
        ended_run = {RUN_ID},
        claim_token = NULL,
        lease_expires_at = NULL,
        dispatched_at = NULL,
        finished_at = CASE WHEN {_FAIL_NEXT} = 'queued' THEN NULL ELSE n.now END,
        updated_at = n.now
    FROM i JOIN locked USING (workspace_id, request_id), n
    WHERE {_BATCH_FENCE}
    RETURNING {RETURNING}, {_HISTORY_RETURNING},
        w.attempts + CASE WHEN i.uncounted AND w.status = 'queued' THEN 1 ELSE 0 END
            AS h_attempt,
        i.locks AS h_locks
),
hist AS ({_history("upd", "'failed'", attempt="r.h_attempt", error="r.error", locks="r.h_locks")}),
{_notify_after("upd")}
SELECT {_outer(RETURNING)} FROM upd, notified
""",
)

# Never past each claim's run deadline (as HEARTBEAT).
_HEARTBEAT_ROWS = _batch_rows(
    "\n        CAST(:lease_seconds AS float8[]), CAST(:deadlines AS timestamptz[]),",
    "lease_seconds, deadline, ",
)
HEARTBEAT_MANY = Statement.write(
    "queue.heartbeat_many",
    f"""
WITH n AS ({_NOW_LAZY}),
{_HEARTBEAT_ROWS}
UPDATE {TABLE} AS w SET
    lease_expires_at = least(n.now + make_interval(secs => i.lease_seconds), i.deadline),
    heartbeat_at = n.now,
    updated_at = n.now
FROM i JOIN locked USING (workspace_id, request_id), n
WHERE {_BATCH_FENCE}
RETURNING w.request_id, w.workspace_id, w.lease_expires_at, w.cancel_requested
""",
)

# Hand back claims whose work has not started: the row is as if never claimed — queued, due
# at once (run_after kept, so it keeps its place in line), the claim's attempt uncounted, no
# claimant, lease or heartbeat, and no wake-up recorded (dispatched_at NULL, re-send count 0:
# a Celery deployment's sweeper sends a fresh one). crash_attempts is kept: a claim taken
# from a lapsed lease counted the *previous* holder's crash, which did happen (see
# BatchOps.release). Cancelled instead if cancel was requested: that move is recorded in the
# history as a cancel is (no claim of it ended: the claim is undone). The release is recorded
# in ended_run (_released_run_of its token): a retry whose answer was lost recognises it there.
RELEASE = Statement.write(
    "queue.release",
    f"""
WITH n AS ({_NOW}),
{_batch_rows()},
upd AS (
    UPDATE {TABLE} AS w SET
        status = CASE WHEN w.cancel_requested THEN 'cancelled' ELSE 'queued' END,
        run_after = least(w.run_after, n.now),
        attempts = greatest(w.attempts - 1, 0),
        ended_run = {_released_run_of("w.claim_token")},
        claim_token = NULL,
        lease_expires_at = NULL,
        claimed_by = NULL,
        heartbeat_at = NULL,
        claimed_at = NULL,
        dispatched_at = NULL,
        redispatch_count = 0,
        finished_at = CASE WHEN w.cancel_requested THEN n.now ELSE NULL END,
        updated_at = n.now
    FROM i JOIN locked USING (workspace_id, request_id), n
    WHERE {_BATCH_FENCE}
    RETURNING {RETURNING}, {_HISTORY_RETURNING}
),
cancelled AS (SELECT * FROM upd WHERE upd.h_status = 'cancelled'),
hist AS ({_history("cancelled", "'cancelled'", claimless="")}),
{_notify_after("upd")}
SELECT {_outer(RETURNING)} FROM upd, notified
""",
)

# A batch form of LANDED: of the rows of the batch refused by their fence, those that each
# claim's own write ended (its token's ended_run) with one of :statuses — the batch's lost
# answer, or a caller's repeat of a batch whose answer it lost. Never by claimant and counts:
# an operator's requeue resets the counts and a worker id is stable, so a later run can end
# the row with the same ones. RELEASED_MANY: the same for a release (see _released_run_of).


def _landed_many(name: str, ended: str) -> Statement:
    """LANDED_MANY of the rows whose ``ended_run`` is ``ended`` of each claim's token."""
    return Statement.write(
        name,
        f"""
SELECT {RETURNING} FROM {TABLE} w
JOIN unnest(CAST(:workspace_ids AS text[]), CAST(:request_ids AS text[]),
            CAST(:tokens AS text[])) AS k(workspace_id, request_id, token)
  ON w.workspace_id = k.workspace_id AND w.request_id = k.request_id
WHERE w.ended_run = {ended}
  AND w.status = ANY(CAST(:statuses AS text[]))
""",
    )


LANDED_MANY = _landed_many("queue.landed_many", _run_of("k.token"))
RELEASED_MANY = _landed_many("queue.released_many", _released_run_of("k.token"))

# Live depth per worker class, read only through the partial indexes ix_wpr_claim
# (status = 'queued': worker_class, priority, run_after) and ix_wpr_lease (status =
# 'running': worker_class, lease_expires_at): both hold every column used, so Postgres reads
# them with index-only scans (EXPLAIN in bench/batch_bench.py) and the cost is proportional
# to the live backlog, never to the finished rows of the table's history. No OR across
# states (it defeats partial indexes): one branch per index. ``classes`` is "" for every
# class, or a filter on :worker_classes.


def _depth(name: str, classes: str) -> Statement:
    """The live depth per worker class, ``classes`` added to each branch."""
    return Statement.write(
        name,
        f"""
WITH n AS ({_NOW}),
live AS (
    SELECT w.worker_class,
           count(*) FILTER (WHERE w.run_after <= n.now) AS queued_due,
           count(*) FILTER (WHERE w.run_after > n.now) AS queued_later,
           0::bigint AS running,
           min(w.run_after) FILTER (WHERE w.run_after <= n.now) AS oldest_due
    FROM {TABLE} w, n
    WHERE w.status = 'queued'{classes}
    GROUP BY w.worker_class
    UNION ALL
    SELECT w.worker_class, 0, 0, count(*), NULL
    FROM {TABLE} w
    WHERE w.status = 'running'{classes}
    GROUP BY w.worker_class
)
SELECT l.worker_class, sum(l.queued_due)::bigint AS queued_due,
       sum(l.queued_later)::bigint AS queued_later, sum(l.running)::bigint AS running,
       EXTRACT(EPOCH FROM n.now - min(l.oldest_due))::float8 AS oldest_due_age
FROM live l, n
GROUP BY l.worker_class, n.now
""",
    )


DEPTH_ALL = _depth("queue.depth_all", "")
DEPTH_FOR = _depth(
    "queue.depth_for", "\n      AND w.worker_class = ANY(CAST(:worker_classes AS text[]))"
)


# ================================================================== end of batches (BatchOps)

COUNTS_FOR_WORKSPACE = Statement.write(
    "queue.counts_for_workspace",
    f"""
SELECT w.status, w.worker_class, count(*) AS n
FROM {TABLE} w
WHERE w.workspace_id = :workspace_id
GROUP BY w.status, w.worker_class
ORDER BY w.worker_class, w.status
""",
)

#: The filters ``Queue.list`` takes, each an equality on its column (``status``: any of a list).
LIST_FILTERS = ("workspace_id", "worker_class", "stage", "job_id", "status")


@lru_cache(maxsize=64)
def list_query(filters: tuple[str, ...], limit: int) -> Query:
    """The list statement for this set of filters (a tuple in LIST_FILTERS order), newest first.

    One statement per set of filters rather than ``(:x IS NULL OR col = :x)``, so each
    prepared statement keeps a plan that uses the index for its filters; ``limit`` is a
    literal for the same reason as in :func:`claim_next_sql`.
    """
    where = [
        "w.status = ANY(CAST(%(statuses)s AS text[]))" if f == "status" else f"w.{f} = %({f})s"
        for f in filters
    ]
    clause = " AND ".join(where) or "true"
    return Query(
        f"queue.list[{','.join(filters)}]",
        f"SELECT {RETURNING} FROM {TABLE} w WHERE {clause}"
        f" ORDER BY w.created_at DESC, w.request_id LIMIT {int(limit)}",
    )
