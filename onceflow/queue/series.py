"""The dashboard's time series: a per-minute rollup each sweep writes, read per range.

Written by :func:`write_rollup` (a Flow's sweep calls it on each database it swept, at its
first sweep of each minute), in one transaction under an advisory lock taken without waiting
(a Flow that finds another one writing the rollup skips it: that one writes it), each
statement bounded by :data:`STATEMENT_TIMEOUT` and :data:`LOCK_TIMEOUT` so a slow rollup
never holds up the sweep that runs it:

* the request counters of the minutes from the last rollup's minute (at most
  :data:`LOOKBACK` back, at least :data:`RECOMPUTE` back) to now are RECOMPUTED from the
  rows and overwritten (zeroed first): re-running a sweep for a minute counts nothing
  twice, and a minute is final once it is older than :data:`RECOMPUTE`. Each is read from an
  index over that window: enqueues from ``ix_wpr_created``; finishes (by status) from
  ``ix_wpr_finished``; claims (``claimed_at`` in the window) from the rows now running
  (``ix_wpr_lease``), queued again (``ix_wpr_claim``) or finished in the window — a row
  claimed in the window is one of those — so the cost follows the window's work and the
  live backlog, never the table's history. A claim's pickup latency is ``claimed_at -
  run_after``, exact for the rows still on that claim (running or finished; a row queued
  again has a new ``run_after``, its claim is counted without latency);
* the queue depth (due now) and running count per class and stage, sampled into the
  current minute when the rollup is written (a sweep's: at the minute's first sweep);
* ``rescued``: the leases this sweep's rescue requeued, added (each lapse is rescued once)
  by every sweep that rescued, in a transaction of its own committed first (a rollup that
  fails or is skipped loses no rescue);
* spend: the spend ledger's rows of the window, by minute, workspace and provider,
  recomputed (the ledger is read by provider, ``ix_spend_ledger_provider``);
* savings (when given the Redis counters' per-workspace totals): the change since the
  totals the last sweep stored, added to the current minute (a counter that went down —
  Redis flushed — counts 0; the first totals ever stored count nothing);
* pruning: rollup rows older than the retention (``ONCEFLOW_RETENTION_SECONDS``) or
  :data:`DEFAULT_KEEP_SECONDS`, whichever is longer (a short request retention keeps the
  week chart).

Read by :func:`read_series`: buckets of 60 s (hour), 15 min (day) or 2 h (week), summed in
SQL from the minutes (their primary key's range), every shard's answers added.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Engine

from onceflow.db import (
    bounded_read,
    execute,
    fetch_all,
    fetch_one,
    raw_connection,
    retry_disconnect,
)
from onceflow.errors import InvalidRequest
from onceflow.ids import check_id, check_worker_class
from onceflow.metrics.sql import live_counts
from onceflow.models.requests import SweepResult
from onceflow.models.scopes import WorkspaceScope, like_patterns
from onceflow.queue.overview import per_shard

log = logging.getLogger("onceflow.series")

#: Minutes recomputed at every rollup, at least (a late write lands in its minute).
RECOMPUTE: Final = timedelta(minutes=3)
#: How far back a rollup reaches for the minutes since the last one (sweeps stopped).
LOOKBACK: Final = timedelta(hours=1)
#: How long rollup rows are kept at least (a week, and a day more): longer when requests
#: are kept longer.
DEFAULT_KEEP_SECONDS: Final = 8 * 86_400
#: Longest a rollup statement may run, and wait for a lock: the sweep that runs the rollup
#: waits for nothing longer (a rollup stopped is written at the next sweep).
STATEMENT_TIMEOUT: Final = timedelta(seconds=10)
LOCK_TIMEOUT: Final = timedelta(seconds=2)
#: The ranges: (step seconds, buckets).
RANGES: Final = {"hour": (60, 60), "day": (900, 96), "week": (7200, 84)}
#: The workspaces listed in the spend by workspace: the costliest of the range.
SPEND_WORKSPACES: Final = 10
#: The live counts the depth sample reads (each status's index, at most this many entries).
DEPTH_CAP: Final = 100_000

_T = "workspace_process_requests"
_SERIES_LOCK = 0x6F6E6365  # advisory lock key of the rollup writer ("once")

# The window: [start, stop) by the database clock (or the injected `now`, for tests).
WINDOW: Final = f"""
WITH n AS (SELECT date_trunc('minute', COALESCE(CAST(%(now)s AS timestamptz), now())) AS cur)
SELECT n.cur,
       greatest(n.cur - interval '{int(LOOKBACK.total_seconds())} seconds',
                least(n.cur - interval '{int(RECOMPUTE.total_seconds())} seconds',
                      (SELECT max(s.bucket) FROM onceflow_series s))) AS start,
       n.cur + interval '1 minute' AS stop,
       (SELECT max(s.bucket) FROM onceflow_series s) AS last
