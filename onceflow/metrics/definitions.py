"""Every metric of onceflow, defined once (the names are a contract: docs/metrics.md).

Process-recorded metrics are written by whatever process does the work. With
``PROMETHEUS_MULTIPROC_DIR`` set *before Python starts* (prometheus_client picks its
value class at import), each process writes its own files in that directory and
:func:`onceflow.metrics.registry` merges them; without it, they live in this process.

Label values are bounded: worker classes and stages are declared by the application
(and checked as ids before anything is written), outcomes are the enums below, and
HTTP routes are route templates, never raw paths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

from prometheus_client import Counter, Gauge, Histogram, values

M = TypeVar("M")
_lazy: dict[str, Any] = {}
_lazy_lock = threading.Lock()


def _once(name: str, make: Callable[[], M]) -> M:
    """``make()`` once per process.

    An unlabelled metric opens its file in ``PROMETHEUS_MULTIPROC_DIR`` when it is created
    (labelled ones only when a child is): created at import, a missing or unwritable
    directory would fail every ``import onceflow…`` (migrate, api, workers, --help).
    Created on first use, the error stays inside the recording helper that swallows it.
    """
    metric = _lazy.get(name)
    if metric is None:
        with _lazy_lock:
            metric = _lazy.get(name)
            if metric is None:
                metric = _lazy[name] = make()
    return metric


#: Latencies from 1 ms to an hour (pickup waits behind a backlog; long LLM stages).
LATENCY_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
#: HTTP request durations: 1 ms to a minute (long polls and streams end up in the top buckets).
HTTP_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

ENQUEUE_OUTCOMES: Final = ("created", "duplicate")
STAGE_OUTCOMES: Final = ("succeeded", "retried", "dead", "cancelled")
ATTEMPT_OUTCOMES: Final = (*STAGE_OUTCOMES, "released")
ZOMBIE_OPERATIONS: Final = ("complete", "fail", "heartbeat", "hand_off", "op", "release")
WAKEUP_KINDS: Final = ("first", "resent")
OP_OUTCOMES: Final = ("applied", "duplicate", "conflict", "refused")
#: onceflow.locks.counters.COUNTER_NAMES (not imported: the counters import the recorders;
#: tests/metrics checks they are equal).
LOCK_OUTCOMES: Final = (
    "preflight_hits", "double_check_hits", "waits_served_by_broadcast",
    "waits_served_by_recheck", "wait_timeouts", "computes", "computes_without_lock",
    "compute_errors", "locks_lost", "duplicate_computes_detected", "store_retries",
    "cache_hits",
)  # fmt: skip
#: What the result cache did with an entry (onceflow.cache.store).
RESULT_CACHE_OUTCOMES: Final = ("hit", "miss", "stored", "invalidated")
#: Live statuses counted from the partial indexes at scrape time.
LIVE_STATUSES: Final = ("queued", "scheduled", "running", "dead")

WC_STAGE = ("worker_class", "stage")

REQUESTS_ENQUEUED = Counter(
    "onceflow_requests_enqueued",
    "Requests enqueued, by outcome: created (this call inserted the row) or duplicate "
    "(collapsed onto an existing row).",
    [*WC_STAGE, "outcome"],
)
CLAIMS = Counter("onceflow_claims", "Requests claimed (runs started).", WC_STAGE)
PICKUP_LATENCY = Histogram(
    "onceflow_pickup_latency_seconds",
    "Due time (greatest(created_at, run_after)) to claim, database clock; claims from the "
    "queue only (a takeover of a lapsed lease is counted in onceflow_leases_reclaimed_total).",
    WC_STAGE,
    buckets=LATENCY_BUCKETS,
)
STAGE_DURATION = Histogram(
    "onceflow_stage_duration_seconds",
    "Claim to recorded outcome of one run, database clock.",
    [*WC_STAGE, "outcome"],
    buckets=LATENCY_BUCKETS,
)
ATTEMPTS = Counter(
    "onceflow_attempts",
    "Runs ended, by outcome: succeeded, retried (queued again), dead, cancelled, or "
    "released (handed back before it started; not counted as an attempt in the table).",
    [*WC_STAGE, "outcome"],
)
REQUEUED = Counter(
    "onceflow_requests_requeued",
    "Finished requests queued again by an operator.",
    ["worker_class"],
)
CANCELLED = Counter(
    "onceflow_requests_cancelled",
    "Cancels of queued or running requests (by an operator or the API).",
    ["worker_class"],
)
LEASES_RECLAIMED = Counter(
    "onceflow_leases_reclaimed",
    "Lapsed leases taken back: rescued by a sweeper, or claimed over by another worker.",
    ["worker_class"],
)
ZOMBIE_WRITES = Counter(
    "onceflow_zombie_writes_rejected",
    "Fenced writes refused because the writer's lease was lost (LeaseLost).",
    ["operation"],
)
WAKEUPS = Counter(
    "onceflow_wakeups_sent",
    "Celery wake-ups published: first (enqueue, hand-off) or resent (by the sweeper).",
    ["worker_class", "kind"],
)
COMPUTE_LOCK = Counter(
    "onceflow_compute_lock",
    "Compute-lock outcomes (onceflow.locks.counters names).",
    ["outcome"],
)


def provider_calls_saved() -> Counter:
    """``onceflow_provider_calls_saved_total`` (unlabelled: created on first use, see _once)."""
    return _once(
        "provider_calls_saved",
        lambda: Counter(
            "onceflow_provider_calls_saved",
            "Third-party calls not made: pre-flight and double-check hits, served waits, "
            "and result-cache hits.",
        ),
    )


def compute_lock_wait() -> Histogram:
    """``onceflow_compute_lock_wait_seconds`` (unlabelled: created on first use, see _once)."""
    return _once(
        "compute_lock_wait",
        lambda: Histogram(
            "onceflow_compute_lock_wait_seconds",
            "Time a waiter waited for another process's compute before being served.",
            buckets=LATENCY_BUCKETS,
        ),
    )


def result_cache_saved_cost() -> Counter:
    """``onceflow_result_cache_saved_cost_total`` (unlabelled: created on first use)."""
    return _once(
        "result_cache_saved_cost",
        lambda: Counter(
            "onceflow_result_cache_saved_cost",
            "What the calls that result-cache hits spared cost when they were made (hits "
            "of entries whose cost is known).",
        ),
    )


if not getattr(values.ValueClass, "_multiprocess", False):
    # Single-process mode touches no file: create them now, so they are exposed at 0.
    provider_calls_saved()
    compute_lock_wait()
    result_cache_saved_cost()

OPS = Counter(
    "onceflow_ops",
    "Op-log writes by outcome: applied, duplicate (a replay), conflict (an op id reused "
    "with another payload), refused (rejected by the op or as too old a replay).",
    ["outcome"],
)
STAGES_IN_PROGRESS = Gauge(
    "onceflow_stages_in_progress",
    "Stage bodies running now (summed over live processes).",
    ["worker_class"],
    multiprocess_mode="livesum",
)
#: Token directions of onceflow_provider_tokens_total.
TOKEN_DIRECTIONS: Final = ("input", "output")
# Spend per provider, recorded at each settled call; no workspace label (one series per
# workspace would be unbounded): spend by workspace is read from the ledger.
PROVIDER_TOKENS = Counter(
    "onceflow_provider_tokens",
    "Tokens used by settled provider calls, by provider and direction (input, output).",
    ["provider", "direction"],
)
RESULT_CACHE = Counter(
    "onceflow_result_cache",
    "Result-cache lookups and writes, by outcome: hit (served from an entry, no call), miss "
    "(no live entry), stored (an entry written), invalidated (an entry deleted).",
    ["outcome"],
)


PROVIDER_COST = Counter(
    "onceflow_provider_cost",
    "Cost of settled provider calls (in the providers' price currency), by provider.",
    ["provider"],
)
HTTP_REQUESTS = Counter(
    "onceflow_http_requests",
    "HTTP API requests by route template, method and status.",
    ["route", "method", "status"],
)
HTTP_DURATION = Histogram(
    "onceflow_http_request_duration_seconds",
    "HTTP API request durations by route template and method.",
    ["route", "method"],
    buckets=HTTP_BUCKETS,
)

#: Scrape-time gauges of the database collector (onceflow.metrics.collector).
DB_GAUGES: Final = (
    "onceflow_requests",
    "onceflow_requests_lower_bound",
    "onceflow_oldest_queued_age_seconds",
    "onceflow_requests_estimated_rows",
    "onceflow_requests_dead_rows",
    "onceflow_requests_vacuum_age_seconds",
    "onceflow_database_oldest_transaction_age_seconds",
    "onceflow_database_up",
)

#: Every sample name as written in PromQL: counters with ``_total``, histograms by base
#: name, gauges as they are.
METRIC_NAMES: frozenset[str] = frozenset(
    {
        "onceflow_requests_enqueued_total",
        "onceflow_claims_total",
        "onceflow_pickup_latency_seconds",
        "onceflow_stage_duration_seconds",
        "onceflow_attempts_total",
        "onceflow_requests_requeued_total",
        "onceflow_requests_cancelled_total",
        "onceflow_leases_reclaimed_total",
        "onceflow_zombie_writes_rejected_total",
        "onceflow_wakeups_sent_total",
        "onceflow_compute_lock_total",
        "onceflow_provider_calls_saved_total",
        "onceflow_compute_lock_wait_seconds",
        "onceflow_ops_total",
        "onceflow_provider_tokens_total",
        "onceflow_provider_cost_total",
        "onceflow_result_cache_total",
        "onceflow_result_cache_saved_cost_total",
        "onceflow_stages_in_progress",
        "onceflow_http_requests_total",
        "onceflow_http_request_duration_seconds",
        *DB_GAUGES,
    }
)
