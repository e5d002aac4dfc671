"""The spend statements (psycopg ``%(name)s`` placeholders), on the database clock.

Periods are UTC calendar days and months: a period starts at ``date_trunc`` of the
database's ``now()`` read in UTC, whatever the session's time zone.
"""

from __future__ import annotations

from typing import Final


def period_start(period: str, at: str) -> str:
    """The start of the period (the SQL text ``period``) that contains the timestamp ``at``."""
    return f"(date_trunc({period}, {at} AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')"


def next_period_start(period: str, at: str) -> str:
    """The start of the period after the one that contains ``at``."""
    return (
        f"((date_trunc({period}, {at} AT TIME ZONE 'UTC') "
        f"+ CAST('1 ' || {period} AS interval)) AT TIME ZONE 'UTC')"
    )


# ------------------------------------------------------------------------------ budgets

# A workspace exists in a database once it has a request, a sub-doc, spend or a budget there.
WORKSPACE_KNOWN: Final = """(
    EXISTS (SELECT 1 FROM workspace_process_requests WHERE workspace_id = %(ws)s)
    OR EXISTS (SELECT 1 FROM workspace_sub_docs WHERE workspace_id = %(ws)s)
    OR EXISTS (SELECT 1 FROM spend_ledger WHERE workspace_id = %(ws)s)
    OR EXISTS (SELECT 1 FROM spend_budgets WHERE workspace_id = %(ws)s)
)"""

SET_BUDGET: Final = f"""
INSERT INTO spend_budgets AS b (workspace_id, period, limit_cost, limit_tokens, on_exceeded)
SELECT %(ws)s, %(period)s, %(limit_cost)s, %(limit_tokens)s, %(on_exceeded)s
WHERE %(allow_new)s OR {WORKSPACE_KNOWN}
ON CONFLICT (workspace_id, period) DO UPDATE
SET limit_cost = EXCLUDED.limit_cost, limit_tokens = EXCLUDED.limit_tokens,
    on_exceeded = EXCLUDED.on_exceeded, updated_at = now()
RETURNING b.workspace_id, b.period, b.limit_cost, b.limit_tokens, b.on_exceeded, b.updated_at
"""

CLEAR_BUDGET: Final = """
DELETE FROM spend_budgets
WHERE workspace_id = %(ws)s AND (CAST(%(period)s AS text) IS NULL OR period = %(period)s)
RETURNING period
"""

# Budgets with what their current period has spent and what calls in flight hold (but the
# permit being admitted: an admit repeated after a lost reply does not count itself), and
# when the first of those reservations expires.
BUDGETS: Final = f"""
WITH n AS (SELECT now() AS now),
b AS (
    SELECT b.*, {period_start("b.period", "n.now")} AS starts,
           {next_period_start("b.period", "n.now")} AS ends
    FROM spend_budgets b, n
    WHERE CAST(%(ws)s AS text) IS NULL OR b.workspace_id = %(ws)s
)
SELECT b.workspace_id, b.period, b.limit_cost, b.limit_tokens, b.on_exceeded, b.updated_at,
       b.starts, b.ends, EXTRACT(EPOCH FROM b.ends - n.now)::float8 AS ends_in,
       s.cost AS spent_cost, s.tokens AS spent_tokens,
       r.cost AS reserved_cost, r.tokens AS reserved_tokens, r.calls AS in_flight,
       EXTRACT(EPOCH FROM r.first_expiry - n.now)::float8 AS next_expiry_in
FROM b, n,
LATERAL (
    SELECT coalesce(sum(l.cost), 0) AS cost,
           coalesce(sum(l.input_tokens + l.output_tokens), 0)::bigint AS tokens
    FROM spend_ledger l
    WHERE l.workspace_id = b.workspace_id AND l.recorded_at >= b.starts
) s,
LATERAL (
    SELECT coalesce(sum(x.cost), 0) AS cost, coalesce(sum(x.tokens), 0)::bigint AS tokens,
           count(*) AS calls, min(x.expires_at) AS first_expiry
    FROM spend_reservations x
    WHERE x.workspace_id = b.workspace_id AND x.expires_at > n.now
      AND x.permit_id IS DISTINCT FROM CAST(%(permit_id)s AS text)
) r
ORDER BY b.workspace_id, b.period
LIMIT %(limit)s
"""

# ------------------------------------------------------------------------------ admit

# Taken first, in the admit's transaction: concurrent admits of one workspace queue here,
# and each reads the sums in a statement that starts after the previous one committed.
LOCK_BUDGETS: Final = """
SELECT period FROM spend_budgets WHERE workspace_id = %(ws)s ORDER BY period FOR UPDATE
"""

# Reservations past their expiry become ledger rows charged their estimate: the call may
# have been paid for, and a budget must never be overrun by a crashed client's calls. A
# later settle of the same permit replaces such a row with what the call really used.
REAP: Final = """
WITH gone AS (
    DELETE FROM spend_reservations
    WHERE workspace_id = %(ws)s AND expires_at <= now()
    RETURNING *
)
INSERT INTO spend_ledger (workspace_id, permit_id, stage, request_id, cell_key, provider,
                          input_tokens, output_tokens, cost, outcome, started_at, ended_at)
SELECT workspace_id, permit_id, stage, request_id, cell_key, provider,
       tokens, 0, cost, 'abandoned', created_at, expires_at
FROM gone
ON CONFLICT (workspace_id, permit_id) DO NOTHING
"""