FROM n
"""

LOCK: Final = f"SELECT pg_try_advisory_xact_lock({_SERIES_LOCK}) AS locked"

# The rollup's transaction: each statement bounded (SET LOCAL: this transaction only).
BOUND: Final = f"""
SELECT set_config('statement_timeout', '{int(STATEMENT_TIMEOUT.total_seconds() * 1000)}ms', true),
       set_config('lock_timeout', '{int(LOCK_TIMEOUT.total_seconds() * 1000)}ms', true)
"""

ZERO: Final = """
UPDATE onceflow_series
SET enqueued = 0, claimed = 0, succeeded = 0, dead = 0, cancelled = 0,
    pickup_count = 0, pickup_sum = 0, pickup_max = NULL,
    queued = CASE WHEN bucket = %(cur)s THEN 0 ELSE queued END,
    running = CASE WHEN bucket = %(cur)s THEN 0 ELSE running END
WHERE bucket >= %(start)s AND bucket < %(stop)s
"""

_FINISHED = "('succeeded', 'dead', 'cancelled')"
_CLAIM_COLS = "w.worker_class, w.stage, w.status, w.claimed_at, w.run_after"
_IN_WINDOW = "w.claimed_at >= %(start)s AND w.claimed_at < %(stop)s"

COUNTS: Final = f"""
WITH created AS (
    SELECT date_trunc('minute', w.created_at) AS bucket, w.worker_class, w.stage,
           count(*) AS enqueued
    FROM {_T} w
    WHERE w.created_at >= %(start)s AND w.created_at < %(stop)s
    GROUP BY 1, 2, 3
), claims AS (
    SELECT {_CLAIM_COLS} FROM {_T} w WHERE w.status = 'queued' AND {_IN_WINDOW}
    UNION ALL
    SELECT {_CLAIM_COLS} FROM {_T} w WHERE w.status = 'running' AND {_IN_WINDOW}
    UNION ALL
    SELECT {_CLAIM_COLS} FROM {_T} w
    WHERE w.finished_at >= %(start)s AND w.status IN {_FINISHED} AND {_IN_WINDOW}
), claimed AS (
    SELECT date_trunc('minute', c.claimed_at) AS bucket, c.worker_class, c.stage,
           count(*) AS claimed,
           count(*) FILTER (WHERE c.status <> 'queued' AND c.run_after <= c.claimed_at)
               AS pickup_count,
           COALESCE(sum(EXTRACT(EPOCH FROM c.claimed_at - c.run_after)::float8)
               FILTER (WHERE c.status <> 'queued' AND c.run_after <= c.claimed_at), 0)
               AS pickup_sum,
           max(EXTRACT(EPOCH FROM c.claimed_at - c.run_after)::float8)
               FILTER (WHERE c.status <> 'queued' AND c.run_after <= c.claimed_at)
               AS pickup_max
    FROM claims c
    GROUP BY 1, 2, 3
), finished AS (
    SELECT date_trunc('minute', w.finished_at) AS bucket, w.worker_class, w.stage,
           count(*) FILTER (WHERE w.status = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE w.status = 'dead') AS dead,
           count(*) FILTER (WHERE w.status = 'cancelled') AS cancelled
    FROM {_T} w
    WHERE w.finished_at >= %(start)s AND w.finished_at < %(stop)s AND w.status IN {_FINISHED}
    GROUP BY 1, 2, 3
), k AS (
    SELECT bucket, worker_class, stage FROM created
    UNION SELECT bucket, worker_class, stage FROM claimed
    UNION SELECT bucket, worker_class, stage FROM finished
)
INSERT INTO onceflow_series AS s
    (bucket, worker_class, stage, enqueued, claimed, succeeded, dead, cancelled,
     pickup_count, pickup_sum, pickup_max)
