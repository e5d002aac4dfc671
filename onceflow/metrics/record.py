"""Recording helpers for the hot paths: cached label children, never a DB or Redis call.

Every helper swallows its own errors (logged once per helper): a metric must never
break the operation it records. Durations come from the rows' own timestamps, all
written by the database clock.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from onceflow.metrics import definitions as d
from onceflow.models.requests import Claim, EnqueueResult, Request
from onceflow.models.status import Status

log = logging.getLogger("onceflow.metrics")
P = ParamSpec("P")
R = TypeVar("R")

_children: dict[tuple[Any, ...], Any] = {}
_warned: set[str] = set()


def _child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached (a dict lookup on the hot path)."""
    key = (id(metric), *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child


def _safe(func: Callable[P, None]) -> Callable[P, None]:
    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            func(*args, **kwargs)
        except Exception:  # a metric must never fail what it records
            if func.__name__ not in _warned:
                _warned.add(func.__name__)
                log.warning("metrics: recording %s failed", func.__name__, exc_info=True)

    return wrapper


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


@_safe
def enqueued(results: Iterable[EnqueueResult]) -> None:
    """Enqueue outcomes: created or duplicate, per worker class and stage (one ``inc``
    per label set: a batch is mostly one stage)."""
    counts: dict[tuple[str, str, bool], int] = {}
    for r in results:
        key = (r.worker_class, r.stage, r.created)
        counts[key] = counts.get(key, 0) + 1
    for (worker_class, stage, created), n in counts.items():
        outcome = "created" if created else "duplicate"
        _child(d.REQUESTS_ENQUEUED, worker_class, stage, outcome).inc(n)


@_safe
def claimed(claims: Iterable[Claim], lapsed: Iterable[bool] | None = None) -> None:
    """Claims, with pickup latency (due → claim) for claims taken from the queue.

    ``lapsed``: per claim, whether it took over a lapsed lease (counted as reclaimed; no
    pickup latency, as its due time is its first run's).
    """
    flags = iter(lapsed) if lapsed is not None else None
    for c in claims:
        req = c.request
        took_over = next(flags) if flags is not None else False
        _child(d.CLAIMS, req.worker_class, req.stage).inc()
        if took_over:
            # The lapsed run ends here, re-run by this claim: an attempt retried.
            _child(d.LEASES_RECLAIMED, req.worker_class).inc()
            _child(d.ATTEMPTS, req.worker_class, req.stage, "retried").inc()
            continue
        # claimed_at: the claim's own time (database clock).
        wait = _seconds(max(req.created_at, req.run_after), req.claimed_at)
        if wait is not None:
            _child(d.PICKUP_LATENCY, req.worker_class, req.stage).observe(wait)


_OUTCOME = {
    Status.SUCCEEDED: "succeeded",
    Status.QUEUED: "retried",
    Status.DEAD: "dead",
    Status.CANCELLED: "cancelled",
}


@_safe
def finished(row: Request) -> None:
    """A run's recorded outcome (``row``: the request after complete/fail)."""
    outcome = _OUTCOME.get(row.status)
    if outcome is not None:
        run_ended(row.worker_class, row.stage, outcome, row.claimed_at, row.updated_at)


@_safe
def run_ended(
    worker_class: str,
    stage: str,
    outcome: str,
    claimed_at: datetime | None,
    ended_at: datetime | None,
) -> None:
    """A run's recorded outcome (``finished``'s, from the columns alone: ``Queue.finish``).

    Its duration from the row's ``claimed_at`` (the claim's own time, kept by complete
    and fail) to the write that ended it, never from an earlier ``updated_at``: heartbeats
    and cancels move it.
    """
    _child(d.ATTEMPTS, worker_class, stage, outcome).inc()
    took = _seconds(claimed_at, ended_at)
    if took is not None:
        _child(d.STAGE_DURATION, worker_class, stage, outcome).observe(took)


@_safe
def finished_many(claims: Iterable[Claim], rows: Iterable[Any]) -> None:
    """``finished`` for a batch (entries that are not rows, e.g. LeaseLost, are skipped).

    ``claims`` is not needed any more (each row has its claim time); kept for callers.
    """
    for row in rows:
        if isinstance(row, Request):
            finished(row)


@_safe
def released(rows: Iterable[Any]) -> None:
    """Claims handed back before their bodies started."""
    for row in rows:
        if isinstance(row, Request):
            _child(d.ATTEMPTS, row.worker_class, row.stage, "released").inc()


@_safe
def zombie(operation: str, n: int = 1) -> None:
    """Fenced writes refused for a lost lease (``operation`` from ZOMBIE_OPERATIONS)."""
    if n:
        _child(d.ZOMBIE_WRITES, operation).inc(n)


@_safe
def requeued(row: Request) -> None:
    _child(d.REQUEUED, row.worker_class).inc()


@_safe
def cancelled(row: Request) -> None:
    _child(d.CANCELLED, row.worker_class).inc()


@_safe
def reclaimed(rows: Iterable[Any]) -> None:
    """Lapsed leases a sweeper took back (rows with status, worker_class, stage).

    The crashed run ends here: counted as an attempt retried (queued again), dead
    (quarantined) or cancelled, without a duration (its end is unknown).
    """
    for r in rows:
        _child(d.LEASES_RECLAIMED, r["worker_class"]).inc()
        outcome = _OUTCOME.get(Status(r["status"]))
        if outcome is not None:
            _child(d.ATTEMPTS, r["worker_class"], r["stage"], outcome).inc()


@_safe
def wakeup(worker_class: str, kind: str) -> None:
    _child(d.WAKEUPS, worker_class, kind).inc()


_SAVED = frozenset(
    (
        "preflight_hits",
        "double_check_hits",
        "waits_served_by_broadcast",
        "waits_served_by_recheck",
        "cache_hits",
    )
)


@_safe
def lock_outcome(name: str, n: int = 1) -> None:
    """A compute-lock counter (onceflow.locks.counters); saved calls counted too."""
    _child(d.COMPUTE_LOCK, name).inc(n)
    if name in _SAVED:
        d.provider_calls_saved().inc(n)


@_safe
def lock_wait(seconds: float) -> None:
    d.compute_lock_wait().observe(max(0.0, seconds))


@_safe
def op(outcome: str) -> None:
    _child(d.OPS, outcome).inc()


@_safe
def provider_spend(provider: str, input_tokens: int, output_tokens: int, cost: Any) -> None:
    """A settled provider call: its tokens by direction, and its cost when known."""
    _child(d.PROVIDER_TOKENS, provider, "input").inc(input_tokens)
    _child(d.PROVIDER_TOKENS, provider, "output").inc(output_tokens)
    if cost is not None:
        _child(d.PROVIDER_COST, provider).inc(float(cost))


@_safe
def result_cache(outcome: str, saved_cost: Any = None) -> None:
    """A result-cache outcome; a hit of an entry whose cost is known adds it to the saved cost."""
    _child(d.RESULT_CACHE, outcome).inc()
    if saved_cost is not None:
        d.result_cache_saved_cost().inc(float(saved_cost))


@_safe
def http(route: str, method: str, status: int, seconds: float) -> None:
    _child(d.HTTP_REQUESTS, route, method, str(status)).inc()
    _child(d.HTTP_DURATION, route, method).observe(seconds)


@_safe
def _gauge_add(worker_class: str, n: int) -> None:
    _child(d.STAGES_IN_PROGRESS, worker_class).inc(n)


@contextmanager
def in_progress(worker_class: str) -> Iterator[None]:
    """Count a stage body as running for the duration of the block."""
    _gauge_add(worker_class, 1)
    try:
        yield
    finally:
        _gauge_add(worker_class, -1)
