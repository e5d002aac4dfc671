"""Outcome counters of the compute lock: every call saved, waited for, or paid twice.

Each :class:`~onceflow.locks.LockBackend` keeps a :class:`Counters`: process-local
totals (:meth:`Counters.snapshot`, a plain dict) plus increments pending for the
workspace's Redis hash ``counters_key(ws)``, where ``HINCRBY`` sums them across
every process. Pending increments ride on a round trip the protocol makes
anyway (the leader's release announcement, a waiter's wake-up), so a pre-flight
hit costs zero Redis round trips; :meth:`LockBackend.flush_counters` sends them
explicitly. The SQL backend keeps the process-local totals only.

"Calls saved" (:func:`calls_saved`) is the headline figure: pre-flight hits,
double-check hits, waits served by a broadcast or by the re-check after
subscribing, and result-cache hits — each one a third-party call that was not made.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from onceflow.keys import counters_key, counters_workspaces_key
from onceflow.locks.steps import Call, Steps
from onceflow.metrics import record as metrics
from onceflow.redis_clients import REDIS_ERRORS

log = logging.getLogger(__name__)

PREFLIGHT_HITS: Final = "preflight_hits"
DOUBLE_CHECK_HITS: Final = "double_check_hits"
WAITS_SERVED_BY_BROADCAST: Final = "waits_served_by_broadcast"
WAITS_SERVED_BY_RECHECK: Final = "waits_served_by_recheck"
WAIT_TIMEOUTS: Final = "wait_timeouts"
COMPUTES: Final = "computes"
COMPUTES_WITHOUT_LOCK: Final = "computes_without_lock"
COMPUTE_ERRORS: Final = "compute_errors"
LOCKS_LOST: Final = "locks_lost"
DUPLICATE_COMPUTES_DETECTED: Final = "duplicate_computes_detected"
#: ``store()`` attempts repeated after a retryable error (e.g. a lost database connection).
STORE_RETRIES: Final = "store_retries"
#: Calls served from the result cache (``compute_once(..., cache=...)``): no lock, no call.
CACHE_HITS: Final = "cache_hits"

#: Every counter, in the order snapshots list them.
COUNTER_NAMES: Final[tuple[str, ...]] = (
    PREFLIGHT_HITS,
    DOUBLE_CHECK_HITS,
    WAITS_SERVED_BY_BROADCAST,
    WAITS_SERVED_BY_RECHECK,
    WAIT_TIMEOUTS,
    COMPUTES,
    COMPUTES_WITHOUT_LOCK,
    COMPUTE_ERRORS,
    LOCKS_LOST,
    DUPLICATE_COMPUTES_DETECTED,
    STORE_RETRIES,
    CACHE_HITS,
)

_SAVED: Final = (
    PREFLIGHT_HITS,
    DOUBLE_CHECK_HITS,
    WAITS_SERVED_BY_BROADCAST,
    WAITS_SERVED_BY_RECHECK,
    CACHE_HITS,
)

Pending = dict[str, dict[str, int]]


def empty() -> dict[str, int]:
    """A snapshot with every counter at zero."""
    return dict.fromkeys(COUNTER_NAMES, 0)


def calls_saved(snapshot: Mapping[str, int]) -> int:
    """Third-party calls not made: pre-flight and double-check hits, served waits, cache hits."""
    return sum(snapshot.get(name, 0) for name in _SAVED)


class Counters:
    """Thread-safe process-local counts, per workspace, with increments pending for Redis."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, int]] = {}
        self._pending: Pending = {}

    def incr(self, workspace_id: str, name: str, n: int = 1) -> None:
        """Count ``n`` outcomes ``name`` in ``workspace_id`` (locally; pending for Redis)."""
        if name not in COUNTER_NAMES:
            raise ValueError(f"unknown counter {name!r}")
        with self._lock:
            totals = self._totals.setdefault(workspace_id, empty())
            totals[name] += n
            pending = self._pending.setdefault(workspace_id, {})
            pending[name] = pending.get(name, 0) + n
        metrics.lock_outcome(name, n)  # Prometheus: onceflow_compute_lock_total{outcome}

    def snapshot(self, workspace_id: str | None = None) -> dict[str, int]:
        """This process's totals as a plain dict: of one workspace, or summed over all."""
        with self._lock:
            if workspace_id is not None:
                return dict(self._totals.get(workspace_id, empty()))
            summed = empty()
            for totals in self._totals.values():
                for name, n in totals.items():
                    summed[name] += n
            return summed

    def take_pending(self) -> Pending:
        """Increments not yet sent to Redis, handed over (and cleared)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            return pending

    def restore_pending(self, pending: Pending) -> None:
        """Put back increments whose flush failed, so the next flush sends them."""
        with self._lock:
            for workspace_id, counts in pending.items():
                mine = self._pending.setdefault(workspace_id, {})
                for name, n in counts.items():
                    mine[name] = mine.get(name, 0) + n


#: One counters command: (workspace, counter, n) of an ``HINCRBY``, or (workspace, None, 0)
#: of the ``SADD`` that lists the workspace in :func:`~onceflow.keys.counters_workspaces_key`.
Increment = tuple[str, str | None, int]


def queue_increments(pipeline: Any, pending: Pending) -> list[Increment]:
    """Add one ``HINCRBY`` per pending count to a Redis pipeline (no round trip yet).

    Each workspace flushed is also ``SADD``-ed to :func:`~onceflow.keys.counters_workspaces_key`,
    so the dashboard can list the workspaces that have counters without a ``SCAN``. Returns
    the queued commands in order (for :func:`restore_failed`).
    """
    queued = increments(pending)
    queue_group(pipeline, queued)
    return queued


def increments(pending: Pending) -> list[Increment]:
    """The commands that send ``pending``: its ``HINCRBY``-s and one ``SADD`` per workspace."""
    out: list[Increment] = []
    for workspace_id, counts in pending.items():
        out.extend((workspace_id, name, n) for name, n in counts.items() if n)
        out.append((workspace_id, None, 0))
    return out


def key_of(increment: Increment) -> str:
    """The Redis key an increment writes."""
    workspace_id, name, _ = increment
    return counters_workspaces_key() if name is None else counters_key(workspace_id)


def queue_group(pipeline: Any, group: list[Increment]) -> None:
    """Queue ``group``'s commands on a pipeline, in order."""
    for increment in group:
        workspace_id, name, n = increment
        if name is None:
            pipeline.sadd(key_of(increment), workspace_id)
        else:
            pipeline.hincrby(key_of(increment), name, n)