SELECT k.bucket, k.worker_class, k.stage, COALESCE(e.enqueued, 0), COALESCE(c.claimed, 0),
       COALESCE(f.succeeded, 0), COALESCE(f.dead, 0), COALESCE(f.cancelled, 0),
       COALESCE(c.pickup_count, 0), COALESCE(c.pickup_sum, 0), c.pickup_max
FROM k
LEFT JOIN created e USING (bucket, worker_class, stage)
LEFT JOIN claimed c USING (bucket, worker_class, stage)
LEFT JOIN finished f USING (bucket, worker_class, stage)
ON CONFLICT (bucket, worker_class, stage) DO UPDATE SET
    enqueued = EXCLUDED.enqueued, claimed = EXCLUDED.claimed,
    succeeded = EXCLUDED.succeeded, dead = EXCLUDED.dead, cancelled = EXCLUDED.cancelled,
    pickup_count = EXCLUDED.pickup_count, pickup_sum = EXCLUDED.pickup_sum,
    pickup_max = EXCLUDED.pickup_max
"""

DEPTH_SAMPLE: Final = f"""
WITH d AS ({live_counts(DEPTH_CAP)})
INSERT INTO onceflow_series AS s (bucket, worker_class, stage, queued, running)
SELECT %(cur)s, d.worker_class, d.stage, sum(d.queued), sum(d.running)
FROM d
GROUP BY d.worker_class, d.stage
ON CONFLICT (bucket, worker_class, stage) DO UPDATE SET
    queued = EXCLUDED.queued, running = EXCLUDED.running
"""

RESCUED: Final = """
INSERT INTO onceflow_series AS s (bucket, worker_class, stage, rescued)
SELECT %(cur)s, r.worker_class, r.stage, r.n
FROM unnest(CAST(%(worker_classes)s AS text[]), CAST(%(stages)s AS text[]),
            CAST(%(counts)s AS bigint[])) AS r(worker_class, stage, n)
ON CONFLICT (bucket, worker_class, stage) DO UPDATE SET rescued = s.rescued + EXCLUDED.rescued
"""

SPEND_CLEAR: Final = """
DELETE FROM onceflow_series_spend WHERE bucket >= %(start)s AND bucket < %(stop)s
"""

# The ledger by provider (its index leads with provider): a loose scan finds the providers,
# then each one's rows of the window are a range of ix_spend_ledger_provider.
SPEND: Final = """
WITH RECURSIVE p AS (
    SELECT (SELECT min(l.provider) FROM spend_ledger l) AS provider
    UNION ALL
    SELECT (SELECT min(l.provider) FROM spend_ledger l WHERE l.provider > p.provider)
    FROM p WHERE p.provider IS NOT NULL
)
INSERT INTO onceflow_series_spend
    (bucket, workspace_id, provider, calls, input_tokens, output_tokens, cost, saved_cost)
SELECT date_trunc('minute', l.recorded_at), l.workspace_id, l.provider, count(*),
       sum(l.input_tokens), sum(l.output_tokens), sum(l.cost), sum(l.saved_cost)
FROM p
CROSS JOIN LATERAL (
    SELECT l.recorded_at, l.workspace_id, l.provider, l.input_tokens, l.output_tokens, l.cost,
           l.saved_cost
    FROM spend_ledger l
    WHERE l.provider = p.provider AND l.recorded_at >= %(start)s AND l.recorded_at < %(stop)s
    OFFSET 0) l  -- not flattened into a join: one index range per provider
