"""``PullContext.compute_once``: the compute-lock protocol of a Python pull worker, over HTTP.

The same five steps as :func:`onceflow.locks.compute_once` and the JS SDK's ``computeOnce``
(``onceflow/sdk/js/compute.js``), on the claim's lock routes (``POST /v1/claims/{id}/locks``,
``…/locks/extend``, ``…/locks/release``: the same Redis lock, so a Celery stage, a tab and a
Python pull worker asking for the same cell pay for it once):

1. pre-flight ``check()``: a stored value returns at once, no lock round trip;
2. acquire the cell's lock. ``locked`` is "someone else is on it": open the claim's event
   stream (``POST /v1/claims/{id}/events``) *first*, check again, try the lock once more
   (a release announced before the stream was live is not missed), then wait for a
   ``lock_released`` of this cell or a ``commit`` (after which ``check()`` runs again), at
   most the holder's ``remaining_ms`` plus a margin, and try again (the holder may have
   died: its lock expires). No polling loop, no provider call meanwhile;
3. holding the lock, ``check()`` again (the double-check);
4. ``compute()`` with the lock extended every ttl/3 (a failed extend is tried again at the
   next third; only a refusal stops it);
5. ``store(value)``, then — in ``finally`` — release with the outcome (``computed``,
   ``double_check``, ``failed``, or ``abandoned`` before ``compute()`` was called), which
   announces ``lock_released`` to the waiters.

The claim's ``check()`` (lease lost, cancel requested) runs before each acquire, before
``compute()`` and before ``store()``; a lock route answering 409 raises :class:`LeaseLost`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from onceflow.errors import InvalidRequest, LeaseLost, OnceflowError
from onceflow.integrations.pull_claim import Release
from onceflow.integrations.pull_events import ClaimEvents, sse_events
from onceflow.locks import Locked, Outcome, Path
from onceflow.locks.base import is_release_of
from onceflow.locks.protocol import WAIT_MARGIN_SECONDS

if TYPE_CHECKING:
    from onceflow.integrations.pull_claim import ClaimClient, PullClaim

log = logging.getLogger("onceflow.pull")

T = TypeVar("T")


class LockHolder(Protocol):
    """What the compute-lock protocol needs of its caller: a held claim, its calls, its
    ``check()`` (a :class:`~onceflow.integrations.pull_context.PullContext`)."""

    @property
    def worker(self) -> ClaimClient: ...

    @property
    def claim(self) -> PullClaim: ...

    @property
    def workspace_id(self) -> str: ...

    @property
    def job_id(self) -> str: ...

    def check(self) -> None: ...


class _Extender(threading.Thread):
    """Extends a held lock every ttl/3 until stopped; ``lost`` once an extend was refused."""

    def __init__(self, extend: Callable[[], bool], interval: float) -> None:
        super().__init__(name="onceflow-pull-lock-extend", daemon=True)
        self._extend = extend
        self._interval = interval
        self._stop_event = threading.Event()
        self.lost = False

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            try:
                if not self._extend():
                    self.lost = True  # refused: the lock expired or is someone else's
                    return
            except LeaseLost:
                return  # the claim is gone: the stage stops at its next check
            except OnceflowError as exc:  # no answer: it may still be ours, try at the next third
                log.warning("compute lock: extend failed: %s", exc)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=30)


# onceflow.locks.compute_once's arguments (alike by shape): the same protocol, over HTTP.
def compute_once(
    ctx: LockHolder,
    task: str,
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    *,
    wait: bool = True,
    ttl: float | None = None,
    watchdog: bool = True,
    on_wait: Callable[[], object] | None = None,
) -> Outcome[T] | Locked:
    """Get the cell ``(ctx.workspace_id, ctx.job_id, task)``, paying for ``compute()`` once.

    ``wait=False`` returns :class:`Locked` when someone else holds the lock; ``ttl``: the
    lock's TTL in seconds (the server's ``ONCEFLOW_LOCK_TTL_SECONDS`` at most); ``on_wait``
    is called each time this caller starts waiting for a holder.
    """
    if not isinstance(task, str) or not 0 < len(task) <= 200:
        raise InvalidRequest("task must be a string of 1..200 characters")
    ctx.check()
    value = check()
    if value is not None:
        return Outcome(value, Path.PREFLIGHT)
    worker, claim = ctx.worker, ctx.claim
    sub: ClaimEvents | None = None
    waiting_since = 0.0
    rounds = 0

    def acquire() -> dict[str, Any]:
        ctx.check()
        got = worker.acquire_lock(claim, task, ttl)
        if not got.get("acquired") and not got.get("locked"):
            raise InvalidRequest("acquire lock: an answer neither acquired nor locked")
        return got

    def served(value: T, by: Literal["broadcast", "recheck"]) -> Outcome[T]:
        waited = time.monotonic() - waiting_since
        return Outcome(value, Path.WAITED, by, waited_seconds=waited, rounds=rounds)

    try:
        while True:
            rounds += 1  # one round per run of the protocol (as onceflow.locks counts them)
            got = acquire()
            if got["acquired"]:
                return _lead(ctx, task, got, check, compute, store, ttl, watchdog, rounds)
            if not wait:
                return Locked(ctx.workspace_id, ctx.job_id, task)
            if sub is None or sub.ended is not None:  # listen first, then look again
                if sub is None:
                    waiting_since = time.monotonic()
                else:
                    sub.close()
                sub = worker.claim_events(claim)
                value = check()
                if value is not None:
                    return served(value, "recheck")
                # A release announced before the stream was live reached no one here.
                got = acquire()
                if got["acquired"]:
                    return _lead(ctx, task, got, check, compute, store, ttl, watchdog, rounds)
            if on_wait is not None:
                on_wait()
            deadline = time.monotonic() + int(got.get("remaining_ms") or 0) / 1000
            deadline += WAIT_MARGIN_SECONDS
            while True:
                message = sub.wait(deadline - time.monotonic())
                if message is None:
                    break  # the holder's TTL ran out, or the stream is gone: try again
                ctx.check()
                value = check()  # any message may be the store's commit
                if value is not None:
                    return served(value, "broadcast")
                if is_release_of(message, ctx.job_id, task):
                    break  # released without a value: try again (one waiter leads next)
    finally:
        if sub is not None:
            sub.close()


def _lead(
    ctx: LockHolder,
    task: str,
    got: dict[str, Any],
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    ttl: float | None,
    watchdog: bool,
    rounds: int,
) -> Outcome[T]:
    worker, claim = ctx.worker, ctx.claim
    token = str(got["lock_token"])
    ttl_ms = int(got.get("ttl_ms") or 60_000)
    outcome: Release = "abandoned"  # until compute() is called: no provider call to count
    extender = _Extender(lambda: worker.extend_lock(claim, task, token, ttl), ttl_ms / 3000)
    if watchdog:
        extender.start()
    try:
        again = check()  # the double-check: stored between the pre-flight and the acquire?
        if again is not None:
            outcome = "double_check"
            return Outcome(again, Path.DOUBLE_CHECK, rounds=rounds)
        ctx.check()  # no provider call for a stage that must stop
        outcome = "failed"  # from here a raise is a failed provider call (or a lost value)
        value = compute()
        if value is None:
            raise InvalidRequest("compute() returned None: check() would read it as 'not stored'")
        ctx.check()
        held = not extender.lost
        try:
            held = held and worker.extend_lock(claim, task, token, ttl)  # ours before the store?
        except LeaseLost:
            raise
        except OnceflowError as exc:  # cannot confirm it: store anyway (first writer wins)
            log.warning("compute lock: cannot confirm it before storing: %s", exc)
        if not held:
            existing = check()  # lost: did the next holder store its value already?
            if existing is not None:
                outcome = "computed"
                return Outcome(existing, Path.LOCK_LOST, rounds=rounds, duplicate=True)
        kept = store(value)
        outcome = "computed"
        path = Path.COMPUTED if held else Path.LOCK_LOST
        if kept is False:  # the store kept an earlier value
            existing = check()
            value = value if existing is None else existing
            return Outcome(value, path, rounds=rounds, duplicate=True)
        return Outcome(value, path, rounds=rounds)
    finally:
        extender.stop()
        try:
            worker.release_lock(claim, task, token, outcome)
        except OnceflowError as exc:  # not released: it expires by its TTL, waiters wake then
            log.warning("compute lock: release failed: %s", exc)


__all__ = ["ClaimEvents", "LockHolder", "Release", "compute_once", "sse_events"]