def by_node(pending: Pending, node_of: Callable[[str], str]) -> dict[str, list[Increment]]:
    """``pending``'s commands grouped by the node of their key (``node_of(key)``).

    On a Redis Cluster one pipeline fails as a whole when one of its nodes is down, so
    each node gets a pipeline of its own and a dead node holds back only its own counters
    (and the ``SADD``-s, when it holds the deployment-wide set). On one server there is
    one group.
    """
    groups: dict[str, list[Increment]] = {}
    for increment in increments(pending):
        groups.setdefault(node_of(key_of(increment)), []).append(increment)
    return groups


def restore(counters: Counters, group: list[Increment]) -> None:
    """Put back the increments of ``group`` (its round trip failed)."""
    restore_failed(counters, group, [_FAILED] * len(group))


_FAILED = Exception("not sent")


def restore_failed(counters: Counters, queued: list[Increment], replies: list[Any]) -> int:
    """Put back the increments whose command failed (its reply is an exception).

    A failed ``SADD`` puts back an empty entry, so the next flush lists the workspace
    again. Returns how many commands failed.
    """
    back: Pending = {}
    failed = 0
    for (workspace_id, name, n), reply in zip(queued, replies, strict=True):
        if not isinstance(reply, Exception):
            continue
        failed += 1
        mine = back.setdefault(workspace_id, {})
        if name is not None:
            mine[name] = mine.get(name, 0) + n
    if back:
        counters.restore_pending(back)
    return failed


def parse_hash(raw: Mapping[Any, Any]) -> dict[str, int]:
    """A workspace's counters hash (``HGETALL``) as a snapshot with every counter present."""
    snapshot = empty()
    for name, value in raw.items():
        key = name.decode() if isinstance(name, bytes) else str(name)
        snapshot[key] = int(value)
    return snapshot


def send_groups(
    client: Any, counters: Counters, groups: Mapping[str, list[Increment]]
) -> Steps[None]:
    """Each node's counters in a pipeline of its own; a failed one stays pending.

    Steps for both APIs: the sync backend drives it with ``run_sync``, the async one with
    ``run_async`` (which awaits the pipeline's ``execute``).
    """
    for group in groups.values():
        try:
            pipe = client.pipeline(transaction=False)
            queue_group(pipe, group)
            replies = yield Call(pipe.execute, raise_on_error=False)
        except REDIS_ERRORS as exc:
            restore(counters, group)
            log.debug("compute-lock counters not flushed: %s", exc)
            continue
        except BaseException:
            restore(counters, group)
            raise
        if restore_failed(counters, group, replies):
            log.debug("compute-lock counters: some not flushed")