WHERE p.provider IS NOT NULL
GROUP BY 1, 2, 3
"""

# totals: {"workspace": [made, saved], …}. A workspace not in the last totals counts in full
# (a new workspace) unless this read was truncated (it may only be new to the read).
SAVINGS: Final = """
WITH prev AS (
    SELECT s.totals FROM onceflow_series_savings s ORDER BY s.bucket DESC LIMIT 1
), cur AS (
    SELECT t.key AS ws, (t.value->>0)::bigint AS made, (t.value->>1)::bigint AS saved
    FROM jsonb_each(CAST(%(totals)s AS jsonb)) AS t
), d AS (
    SELECT COALESCE(sum(greatest(c.made - COALESCE((p.totals->c.ws->>0)::bigint, 0), 0)), 0)
               AS made,
           COALESCE(sum(greatest(c.saved - COALESCE((p.totals->c.ws->>1)::bigint, 0), 0)), 0)
               AS saved
    FROM cur c, prev p
    WHERE p.totals ? c.ws OR NOT CAST(%(truncated)s AS boolean)
)
INSERT INTO onceflow_series_savings AS s (bucket, made, saved, totals)
SELECT %(cur)s, COALESCE((SELECT d.made FROM d), 0), COALESCE((SELECT d.saved FROM d), 0),
       CAST(%(totals)s AS jsonb)
ON CONFLICT (bucket) DO UPDATE SET
    made = s.made + EXCLUDED.made, saved = s.saved + EXCLUDED.saved, totals = EXCLUDED.totals
"""

PRUNE: Final = {
    table: f"DELETE FROM {table} WHERE bucket < %(cur)s - make_interval(secs => %(keep)s)"
    for table in ("onceflow_series", "onceflow_series_spend", "onceflow_series_savings")
}

# Reads: [from, to) in buckets of %(step)s seconds, summed over the minutes.
_BUCKET = "to_timestamp(floor(EXTRACT(EPOCH FROM s.bucket) / %(step)s) * %(step)s)"
_FILTER = (
    "s.bucket >= %(from)s AND s.bucket < %(to)s"
    " AND (CAST(%(worker_class)s AS text) IS NULL OR s.worker_class = %(worker_class)s)"
    " AND (CAST(%(stage)s AS text) IS NULL OR s.stage = %(stage)s)"
)

READ_NOW: Final = "SELECT now() AS db_now"

READ_COUNTS: Final = f"""
SELECT {_BUCKET} AS t, sum(s.enqueued) AS enqueued, sum(s.claimed) AS claimed,
       sum(s.succeeded) AS succeeded, sum(s.dead) AS dead, sum(s.cancelled) AS cancelled,
       sum(s.rescued) AS rescued, sum(s.pickup_count) AS pickup_count,
       sum(s.pickup_sum) AS pickup_sum, max(s.pickup_max) AS pickup_max
FROM onceflow_series s
WHERE {_FILTER}
GROUP BY 1
"""

# The highest depth sampled in a bucket: per minute summed over classes, then the maximum.
READ_GAUGES: Final = f"""
SELECT {_BUCKET.replace("s.bucket", "m.bucket")} AS t, max(m.queued) AS queued_max,
       max(m.running) AS running_max
FROM (SELECT s.bucket, sum(s.queued) AS queued, sum(s.running) AS running
      FROM onceflow_series s
      WHERE {_FILTER} AND s.queued IS NOT NULL
      GROUP BY s.bucket) m
GROUP BY 1
"""

READ_SAVINGS: Final = f"""
SELECT {_BUCKET} AS t, sum(s.made) AS made, sum(s.saved) AS saved
FROM onceflow_series_savings s
WHERE s.bucket >= %(from)s AND s.bucket < %(to)s
GROUP BY 1
"""

_SPEND_SUMS = (
    "sum(s.calls) AS calls, sum(s.input_tokens) AS input_tokens, "
    "sum(s.output_tokens) AS output_tokens, sum(s.cost) AS cost, sum(s.saved_cost) AS saved_cost"
)

READ_SPEND_PROVIDERS: Final = f"""
SELECT {_BUCKET} AS t, s.provider, {_SPEND_SUMS}
FROM onceflow_series_spend s
WHERE s.bucket >= %(from)s AND s.bucket < %(to)s
GROUP BY 1, 2
"""


def _spend_workspaces(scoped: bool) -> str:
    """The costliest workspaces' spend per bucket; ``scoped``: of the workspaces matching
    the LIKE patterns ``ws_like`` only (a reader limited to some workspaces)."""
    scope = "\n      AND s.workspace_id LIKE ANY(CAST(%(ws_like)s AS text[]))" if scoped else ""
    return f"""
