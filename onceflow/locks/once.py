"""``compute_once``: the compute lock on one cell, and with ``cache=`` a result cache across jobs.

Without ``cache`` it drives :func:`~onceflow.locks.protocol.protocol_steps` on the cell.
The cell's own protocol (:mod:`onceflow.locks.protocol`) merges the callers of one cell.
With a :class:`~onceflow.cache.CacheKey` an identical call anywhere in the key's scope —
another job, another workspace for a global key — within the key's TTL is paid once:

1. the cell's pre-flight ``check()``: a stored value returns at once, as without a cache;
2. the cache: a live entry is served with no lock and no call — the cell is filled with it
   (``store(value)``, as for a computed value), a ``cache_hit`` row goes to the
   workspace's spend ledger with the cost the entry's call had, and it is counted
   (``cache_hits``, a saved call);
3. a miss runs the protocol on the key's own lock cell (:meth:`CacheKey.lock_cell`), not
   the caller's cell, with the cache as its ``check``: identical calls in different cells,
   jobs or workspaces merge in flight on one lock; the holder double-checks the cache,
   computes, writes the entry (JSON, within the payload limits, with the cost of the
   provider calls settled while it computed), and releases; waiters are served the entry;
4. the caller's cell is filled with the value (``store(value)``, retried like the
   protocol's store).

A value that is not JSON, or over the payload limits, is refused (``InvalidRequest``,
``PayloadTooLarge``) before anything is stored. A hit gives the value back as JSON reads it
(a tuple comes back a list). The cache path is synchronous (``compute_once``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

from onceflow import tracing
from onceflow.cache import CacheKey, Entry, ResultCache, capture, default_cache
from onceflow.errors import InvalidRequest
from onceflow.keys import lock_key
from onceflow.locks import spans
from onceflow.locks.base import LockBackend, ttl_to_ms
from onceflow.locks.counters import CACHE_HITS, PREFLIGHT_HITS
from onceflow.locks.protocol import (
    AnyBackend,
    Locked,
    Outcome,
    Path,
    get_backend,
    protocol_steps,
    store_retrying,
)
from onceflow.locks.steps import Call, Steps, run_sync
from onceflow.metrics import record as metrics

T = TypeVar("T")


# compute_once's overloads (alike by shape): one signature per ``wait`` literal, as typing needs.
@overload
def compute_once(
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    wait: Literal[True] = True,
    ttl: float | None = None,
    watchdog: bool | None = None,
    backend: LockBackend | None = None,
    on_wait: Callable[[], object] | None = None,
    cache: CacheKey | None = None,
    result_cache: ResultCache | None = None,
    stage: str | None = None,
    request_id: str | None = None,
) -> Outcome[T]: ...
# The second overload (alike by shape on purpose): ``wait: bool`` may give Locked, as typing needs.
@overload
def compute_once(
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    wait: bool,
    ttl: float | None = None,
    watchdog: bool | None = None,
    backend: LockBackend | None = None,
    on_wait: Callable[[], object] | None = None,
    cache: CacheKey | None = None,
    result_cache: ResultCache | None = None,
    stage: str | None = None,
    request_id: str | None = None,
) -> Outcome[T] | Locked: ...
# The overloads' parameters again on purpose: the implementation's signature, as typing needs.
def compute_once(
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    wait: bool = True,
    ttl: float | None = None,
    watchdog: bool | None = None,
    backend: LockBackend | None = None,
    on_wait: Callable[[], object] | None = None,
    cache: CacheKey | None = None,
    result_cache: ResultCache | None = None,
    stage: str | None = None,
    request_id: str | None = None,
) -> Outcome[T] | Locked:
    """Get the cell's value, paying for ``compute()`` at most once across every caller.

    ``ttl`` (seconds) and ``watchdog`` (extend every ttl/3 while computing)
    default to the settings; ``backend`` to :func:`get_backend`. ``on_wait`` is
    called each time this caller starts waiting for the holder (e.g. to show
    "someone else is on it"). Raises :class:`LockUnavailable` when the backend
    is down, unless ``lock_unavailable="compute"``. The asyncio twin is
    :func:`onceflow.locks.acompute_once`; both run :func:`protocol_steps`.

    ``cache``: a :class:`~onceflow.cache.CacheKey` — an identical call anywhere in the
    key's scope within its TTL is paid once (see the module); ``result_cache``: where the
    entries live (:func:`~onceflow.cache.default_cache`, the settings' database, if None);
    ``stage`` and ``request_id``: the run the call is made for, named on the ``cache_hit``
    ledger rows (``ctx.compute_once`` gives its own).
    """
    if cache is None:
        if result_cache is not None:
            raise InvalidRequest("result_cache is where cache= entries live: give a cache key")
        if stage is not None or request_id is not None:
            raise InvalidRequest("stage and request_id name a cache hit's row: give a cache key")
        steps = protocol_steps(
            workspace_id, job_id, task, check, compute, store, wait, ttl, watchdog,
            backend, get_backend, on_wait,
        )  # fmt: skip
    else:
        steps = cached_steps(
            workspace_id, job_id, task, check, compute, store, cache, result_cache, wait,
            ttl, watchdog, backend, get_backend, on_wait, stage=stage, request_id=request_id,
        )  # fmt: skip
    if tracing.active():
        steps = spans.traced(steps)
    return run_sync(steps)


# protocol_steps' parameters and the cache's (alike by shape on purpose): it wraps protocol_steps.
def cached_steps(
    workspace_id: str,
    job_id: str,
    task: str,
    check: Callable[[], Any],
    compute: Callable[[], Any],
    store: Callable[[Any], Any],
    cache: CacheKey,
    results: ResultCache | None,
    wait: bool,
    ttl: float | None,
    watchdog: bool | None,
    backend: AnyBackend | None,
    default_backend: Callable[[], AnyBackend],
    on_wait: Callable[[], object] | None,
    *,
    stage: str | None = None,
    request_id: str | None = None,
) -> Steps[Outcome[Any] | Locked]:
    """The cache path as steps (see the module), for :func:`~onceflow.locks.steps.run_sync`;
    ``stage`` and ``request_id`` name the run on the hits' ledger rows."""
    lock_key(workspace_id, job_id, task)  # bad ids, a bad key and a bad ttl fail first
    if not isinstance(cache, CacheKey):
        raise InvalidRequest(f"cache must be a CacheKey, got {type(cache).__name__}")
    if ttl is not None:
        ttl_to_ms(ttl)
    value = yield Call(check)
    be = backend if backend is not None else default_backend()
    spans.backend(be.name)
    if value is not None:
        be.counters.incr(workspace_id, PREFLIGHT_HITS)
        return Outcome(value, Path.PREFLIGHT)
    rc = results if results is not None else default_cache()
    cell_key = f"{job_id}/{task}"

    def hit(entry: Entry) -> Steps[None]:
        metrics.result_cache("hit", entry.cost)
        saved = {} if entry.cost is None else {"onceflow.spend.saved_cost": float(entry.cost)}
        spans.event("onceflow.cache.hit", saved)
        yield Call(
            rc.record_hit, workspace_id, entry, cell_key=cell_key, stage=stage,
            request_id=request_id,
        )  # fmt: skip

    entry = yield Call(rc.get, workspace_id, cache)
    if entry is not None:
        be.counters.incr(workspace_id, CACHE_HITS)  # sent later, as a pre-flight hit
        yield from hit(entry)
        return (yield from _fill(be, workspace_id, check, store, entry.value, Path.CACHE_HIT))
    metrics.result_cache("miss")
    spans.event("onceflow.cache.miss")

    served: list[Entry] = []
    computed: list[tuple[str, capture.Paid]] = []

    def from_cache() -> Any:
        found = rc.get(workspace_id, cache)
        if found is None:
            return None
        served.append(found)
        return found.value

    def compute_paid() -> Any:
        with capture.collecting() as paid:
            made = compute()
        if made is not None:  # (None is refused by the protocol, as without a cache)
            computed.append((rc.encode(made), paid))  # not JSON: refused before any store
        return made

    def keep(_: Any) -> None:
        text, paid = computed[-1]
        rc.put(workspace_id, cache, text, paid)

    lock_ws, lock_job, lock_task = cache.lock_cell(workspace_id)
    outcome = yield from protocol_steps(
        lock_ws, lock_job, lock_task, from_cache, compute_paid, keep, wait, ttl, watchdog,
        be, default_backend, on_wait, counted_in=workspace_id,
    )  # fmt: skip
    if isinstance(outcome, Locked):
        return Locked(workspace_id, job_id, task)
    if outcome.path in (Path.PREFLIGHT, Path.DOUBLE_CHECK, Path.WAITED) and served:
        # Served by another caller's entry (written just now, or merged in flight).
        yield from hit(served[-1])
    path = Path.CACHE_HIT if outcome.path is Path.PREFLIGHT else outcome.path
    filled = yield from _fill(be, workspace_id, check, store, outcome.value, path)
    return Outcome(
        filled.value, filled.path, outcome.served_by, outcome.waited_seconds, outcome.rounds,
        outcome.with_lock, outcome.duplicate or filled.duplicate,
    )  # fmt: skip


def _fill(
    be: AnyBackend,
    workspace_id: str,
    check: Callable[[], Any],
    store: Callable[[Any], Any],
    value: Any,
    path: Path,
) -> Steps[Outcome[Any]]:
    """The caller's cell filled with ``value``, as the protocol stores a computed value
    (``False`` from ``store``: an earlier value was kept, and is returned)."""
    deadline = time.monotonic() + be.settings.lock_ttl_seconds
    if (yield from store_retrying(be, workspace_id, store, value, deadline)) is False:
        existing = yield Call(check)
        return Outcome(value if existing is None else existing, path)
    return Outcome(value, path)
