"""The dashboard's reads: cheap, bounded, on the database clock.

Every statement reads a partial index (or a bounded range of one), never the table's
finished history, so its cost follows the live backlog, not the table's size:

* depth by worker class x stage x status: ``ix_wpr_claim`` (queued; INCLUDE stage),
  ``ix_wpr_lease`` (running; INCLUDE stage), ``ix_wpr_dead`` (dead; INCLUDE class, stage)
  — index-only scans, one ``UNION ALL`` branch per index (an OR defeats partial indexes),
  each reading at most a cap of entries (exact below it, a lower bound at it);
* running requests: ``ix_wpr_lease``, newest lease first, ``LIMIT`` :data:`RUNNING_LIMIT`;
* dead requests: ``ix_wpr_dead`` in its order (``finished_at DESC``), ``LIMIT``
  :data:`DEAD_LIMIT`;
* op-log rate: ``ix_ops_committed``, the last minute only, counted up to :data:`OPS_CAP`.

A database split by workspace (docs/sharding.md, 2.4): each statement runs on every
shard and the answers merge — counts summed, ``capped`` OR-ed, the oldest age the
largest, running and dead rows merged in their order and cut at their limits, the op
rate summed. A shard that cannot be read is listed in ``shards_unavailable`` and the
snapshot is what the others hold; only when no shard answers is the error raised.

Compute-lock savings come from Redis: see :mod:`onceflow.locks.savings`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Final, TypeVar

from sqlalchemy import Engine

from onceflow.db import fetch_all, fetch_one, raw_connection, retry_disconnect
from onceflow.metrics.sql import COUNT_CAP_DEFAULT, capped_statuses, live_counts
from onceflow.queue.sql import RUN_ID
from onceflow.shards import each_shard

RUNNING_LIMIT: Final = 100
DEAD_LIMIT: Final = 50
OPS_CAP: Final = 100_000
ERROR_SUMMARY_CHARS: Final = 200
STATUSES: Final = ("queued", "scheduled", "running", "dead")

_T = "workspace_process_requests"
_R = TypeVar("_R")

log = logging.getLogger("onceflow.dashboard")

# queued = due now (run_after <= now), scheduled = run_after in the future (a retry's backoff).
# Each branch reads at most COUNT_CAP_DEFAULT index entries (see onceflow.metrics.sql.live_counts).
DEPTH: Final = live_counts(age_column="oldest_age")

RUNNING: Final = f"""
WITH n AS (SELECT now() AS now)
SELECT w.request_id, w.workspace_id, w.worker_class, w.stage, w.claimed_by AS holder,
       w.attempts AS attempt, w.lease_expires_at,
       EXTRACT(EPOCH FROM w.lease_expires_at - n.now)::float8 AS lease_seconds_left,
       w.cancel_requested, w.updated_at, {RUN_ID} AS run
FROM {_T} w, n
WHERE w.status = 'running'
ORDER BY w.lease_expires_at DESC, w.request_id
LIMIT {RUNNING_LIMIT}
"""

DEAD: Final = f"""
SELECT w.request_id, w.workspace_id, w.worker_class, w.stage, w.attempts, w.finished_at,
       w.updated_at,
       left(CASE WHEN jsonb_typeof(w.error) = 'object'
                 THEN concat_ws(': ', w.error->>'type', w.error->>'message')
                 ELSE w.error::text END, {ERROR_SUMMARY_CHARS}) AS error
FROM {_T} w
WHERE w.status = 'dead'
ORDER BY w.finished_at DESC
LIMIT {DEAD_LIMIT}
"""

OPS_RATE: Final = f"""
SELECT now() AS db_now,
       (SELECT count(*) FROM (
            SELECT 1 FROM workspace_sub_doc_ops o
            WHERE o.committed_at > now() - interval '60 seconds'
            LIMIT {OPS_CAP}) AS recent) AS last_minute
"""

# Is this run (the dashboard's `run`) running and asked to stop already? By its key when the
# dashboard sent the row's workspace, else by its id alone (ix_wpr_request_id).
STOP_REQUESTED: Final = f"""
SELECT 1 FROM {_T} w
WHERE w.request_id = %(request_id)s
  AND (CAST(%(workspace_id)s AS text) IS NULL OR w.workspace_id = %(workspace_id)s)
  AND w.status = 'running' AND w.cancel_requested
  AND {RUN_ID} = %(run)s