WITH top AS (
    SELECT s.workspace_id, sum(s.cost) AS cost, sum(s.input_tokens + s.output_tokens) AS tokens
    FROM onceflow_series_spend s
    WHERE s.bucket >= %(from)s AND s.bucket < %(to)s{scope}
    GROUP BY 1
    ORDER BY 2 DESC NULLS LAST, 3 DESC, 1
    LIMIT {SPEND_WORKSPACES}
)
SELECT {_BUCKET} AS t, s.workspace_id, top.cost AS range_cost, top.tokens AS range_tokens,
       {_SPEND_SUMS}
FROM onceflow_series_spend s
JOIN top USING (workspace_id)
WHERE s.bucket >= %(from)s AND s.bucket < %(to)s
GROUP BY 1, 2, 3, 4
"""


READ_SPEND_WORKSPACES: Final = _spend_workspaces(scoped=False)
READ_SPEND_WORKSPACES_SCOPED: Final = _spend_workspaces(scoped=True)

READ_BUDGETS: Final = """
SELECT b.workspace_id, b.period, b.limit_cost, b.limit_tokens, b.on_exceeded
FROM spend_budgets b
WHERE b.workspace_id = ANY(CAST(%(workspaces)s AS text[]))
ORDER BY b.workspace_id, b.period
"""

#: Every statement of the module, by name (pinned in tests/unit/test_statement_sql.py).
STATEMENTS: Final = {
    "series.window": WINDOW,
    "series.lock": LOCK,
    "series.bound": BOUND,
    "series.zero": ZERO,
    "series.counts": COUNTS,
    "series.depth_sample": DEPTH_SAMPLE,
    "series.rescued": RESCUED,
    "series.spend_clear": SPEND_CLEAR,
    "series.spend": SPEND,
    "series.savings": SAVINGS,
    **{f"series.prune.{t}": q for t, q in PRUNE.items()},
    "series.read_now": READ_NOW,
    "series.read_counts": READ_COUNTS,
    "series.read_gauges": READ_GAUGES,
    "series.read_savings": READ_SAVINGS,
    "series.read_spend_providers": READ_SPEND_PROVIDERS,
    "series.read_spend_workspaces": READ_SPEND_WORKSPACES,
    "series.read_spend_workspaces_scoped": READ_SPEND_WORKSPACES_SCOPED,
    "series.read_budgets": READ_BUDGETS,
}


def _rescued_counts(result: SweepResult | None) -> Counter[tuple[str, str]]:
    """The sweep's requeued rescues by (worker class, stage): their wake-ups carry both."""
    if result is None or not result.rescued:
        return Counter()
    rescued = set(result.rescued)
    return Counter((d.worker_class, d.stage) for d in result.to_dispatch if d.request_id in rescued)


def write_rollup(
    engine: Engine,
    *,
    result: SweepResult | None = None,
    savings: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None = None,
    retention_seconds: float | None = None,
    once_a_minute: bool = False,
    now: datetime | None = None,
) -> dict[str, Any] | None:
    """Write the rollup of ``engine``'s database (module docstring): the rescues in a
    transaction of their own, then the rest in one.

    ``result``: the sweep's outcome (its requeued rescues are added); ``savings``: what
    :func:`onceflow.locks.savings.read_savings` returned, or a function returning it (or
    None: Redis could not be read), called only when the rollup is written (on one
    database of a split one only: Redis is shared), or None. ``once_a_minute``: when this
    minute has a rollup already, add the rescues only and return None — a sweep's way: the
    rows are read once a minute however often it sweeps, and the minutes before are
    recomputed at the next minute's first sweep. Returns the window written: ``{"start",
    "stop"}``, or None when another writer held the rollup's lock (it writes the rollup).
    """
    rescued = _rescued_counts(result)
    keep = max(float(retention_seconds or 0), DEFAULT_KEEP_SECONDS)
    if rescued:  # every sweep's: a rescue happens once, at the sweep that made it
        keys = sorted(rescued)
        with raw_connection(engine) as raw, raw.transaction():
            fetch_one(raw, BOUND, {})
            window = fetch_one(raw, WINDOW, {"now": now})
            execute(raw, RESCUED, {
                "cur": window["cur"], "worker_classes": [k[0] for k in keys],
                "stages": [k[1] for k in keys], "counts": [rescued[k] for k in keys],
            })  # fmt: skip
    with raw_connection(engine) as raw, raw.transaction():
        fetch_one(raw, BOUND, {})
        if not fetch_one(raw, LOCK, {})["locked"]:
            return None
        window = fetch_one(raw, WINDOW, {"now": now})
        params = {"cur": window["cur"], "start": window["start"], "stop": window["stop"]}
        if once_a_minute and window["last"] is not None and window["last"] >= window["cur"]:
            return None
        execute(raw, ZERO, params)
        execute(raw, COUNTS, params)
        execute(raw, DEPTH_SAMPLE, params)
        execute(raw, SPEND_CLEAR, params)
        execute(raw, SPEND, params)
        if callable(savings):
            savings = savings()
        if savings is not None:
            totals = {
                w["workspace_id"]: [int(w["made"]), int(w["saved"])]
                for w in savings.get("workspaces", [])
            }
            execute(raw, SAVINGS, {
                "cur": window["cur"], "totals": json.dumps(totals),
                "truncated": bool(savings.get("truncated")),
            })  # fmt: skip
        for statement in PRUNE.values():
            execute(raw, statement, {"cur": window["cur"], "keep": keep})
    return {"start": window["start"], "stop": window["stop"]}


