# Over ~400 lines on purpose: compute_once's five steps as one protocol, with its
# documentation of every branch, kept together to be read as one.
"""``compute_once``: the five steps for one expensive call, as one protocol.

The protocol is :func:`protocol_steps`, a generator of steps (:mod:`onceflow.locks.steps`)
that both APIs drive: :func:`compute_once` with sync calls, and
:func:`onceflow.locks.acompute_once` with awaited ones. The steps:

1. pre-flight ``check()``: a stored value returns at once, with no lock round trip;
2. acquire the cell's lock; if it is taken and ``wait=False``, return :class:`Locked`;
3. with ``wait=True``: subscribe to the workspace's broadcasts *first*, re-check,
   then wait for a message — any message, after which ``check()`` runs again —
   at most the lock's remaining TTL; on a timeout, or when the holder announces
   its release without a stored value, run the protocol again (the holder may
   have died or failed). There is no polling loop;
4. holding the lock, ``check()`` again (the double-check);
5. ``compute()``, ``store(value)``, then — in ``finally``, on any exception,
   ``BaseException`` included — release (compare-and-delete) and publish
   ``{"kind": "lock_released", "job_id", "task", "ok"}`` on the workspace channel.

A leader whose ``compute()`` raises releases and announces ``ok: false``; its
waiters do **not** receive its error. Each re-runs the protocol, so exactly one
becomes the next leader and calls the provider again, while the others wait
for it. An error is often the leader's own (its timeout, its cancellation, a
transient 5xx), and sharing it would fail every caller at once; the cost is at
most one more attempt per waiter, one at a time, for a call that keeps failing.

``check()`` returns None for "not stored yet", so a stored value is never None.
``store()`` may return ``False`` to say an earlier value was kept (first writer
wins): that is counted as a duplicate compute and the stored value is returned.

A computed value is never thrown away because its store met a passing fault:
when ``store()`` raises an error marked ``retryable`` (a lost database
connection — :class:`~onceflow.errors.DatabaseUnavailable` — or
:class:`~onceflow.errors.LockUnavailable`), the value stays in memory and the
store is retried with a short backoff for at most one lock TTL from the store
(the time the lock stays held even without a watchdog); each retry is counted
as ``store_retries``. ``store()`` must therefore be safe to repeat (an op with a
fixed op id, an upsert, first writer wins). Any other error, or the window
running out, raises the last error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Literal, TypeAlias, TypeVar

from onceflow.errors import InvalidRequest, LockUnavailable
from onceflow.keys import lock_key
from onceflow.locks import spans
from onceflow.locks.base import (
    SUBSCRIPTION_ENDED,
    AsyncLockBackend,
    AsyncLockHandle,
    BackendOptions,
    LockBackend,
    LockHandle,
    backend_options,
    is_release_of,
    ttl_to_ms,
)
from onceflow.locks.counters import (
    COMPUTE_ERRORS,
    COMPUTES,
    COMPUTES_WITHOUT_LOCK,
    DOUBLE_CHECK_HITS,
    DUPLICATE_COMPUTES_DETECTED,
    PREFLIGHT_HITS,
    STORE_RETRIES,
    WAIT_TIMEOUTS,
    WAITS_SERVED_BY_BROADCAST,
    WAITS_SERVED_BY_RECHECK,
)
from onceflow.locks.steps import Call, Sleep, Steps
from onceflow.metrics import record as metrics
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.locks")

T = TypeVar("T")

#: Waits run this much past the holder's remaining TTL, so the retry finds the key expired.
WAIT_MARGIN_SECONDS = 0.02
#: Backoff between retries of a store that raised a retryable error: first delay, cap (seconds).
STORE_RETRY_FIRST_DELAY = 0.05
STORE_RETRY_MAX_DELAY = 1.0


#: The backend and handle of either API: the protocol yields their calls to its driver.
AnyBackend: TypeAlias = LockBackend | AsyncLockBackend
AnyHandle: TypeAlias = LockHandle | AsyncLockHandle


class Path(StrEnum):
    """Which step of the protocol served the caller."""

    PREFLIGHT = "preflight"
    DOUBLE_CHECK = "double_check"
    COMPUTED = "computed"
    WAITED = "waited"
    LOCK_LOST = "lock_lost"
    #: Served from the result cache (``cache=``): no lock, no call.
    CACHE_HIT = "cache_hit"


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """The value, and how this caller got it."""

    value: T
    path: Path
    #: For ``waited``: ``"broadcast"`` (woken by a message) or ``"recheck"`` (found it
    #: stored right after subscribing).
    served_by: Literal["broadcast", "recheck"] | None = None
    #: Seconds from finding the lock taken to being served (``waited`` only).
    waited_seconds: float = 0.0
    #: How many times the protocol ran (more than 1 after a wait timed out or a leader failed).
    rounds: int = 1
    #: False when the backend was down and ``lock_unavailable="compute"`` computed anyway.
    with_lock: bool = True
    #: True when this caller paid for a call whose result someone else had stored first.
    duplicate: bool = False


@dataclass(frozen=True)
class Locked:
    """``wait=False`` found the lock taken: someone else is on it (HTTP: ``locked: true``)."""

    workspace_id: str
    job_id: str
    task: str
    locked: Literal[True] = True


def protocol_steps(
    workspace_id: str,
    job_id: str,
    task: str,
    check: Callable[[], Any],
    compute: Callable[[], Any],
    store: Callable[[Any], Any],
    wait: bool,
    ttl: float | None,
    watchdog: bool | None,
    backend: AnyBackend | None,
    default_backend: Callable[[], AnyBackend],
    on_wait: Callable[[], object] | None,
    counted_in: str | None = None,
) -> Steps[Outcome[Any] | Locked]:
    """The protocol as steps, for either driver (:mod:`onceflow.locks.steps`).

    ``backend`` is a :class:`LockBackend` for :func:`~onceflow.locks.steps.run_sync`
    or an :class:`~onceflow.locks.base.AsyncLockBackend` for
    :func:`~onceflow.locks.steps.run_async`; the protocol only reads its
    ``counters`` and ``settings`` itself and yields every other call. ``counted_in``:
    the workspace whose counters the outcomes go to (the cell's by default; a global
    result-cache key's cell belongs to no workspace, its callers' do).
    """
    lock_key(workspace_id, job_id, task)  # bad ids (and a bad ttl) fail before any call
    if ttl is not None:
        ttl_to_ms(ttl)
    value = yield Call(check)
    be = backend if backend is not None else default_backend()
    cw = workspace_id if counted_in is None else counted_in
    spans.backend(be.name)
    if value is not None:
        be.counters.incr(cw, PREFLIGHT_HITS)  # sent later: zero round trips now
        return Outcome(value, Path.PREFLIGHT)
    settings = be.settings
    use_watchdog = settings.lock_watchdog if watchdog is None else watchdog
    cell = (workspace_id, job_id, task)
    try:
        got = yield from _acquire_or_wait(be, cell, cw, check, wait, ttl, on_wait)
    except LockUnavailable:
        if settings.lock_unavailable != "compute":
            raise
        return (yield from _compute_unlocked(be, cw, check, compute, store))
    if isinstance(got, tuple):
        handle, rounds = got
        return (yield from _lead(be, handle, cw, check, compute, store, use_watchdog, rounds))
    return got


def _acquire_or_wait(
    be: AnyBackend,
    cell: tuple[str, str, str],
    cw: str,
    check: Callable[[], Any],
    wait: bool,
    ttl: float | None,
    on_wait: Callable[[], object] | None,
) -> Steps[tuple[AnyHandle, int] | Outcome[Any] | Locked]:
    workspace_id, job_id, task = cell
    sub: Any = None
    waiting_since = 0.0
    rounds = 0
    # Tracing on: the holder's span context goes beside the lock (same round trip), and a
    # waiter links to its holder's. A backend that keeps none (SQL) is asked for none.
    holder = spans.holder() if getattr(be, "holder_of", None) is not None else None
    linked: set[str] = set()
    try:
        while True:
            rounds += 1
            if holder is None:
                handle = yield Call(be.acquire, workspace_id, job_id, task, ttl)
            else:
                handle = yield Call(be.acquire, workspace_id, job_id, task, ttl, holder=holder)
            if handle is not None:
                spans.event("onceflow.lock.acquired", {"onceflow.lock.round": rounds})
                return handle, rounds
            if not wait:
                return Locked(workspace_id, job_id, task)
            if sub is None:
                waiting_since = waiting_since or time.monotonic()  # (kept over a new subscription)
                sub = yield Call(be.subscribe, workspace_id)  # subscribe first, then re-check
                value = yield Call(check)
                if value is not None:
                    served = _served(be, cw, value, "recheck", waiting_since, rounds)
                    return (yield from served)
            remaining = yield Call(be.remaining_ms, workspace_id, job_id, task)
            if not remaining:
                continue  # released or expired since the acquire: try again now
            if holder is not None:  # one GET per wait, only while tracing
                stored = yield Call(be.holder_of, workspace_id, job_id, task)
                spans.link_holder(stored, linked)
            spans.event("onceflow.lock.waiting", {"onceflow.lock.round": rounds})
            if on_wait is not None:
                yield Call(on_wait)
            verdict, value = yield from _await(
                sub, remaining / 1000 + WAIT_MARGIN_SECONDS, check, job_id, task
            )
            if value is not None:
                served = _served(be, cw, value, "broadcast", waiting_since, rounds)
                return (yield from served)
            if verdict == "ended":  # the server ended the subscription: a new one, re-checked
                yield Call(sub.close)
                sub = None
                continue
            if verdict == "timeout":
                be.counters.incr(cw, WAIT_TIMEOUTS)
            # Timed out (the holder may have died) or released without a value: run again.
    finally:
        if sub is not None:
            yield Call(sub.close)


def _await(
    sub: Any, timeout: float, check: Callable[[], Any], job_id: str, task: str
) -> Steps[tuple[Literal["served", "released", "timeout", "ended"], Any]]:
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        message = (yield Call(sub.wait, remaining)) if remaining > 0 else None
        if message is None:
            return "timeout", None
        if message is SUBSCRIPTION_ENDED:
            return "ended", None
        value = yield Call(check)  # any message may be the store's commit broadcast (layer 3)
        if value is not None:
            return "served", value
        if is_release_of(message, job_id, task):
            return "released", None


def _served(
    be: AnyBackend,
    workspace_id: str,
    value: T,
    served_by: Literal["broadcast", "recheck"],
    waiting_since: float,
    rounds: int,
) -> Steps[Outcome[T]]:
    name = WAITS_SERVED_BY_BROADCAST if served_by == "broadcast" else WAITS_SERVED_BY_RECHECK
    spans.event("onceflow.lock.served", {"onceflow.lock.served_by": served_by})
    be.counters.incr(workspace_id, name)
    yield Call(be.flush_counters)
    waited = time.monotonic() - waiting_since
    metrics.lock_wait(waited)
    return Outcome(value, Path.WAITED, served_by, waited_seconds=waited, rounds=rounds)


def _lead(
    be: AnyBackend,
    handle: AnyHandle,
    ws: str,
    check: Callable[[], Any],
    compute: Callable[[], Any],
    store: Callable[[Any], Any],
    watchdog: bool,
    rounds: int,
) -> Steps[Outcome[Any]]:
    ok = False
    try:
        if watchdog:
            yield Call(handle.start_watchdog)
        value = yield Call(check)  # the double-check: stored between our pre-flight and acquire?
        if value is not None:
            spans.event("onceflow.lock.double_check_hit")
            be.counters.incr(ws, DOUBLE_CHECK_HITS)
            outcome = Outcome(value, Path.DOUBLE_CHECK, rounds=rounds)
        else:
            value = yield from _counted_compute(be, ws, compute)
            outcome = yield from _store(be, handle, ws, check, store, value)
            outcome = dataclasses.replace(outcome, rounds=rounds)
        ok = True
    finally:
        yield from _release_and_announce(be, handle, ok=ok)
    if handle.lost and outcome.path is Path.COMPUTED:
        outcome = dataclasses.replace(outcome, path=Path.LOCK_LOST)  # lost while storing
    return outcome


def _counted_compute(be: AnyBackend, workspace_id: str, compute: Callable[[], Any]) -> Steps[Any]:
    spans.event("onceflow.lock.compute")
    be.counters.incr(workspace_id, COMPUTES)
    try:
        value = yield Call(compute)
    except BaseException:
        be.counters.incr(workspace_id, COMPUTE_ERRORS)
        raise
    if value is None:
        be.counters.incr(workspace_id, COMPUTE_ERRORS)
        raise InvalidRequest("compute() returned None, which check() would read as 'not stored'")
    return value


def _store(
    be: AnyBackend,
    handle: AnyHandle,
    ws: str,
    check: Callable[[], Any],
    store: Callable[[Any], Any],
    value: Any,
) -> Steps[Outcome[Any]]:
    # The lock is ours for one TTL from here even without a watchdog: the store's retry window.
    deadline = time.monotonic() + handle.ttl_ms / 1000
    try:
        held = yield Call(handle.extend)  # ours right before the store? (and a full TTL for it)
    except LockUnavailable as exc:
        log.warning("compute lock %s: cannot confirm it before storing: %s", handle.key, exc)
        held = True
    if not held:
        existing = yield Call(check)  # lost: did the next holder store its value already?
        if existing is not None:
            be.counters.incr(ws, DUPLICATE_COMPUTES_DETECTED)
            return Outcome(existing, Path.LOCK_LOST, duplicate=True)
    path = Path.COMPUTED if held else Path.LOCK_LOST
    spans.event("onceflow.lock.store")
    if (yield from store_retrying(be, ws, store, value, deadline)) is False:
        # the store kept an earlier value (first writer wins)
        be.counters.incr(ws, DUPLICATE_COMPUTES_DETECTED)
        existing = yield Call(check)
        return Outcome(value if existing is None else existing, path, duplicate=True)
    return Outcome(value, path)


def store_retrying(
    be: AnyBackend,
    workspace_id: str,
    store: Callable[[Any], Any],
    value: Any,
    deadline: float,
) -> Steps[object]:
    """``store(value)``, repeated after a ``retryable`` error until ``deadline`` (monotonic).

    Backs off from :data:`STORE_RETRY_FIRST_DELAY` doubling to :data:`STORE_RETRY_MAX_DELAY`.
    Each repeat is counted (``store_retries``). When the window closes the last error is
    raised and the value is lost (logged). A lock lost meanwhile does not stop the retries:
    the store keeps the first value written, and a stored value spares every later caller.
    """
    delay = STORE_RETRY_FIRST_DELAY
    retries = 0
    while True:
        try:
            return (yield Call(store, value))
        except Exception as exc:
            if getattr(exc, "retryable", False) is not True:
                raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.error(
                    "compute lock: store failed after %d retries; the computed value is lost: %s",
                    retries,
                    exc,
                )
                raise
            retries += 1
            be.counters.incr(workspace_id, STORE_RETRIES)
            log.warning("compute lock: store failed (%s); retry %d in %.2fs", exc, retries, delay)
            yield Sleep(min(delay, remaining))
            delay = min(delay * 2, STORE_RETRY_MAX_DELAY)


def _release_and_announce(be: AnyBackend, handle: AnyHandle, *, ok: bool) -> Steps[None]:
    # Release before announcing: a waiter woken by ok=false must find the cell free.
    try:
        yield Call(handle.release)
    except LockUnavailable as exc:
        log.warning("compute lock %s: release failed (%s); it expires by its TTL", handle.key, exc)
    try:
        yield Call(be.announce, handle, ok=ok)
    except LockUnavailable as exc:
        log.warning(
            "compute lock %s: announce failed (%s); waiters wake at the TTL", handle.key, exc
        )


def _compute_unlocked(
    be: AnyBackend,
    workspace_id: str,
    check: Callable[[], Any],
    compute: Callable[[], Any],
    store: Callable[[Any], Any],
) -> Steps[Outcome[Any]]:
    value = yield Call(check)
    if value is not None:
        be.counters.incr(workspace_id, DOUBLE_CHECK_HITS)
        return Outcome(value, Path.DOUBLE_CHECK, with_lock=False)
    log.warning("compute lock unavailable: computing without it (duplicates are possible)")
    be.counters.incr(workspace_id, COMPUTES_WITHOUT_LOCK)
    value = yield from _counted_compute(be, workspace_id, compute)
    deadline = time.monotonic() + be.settings.lock_ttl_seconds  # no lock: the default TTL
    duplicate = (yield from store_retrying(be, workspace_id, store, value, deadline)) is False
    if duplicate:
        be.counters.incr(workspace_id, DUPLICATE_COMPUTES_DETECTED)
        existing = yield Call(check)
        value = value if existing is None else existing
    return Outcome(value, Path.COMPUTED, with_lock=False, duplicate=duplicate)


_backends: dict[tuple[str, str, BackendOptions, int], LockBackend] = {}
_backends_lock = threading.Lock()


def get_backend(settings: Settings | None = None) -> LockBackend:
    """This process's backend chosen by ``lock_backend`` of ``settings`` (the environment's
    if None), on its ``redis_url`` or ``database_url``: made lazily, again after a fork, and
    shared by every caller whose settings name the same backend, URL and lock options."""
    settings = settings or get_settings()
    kind = settings.lock_backend
    url = settings.redis_url if kind == "redis" else settings.database_url
    key = (kind, url, backend_options(settings), os.getpid())
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            if kind == "redis":
                from onceflow.locks.redis_lock import RedisLockBackend

                backend = RedisLockBackend(url, settings=settings)
            else:
                from onceflow.locks.sql_lock import SqlLockBackend

                backend = SqlLockBackend(url, settings=settings)
            _backends[key] = backend
        return backend