RESERVE: Final = """
INSERT INTO spend_reservations (workspace_id, permit_id, provider, stage, request_id,
                                cell_key, tokens, cost, expires_at)
VALUES (%(ws)s, %(permit_id)s, %(provider)s, %(stage)s, %(request_id)s, %(cell_key)s,
        %(tokens)s, %(cost)s, now() + make_interval(secs => %(ttl)s))
ON CONFLICT (workspace_id, permit_id) DO NOTHING
"""

RELEASE: Final = """
DELETE FROM spend_reservations WHERE workspace_id = %(ws)s AND permit_id = %(permit_id)s
"""

# ------------------------------------------------------------------------------ settle

# One statement: the reservation cleared, the fence checked (the claim's row locked FOR
# SHARE, as every fenced write does), the ledger row written. Keyed by the permit: a
# repeated settle inserts nothing, except over a row the reaper wrote for an expired
# reservation ('abandoned', charged its estimate), which the real usage replaces.
SETTLE: Final = """
WITH n AS (SELECT now() AS now),
r AS (
    DELETE FROM spend_reservations
    WHERE workspace_id = %(ws)s AND permit_id = %(permit_id)s
    RETURNING 1
),
f AS (
    SELECT 1 FROM workspace_process_requests w, n
    WHERE w.workspace_id = %(ws)s AND w.request_id = %(request_id)s
      AND w.claim_token = %(claim_token)s AND w.status = 'running'
      AND w.lease_expires_at > n.now
    FOR SHARE OF w
)
INSERT INTO spend_ledger AS l (workspace_id, permit_id, stage, request_id, cell_key, provider,
                               model, input_tokens, output_tokens, cost, outcome, fenced,
                               started_at, ended_at, recorded_at)
SELECT %(ws)s, %(permit_id)s, %(stage)s, %(request_id)s, %(cell_key)s, %(provider)s,
       %(model)s, %(input_tokens)s, %(output_tokens)s, %(cost)s, %(outcome)s,
       CASE WHEN CAST(%(claim_token)s AS text) IS NULL THEN NULL
            ELSE EXISTS (SELECT 1 FROM f) END,
       coalesce(CAST(%(started_at)s AS timestamptz), n.now),
       coalesce(CAST(%(ended_at)s AS timestamptz), n.now), n.now
FROM n
ON CONFLICT (workspace_id, permit_id) DO UPDATE
SET model = EXCLUDED.model, input_tokens = EXCLUDED.input_tokens,
    output_tokens = EXCLUDED.output_tokens, cost = EXCLUDED.cost, outcome = EXCLUDED.outcome,
    fenced = EXCLUDED.fenced, started_at = EXCLUDED.started_at, ended_at = EXCLUDED.ended_at
WHERE l.outcome = 'abandoned' AND EXCLUDED.outcome <> 'abandoned'
RETURNING l.fenced
"""

# ------------------------------------------------------------------------------ reads

#: The columns a spend report may be grouped by.
GROUPS: Final = {
    "workspace": "workspace_id",
    "stage": "stage",
    "provider": "provider",
    "model": "model",
    "outcome": "outcome",
}


def report(columns: list[str], *, scoped: bool = False) -> str:
    """Spend summed by ``columns`` (names of :data:`GROUPS`' values only); ``scoped``: of the
    workspaces matching the LIKE patterns ``ws_like`` only (a reader limited to some)."""
    select = "".join(f"{c}, " for c in columns)
    group = f"GROUP BY {', '.join(columns)}" if columns else ""
    scope = "\n  AND workspace_id LIKE ANY(CAST(%(ws_like)s AS text[]))" if scoped else ""
    return f"""
SELECT {select}count(*) AS calls,
       coalesce(sum(input_tokens), 0)::bigint AS input_tokens,
       coalesce(sum(output_tokens), 0)::bigint AS output_tokens,
       coalesce(sum(cost), 0) AS cost,
       min(recorded_at) AS first_at, max(recorded_at) AS last_at
FROM spend_ledger
WHERE (CAST(%(ws)s AS text) IS NULL OR workspace_id = %(ws)s)
  AND (CAST(%(provider)s AS text) IS NULL OR provider = %(provider)s)
  AND recorded_at >= coalesce(CAST(%(since)s AS timestamptz), '-infinity')
  AND recorded_at < coalesce(CAST(%(until)s AS timestamptz), 'infinity'){scope}
{group}
ORDER BY cost DESC, calls DESC
LIMIT %(limit)s
"""


# The average settled cost of a workspace's calls that were made ('ok'), over a window: the
# price of a call the compute lock saved.
AVERAGE_COST: Final = """
SELECT workspace_id, count(*) AS calls, coalesce(sum(cost), 0) / count(*) AS average_cost
FROM spend_ledger
WHERE workspace_id = ANY(CAST(%(workspaces)s AS text[])) AND outcome = 'ok'
  AND cost IS NOT NULL AND recorded_at >= now() - make_interval(days => %(days)s)
GROUP BY workspace_id
"""

NOW: Final = "SELECT now() AS now"