def _num(value: Any) -> Any:
    """A Numeric as a decimal string (exact in JSON), an int as an int, None as None."""
    if isinstance(value, Decimal):
        return str(value.normalize()) if value == value.to_integral() else str(value)
    return value


def _range(name: str) -> tuple[int, int]:
    found = RANGES.get(name)
    if found is None:
        raise InvalidRequest(f"range must be one of {', '.join(RANGES)}, not {name!r}")
    return found


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def read_series(
    engines: Engine | Sequence[Engine],
    range_name: str,
    *,
    worker_class: str | None = None,
    stage: str | None = None,
    scope: WorkspaceScope | None = None,
) -> dict[str, Any]:
    """The series of ``range_name`` (hour, day, week) summed over ``engines``' databases.

    ``scope``: the workspaces the reader may read (None: every one); the spend by workspace
    and the budgets are then of those workspaces only (the counts, gauges, savings and
    spend by provider name no workspace and are the deployment's)."""
    step, count = _range(range_name)
    if worker_class is not None:
        check_worker_class(worker_class)
    if stage is not None:
        check_id("stage", stage)
    shards = [engines] if isinstance(engines, Engine) else list(engines)

    def read_now(engine: Engine) -> datetime:
        def once() -> datetime:
            with bounded_read(engine) as raw:
                return fetch_one(raw, READ_NOW, {})["db_now"]  # type: ignore[no-any-return]

        return retry_disconnect(once)

    nows, _ = per_shard(shards, read_now)
    db_now = max(nows)
    epoch = int(db_now.timestamp()) // step * step
    first = datetime.fromtimestamp(epoch - (count - 1) * step, UTC)
    last = datetime.fromtimestamp(epoch + step, UTC)
    params: dict[str, Any] = {"from": first, "to": last, "step": step,
                              "worker_class": worker_class, "stage": stage}  # fmt: skip
    spend_workspaces = READ_SPEND_WORKSPACES
    if scope is not None:
        params["ws_like"] = like_patterns(scope)
        spend_workspaces = READ_SPEND_WORKSPACES_SCOPED

    def read(engine: Engine) -> dict[str, list[Any]]:
        def once() -> dict[str, list[Any]]:
            with bounded_read(engine) as raw:
                return {
                    "counts": fetch_all(raw, READ_COUNTS, params),
                    "gauges": fetch_all(raw, READ_GAUGES, params),
                    "savings": fetch_all(raw, READ_SAVINGS, params),
                    "providers": fetch_all(raw, READ_SPEND_PROVIDERS, params),
                    "workspaces": fetch_all(raw, spend_workspaces, params),
                }

        return retry_disconnect(once)

    parts, down = per_shard(shards, read)
    times = [datetime.fromtimestamp(epoch - i * step, UTC) for i in range(count - 1, -1, -1)]
    counters = ("enqueued", "claimed", "succeeded", "dead", "cancelled", "rescued")
    buckets: dict[datetime, dict[str, Any]] = {
        t: {**dict.fromkeys(counters, 0), "queued_max": None, "running_max": None,
            "pickup": {"count": 0, "sum_seconds": 0.0, "max_seconds": None}}
        for t in times
    }  # fmt: skip
    savings: dict[datetime, dict[str, int]] = {t: {"made": 0, "saved": 0} for t in times}
    providers: dict[str, dict[datetime, dict[str, Any]]] = {}
    workspaces: dict[str, dict[datetime, dict[str, Any]]] = {}
    ranking: dict[str, tuple[Any, Any]] = {}
    spend_fields = ("calls", "input_tokens", "output_tokens", "cost", "saved_cost")
    for part in parts:
        for r in part["counts"]:
            b = buckets.get(r["t"])
            if b is None:
                continue
            for c in counters:
                b[c] += int(r[c])
            p = b["pickup"]
            p["count"] += int(r["pickup_count"])
            p["sum_seconds"] += float(r["pickup_sum"])
            if r["pickup_max"] is not None:
                p["max_seconds"] = max(p["max_seconds"] or 0.0, float(r["pickup_max"]))
        for r in part["gauges"]:  # one database: exact; several: the sum of their maxima
            b = buckets.get(r["t"])
            if b is not None:
                b["queued_max"] = _add(b["queued_max"], int(r["queued_max"]))
                b["running_max"] = _add(b["running_max"], int(r["running_max"]))
        for r in part["savings"]:
            if r["t"] in savings:
                savings[r["t"]]["made"] += int(r["made"])
                savings[r["t"]]["saved"] += int(r["saved"])
        for rows, key, into in ((part["providers"], "provider", providers),
                                (part["workspaces"], "workspace_id", workspaces)):  # fmt: skip
            for r in rows:
                point = into.setdefault(r[key], {}).setdefault(r["t"], dict.fromkeys(spend_fields))
                for f in spend_fields:
                    point[f] = _add(point[f], r[f])
                if key == "workspace_id":
                    ranking[r[key]] = (r["range_cost"], r["range_tokens"])
    top = sorted(
        ranking,
        key=lambda ws: (-(ranking[ws][0] or 0), -(ranking[ws][1] or 0), ws),
    )[:SPEND_WORKSPACES]  # each workspace lives on one database: its range totals are whole

    def points(by_time: dict[datetime, dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {"t": t.isoformat(), **{f: _num(v[f]) for f in spend_fields}}
            for t, v in sorted(by_time.items())
        ]

    budgets: list[dict[str, Any]] = []
    if top:

        def read_budgets(engine: Engine) -> list[Any]:
            def once() -> list[Any]:
                with bounded_read(engine) as raw:
                    return fetch_all(raw, READ_BUDGETS, {"workspaces": top})

            return retry_disconnect(once)

        found, _ = per_shard(shards, read_budgets)
        budgets = sorted(
            (
                {
                    "workspace_id": b["workspace_id"],
                    "period": b["period"],
                    "limit_cost": _num(b["limit_cost"]),
                    "limit_tokens": b["limit_tokens"],
                    "on_exceeded": b["on_exceeded"],
                }
                for rows in found
                for b in rows
            ),
            key=lambda b: (b["workspace_id"], b["period"]),
        )
    out_buckets = []
    for t in times:
        b = buckets[t]
        p = b["pickup"]
        p["mean_seconds"] = round(p["sum_seconds"] / p["count"], 6) if p["count"] else None
        out_buckets.append({"t": t.isoformat(), **b})
    return {
        "range": range_name,
        "step_seconds": step,
        "from": first.isoformat(),
        "to": last.isoformat(),
        "db_now": db_now.isoformat(),
        "worker_class": worker_class,
        "stage": stage,
        "buckets": out_buckets,
        "savings": [
            {"t": t.isoformat(), "asked": v["made"] + v["saved"], **v} for t, v in savings.items()
        ],
        "spend": {
            "by_provider": [
                {"provider": name, "points": points(by_time)}
                for name, by_time in sorted(providers.items())
            ],
            "by_workspace": [{"workspace_id": ws, "points": points(workspaces[ws])} for ws in top],
            "workspaces_limit": SPEND_WORKSPACES,
        },
        "budgets": budgets,
        "shards_unavailable": down,
    }


__all__ = ["RANGES", "STATEMENTS", "read_series", "write_rollup"]