"""

#: The request-table statements (their plans are checked: no sequential scan).
REQUEST_QUERIES: Final = {"depth": DEPTH, "running": RUNNING, "dead": DEAD}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def per_shard(
    engines: Engine | Sequence[Engine], read: Callable[[Engine], _R]
) -> tuple[list[_R], list[int]]:
    """``read(engine)`` on each shard (one engine: that database alone): the answers of the
    shards that answered, and the indexes of those that did not (an error is logged and
    skipped while another shard answers; raised when none did)."""
    shards = [engines] if isinstance(engines, Engine) else list(engines)
    return each_shard(
        shards,
        read,
        lambda index, exc: log.warning("shard %d not read: %s: %s", index, type(exc).__name__, exc),
    )


def read_tables(
    engines: Engine | Sequence[Engine], *, count_cap: int = COUNT_CAP_DEFAULT
) -> dict[str, Any]:
    """Depth, oldest queued age, running and dead requests, and the op-log rate (one checkout
    per database): of one engine's database, or merged over the shards' engines (module).

    Depth counts at most ``count_cap`` index entries per status (per shard):
    ``depth_lower_bound`` lists the statuses whose counts (and, for queued, the oldest age)
    are lower bounds. ``shards_unavailable``: the shards that could not be read.
    """
    depth_sql = DEPTH if count_cap == COUNT_CAP_DEFAULT else live_counts(
        count_cap, age_column="oldest_age"
    )  # fmt: skip

    def read(engine: Engine) -> dict[str, Any]:
        def once() -> dict[str, Any]:
            with raw_connection(engine) as raw:
                depth_rows = fetch_all(raw, depth_sql, {})
                running = fetch_all(raw, RUNNING, {})
                dead = fetch_all(raw, DEAD, {})
                ops = fetch_one(raw, OPS_RATE, {})
            return {"depth": depth_rows, "running": running, "dead": dead, "ops": ops}

        return retry_disconnect(once)

    parts, down = per_shard(engines, read)
    depth_rows = [r for p in parts for r in p["depth"]]
    depth: dict[str, dict[str, dict[str, int]]] = {}
    oldest: dict[str, float] = {}
    for r in depth_rows:
        cell = depth.setdefault(r["worker_class"], {}).setdefault(
            r["stage"], dict.fromkeys(STATUSES, 0)
        )
        for status in STATUSES:
            cell[status] += int(r[status])
        age = r["oldest_age"]
        if age is not None:
            oldest[r["worker_class"]] = max(oldest.get(r["worker_class"], 0.0), float(age))
    # Each shard's rows come in the statement's order: merged in that order, then cut.
    running = sorted(
        (r for p in parts for r in p["running"]),
        key=lambda r: (-r["lease_expires_at"].timestamp(), r["request_id"]),
    )[:RUNNING_LIMIT]
    dead = sorted(
        (r for p in parts for r in p["dead"]),
        key=lambda r: -r["finished_at"].timestamp() if r["finished_at"] else 0.0,
    )[:DEAD_LIMIT]
    minutes = [int(p["ops"]["last_minute"]) for p in parts]
    last_minute = sum(minutes)
    return {
        "db_now": _iso(max(p["ops"]["db_now"] for p in parts)),
        "depth": depth,
        "oldest_queued_age_seconds": oldest,
        "depth_lower_bound": capped_statuses(depth_rows),
        "depth_cap": count_cap,
        "running": [
            {
                **{k: r[k] for k in ("request_id", "workspace_id", "worker_class", "stage")},
                "holder": r["holder"],
                "attempt": r["attempt"],
                "lease_expires_at": _iso(r["lease_expires_at"]),
                "lease_seconds_left": round(float(r["lease_seconds_left"]), 3),
                "cancel_requested": r["cancel_requested"],
                "version": _iso(r["updated_at"]),
                "run": r["run"],
            }
            for r in running
        ],
        "running_limit": RUNNING_LIMIT,
        "dead": [
            {
                **{k: r[k] for k in ("request_id", "workspace_id", "worker_class", "stage")},
                "attempts": r["attempts"],
                "finished_at": _iso(r["finished_at"]),
                "error": r["error"],
                "version": _iso(r["updated_at"]),
            }
            for r in dead
        ],
        "dead_limit": DEAD_LIMIT,
        "ops": {
            "last_minute": last_minute,
            "per_second": round(last_minute / 60, 3),
            "capped": any(n >= OPS_CAP for n in minutes),
        },
        "shards_unavailable": down,
    }


__all__ = ["DEAD_LIMIT", "REQUEST_QUERIES", "RUNNING_LIMIT", "per_shard", "read_tables"]


def stop_already_requested(
    engines: Engine | Sequence[Engine],
    request_id: str,
    run: str,
    *,
    workspace_id: str | None = None,
) -> bool:
    """True if run ``run`` of the request (in ``workspace_id``, when given) is running and
    was asked to stop already: on the database of ``engines`` (the request's shard, or each
    shard that can be read when it is not known)."""
    params = {"request_id": request_id, "workspace_id": workspace_id, "run": run}

    def read(engine: Engine) -> bool:
        def once() -> bool:
            with raw_connection(engine) as raw:
                return fetch_one(raw, STOP_REQUESTED, params) is not None

        return bool(retry_disconnect(once))

    answers, _ = per_shard(engines, read)
    return any(answers)
