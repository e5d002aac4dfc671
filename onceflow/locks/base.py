"""What every compute-lock backend shares: the handle, the watchdog, the backend seam.

A :class:`LockHandle` is one acquisition. It carries the owner's token — never a
shared instance or a thread-local (redis-py's ``Lock`` keeps it thread-local,
which lets two coroutines on one thread release each other's lock) — so two
threads or coroutines can only ever release what they acquired. Release and
extend compare that token on the server (Lua for Redis, ``WHERE token = …`` for
SQL); expiry is the server's (Redis ``PX``, Postgres ``now()``), never a
client's clock.

A backend (:class:`LockBackend`) is the seam: the Redis backend
(:mod:`onceflow.locks.redis_lock`) and the SQL backend
(:mod:`onceflow.locks.sql_lock`) implement it, and :func:`onceflow.locks.compute_once`
runs the protocol on either. :class:`AsyncLockBackend` is the same seam for asyncio
(:class:`onceflow.locks.redis_async.AsyncRedisLockBackend`), run by
:func:`onceflow.locks.acompute_once`, whose handle is :class:`AsyncLockHandle`;
:class:`HeldLock` is what the handles of both share.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from onceflow.errors import InvalidRequest, LockLost, LockUnavailable
from onceflow.locks.counters import LOCKS_LOST, Counters
from onceflow.settings import Settings

log = logging.getLogger("onceflow.locks")

Message = dict[str, Any]

#: ``kind`` of the message a leader publishes after releasing (wakes the waiters).
LOCK_RELEASED = "lock_released"
#: What a subscription's ``wait`` answers when the server ended the subscription (a Redis
#: Cluster slot that moved to another node): never published, the waiter subscribes anew.
SUBSCRIPTION_ENDED: Message = {"kind": "subscription_ended"}


#: What :func:`backend_options` returns.
BackendOptions = tuple[float, float, str, bool]


def backend_options(settings: Settings) -> BackendOptions:
    """The settings a lock backend reads besides its URL: backends of the same URL are
    shared by the settings that agree on these (the getters' caches key on them)."""
    return (
        settings.lock_ttl_seconds,
        settings.lock_timeout_seconds,
        settings.lock_unavailable,
        settings.lock_watchdog,
    )


class Subscription(Protocol):
    """A live subscription to a workspace's broadcasts (confirmed before it is returned)."""

    def wait(self, timeout: float) -> Message | None:
        """The next message of the workspace, or None after ``timeout`` seconds."""

    def close(self) -> None:
        """Unsubscribe and free the connection."""


class LockBackend(Protocol):
    """Where compute locks live; implemented for Redis and for Postgres."""

    name: str
    counters: Counters
    settings: Settings

    def acquire(
        self,
        workspace_id: str,
        job_id: str,
        task: str,
        ttl: float | None = None,
        *,
        watchdog: bool = False,
        holder: str | None = None,
    ) -> LockHandle | None:
        """Take the lock (one atomic step), or None if someone else holds it. ``holder``:
        the caller's trace context, kept beside the lock where the backend can (Redis)."""

    def cad_release(self, handle: LockHandle) -> int:
        """Compare-and-delete: 1 if the lock still held the handle's token and is gone now,
        2 if an earlier send of this release deleted it (a resend; Redis only), else 0."""

    def cad_extend(self, handle: LockHandle, ttl_ms: int) -> bool:
        """Compare-and-extend: True if the lock still held the handle's token."""

    def remaining_ms(self, workspace_id: str, job_id: str, task: str) -> int | None:
        """Milliseconds until the current holder's lock expires, or None if it is free."""

    def holder_of(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The trace context the cell's holder kept beside its lock, or None."""

    def owner_token(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The token of the live lock on the cell, or None if it is free."""

    def subscribe(self, workspace_id: str) -> Subscription:
        """Subscribe to the workspace's broadcasts; returns once the subscription is live."""

    def announce(self, handle: LockHandle, *, ok: bool) -> None:
        """Publish ``lock_released`` for the handle's cell (and flush pending counters)."""

    def flush_counters(self) -> None:
        """Send pending counter increments now (best effort)."""

    def workspace_counters(self, workspace_id: str) -> dict[str, int]:
        """A workspace's counters, summed over every process where the backend allows."""


class AsyncSubscription(Protocol):
    """:class:`Subscription` for asyncio: a live, confirmed subscription."""

    async def wait(self, timeout: float) -> Message | None:
        """The next message of the workspace, or None after ``timeout`` seconds."""

    async def close(self) -> None:
        """Unsubscribe and free the connection."""


# LockBackend's twin for asyncio (alike by shape): the same calls, each declared async.
class AsyncLockBackend(Protocol):
    """:class:`LockBackend` for asyncio (one per event loop): the same calls, awaited."""

    name: str
    counters: Counters
    settings: Settings

    async def acquire(
        self,
        workspace_id: str,
        job_id: str,
        task: str,
        ttl: float | None = None,
        *,
        watchdog: bool = False,
        holder: str | None = None,
    ) -> AsyncLockHandle | None:
        """Take the lock (one atomic step), or None if someone else holds it (``holder``:
        as :meth:`LockBackend.acquire`)."""

    async def cad_release(self, handle: HeldLock[Any]) -> int:
        """As :meth:`LockBackend.cad_release`."""

    async def cad_extend(self, handle: HeldLock[Any], ttl_ms: int) -> bool:
        """Compare-and-extend: True if the lock still held the handle's token."""

    async def remaining_ms(self, workspace_id: str, job_id: str, task: str) -> int | None:
        """Milliseconds until the current holder's lock expires, or None if it is free."""

    async def holder_of(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The trace context the cell's holder kept beside its lock, or None."""

    async def owner_token(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The token of the live lock on the cell, or None if it is free."""

    async def subscribe(self, workspace_id: str) -> AsyncSubscription:
        """Subscribe to the workspace's broadcasts; returns once the subscription is live."""

    async def announce(self, handle: HeldLock[Any], *, ok: bool) -> None:
        """Publish ``lock_released`` for the handle's cell (and flush pending counters)."""

    async def flush_counters(self) -> None:
        """Send pending counter increments now (best effort)."""

    async def workspace_counters(self, workspace_id: str) -> dict[str, int]:
        """A workspace's counters, summed over every process where the backend allows."""


def released_message(job_id: str, task: str, *, ok: bool) -> Message:
    """The small message a leader publishes after releasing a cell's lock."""
    return {"kind": LOCK_RELEASED, "job_id": job_id, "task": task, "ok": ok}


def parse_message(data: Any) -> Message:
    """A broadcast's payload as a dict; anything that is not a JSON object is ``unknown``."""
    try:
        parsed = json.loads(data)
    except (TypeError, ValueError):
        return {"kind": "unknown"}
    return parsed if isinstance(parsed, dict) else {"kind": "unknown"}


def is_release_of(message: Message, job_id: str, task: str) -> bool:
    """True if ``message`` says the lock of this cell was released."""
    return (
        message.get("kind") == LOCK_RELEASED
        and message.get("job_id") == job_id
        and message.get("task") == task
    )


B = TypeVar("B", bound="_HasCounters")


class _HasCounters(Protocol):
    counters: Counters


class HeldLock(Generic[B]):
    """What a held lock knows of itself, for either API: key, token, TTL and ``lost`` flag.

    :class:`LockHandle` (sync) and :class:`AsyncLockHandle`
    add the calls. A lock found lost (an extend or the release refused by the
    server) sets :attr:`lost`, is counted once as ``locks_lost``, and makes
    :meth:`ensure_held` raise :class:`LockLost`.
    """

    def __init__(
        self,
        backend: B,
        workspace_id: str,
        job_id: str,
        task: str,
        key: str,
        token: str,
        ttl_ms: int,
    ) -> None:
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
        self.backend = backend
        self.workspace_id = workspace_id
        self.job_id = job_id
        self.task = task
        self.key = key
        self.token = token
        self.ttl_ms = ttl_ms
        self._lost = False  # set once, under _state; read without it (a bool is atomic)
        self._state = threading.Lock()
        self._released = False
        self._lost_detail = ""

    def __repr__(self) -> str:  # never shows the token
        return f"<{type(self).__name__} {self.key} lost={self.lost} released={self._released}>"

    @property
    def lost(self) -> bool:
        """True once the server said this owner no longer holds the lock."""
        return self._lost

    @property
    def released(self) -> bool:
        """True once the release got an answer from the server."""
        return self._released

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` if the lock is known to be lost (no round trip)."""
        if self._lost:
            raise LockLost(self.key, self._lost_detail)

    def mark_lost(self, detail: str) -> None:
        """Record the lock as lost (``detail``: why), counted once as ``locks_lost``.

        Called by the handle itself and by its watchdog (another thread) when the server
        refuses an extend or the release.
        """
        with self._state:
            if self._lost:
                return
            # Counted before the flag is visible: whoever sees ``lost`` sees it counted
            # (the watchdog thread marks it while the caller may read both at once).
            self.backend.counters.incr(self.workspace_id, LOCKS_LOST)
            self._lost_detail = detail
            self._lost = True
        log.warning("compute lock %s lost: %s", self.key, detail)


class LockHandle(HeldLock[LockBackend]):
    """One held compute lock: its key and owner token, its ``lost`` flag, its watchdog.

    Use it as a context manager, or call :meth:`release` in a ``finally``. A
    lock found lost (an extend or the release refused by the server) sets
    :attr:`lost`, is counted once as ``locks_lost``, and makes
    :meth:`ensure_held` raise :class:`LockLost`.
    """

    def __init__(
        self,
        backend: LockBackend,
        workspace_id: str,
        job_id: str,
        task: str,
        key: str,
        token: str,
        ttl_ms: int,
    ) -> None:
        super().__init__(backend, workspace_id, job_id, task, key, token, ttl_ms)
        self._watchdog: _Watchdog | None = None

    def extend(self, ttl: float | None = None) -> bool:
        """Reset the TTL to ``ttl`` seconds (the handle's TTL by default); False if lost."""
        ttl_ms = self.ttl_ms if ttl is None else ttl_to_ms(ttl)
        if self.backend.cad_extend(self, ttl_ms):
            return True
        self.mark_lost("extend refused: the lock expired or was taken")
        return False

    def release(self) -> bool:
        """Release if still ours (compare-and-delete); False if it was lost or released already.

        The token is kept until the server answered, so a release that raised
        :class:`LockUnavailable` can be retried.
        """
        self.stop_watchdog()
        with self._state:
            if self._released:
                return False
        held = bool(self.backend.cad_release(self))  # 2: an earlier send of it released it
        with self._state:
            self._released = True
        if not held:
            self.mark_lost("released after it expired or was taken")
        return held

    def start_watchdog(self) -> None:
        """Extend the lock every ttl/3 in a daemon thread until released or lost."""
        if self._watchdog is None:
            self._watchdog = _Watchdog(self)
            self._watchdog.start()

    def stop_watchdog(self) -> None:
        """Stop extending (idempotent)."""
        if self._watchdog is not None:
            self._watchdog.stop()

    # The context-manager protocol (alike by shape everywhere): Python fixes its signature.
    def __enter__(self) -> LockHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
        if exc_type is None:
            self.ensure_held()  # lost while the block ran: say so (portalocker's model)


class AsyncLockHandle(HeldLock[AsyncLockBackend]):
    """:class:`LockHandle` for asyncio: the calls are awaited.

    Use it as ``async with handle:`` or ``await handle.release()`` in a
    ``finally``. Its watchdog is a task on the loop that acquired it.
    """

    def __init__(
        self,
        backend: AsyncLockBackend,
        workspace_id: str,
        job_id: str,
        task: str,
        key: str,
        token: str,
        ttl_ms: int,
    ) -> None:
        super().__init__(backend, workspace_id, job_id, task, key, token, ttl_ms)
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False

    async def extend(self, ttl: float | None = None) -> bool:
        """Reset the TTL to ``ttl`` seconds (the handle's TTL by default); False if lost."""
        ttl_ms = self.ttl_ms if ttl is None else ttl_to_ms(ttl)
        if await self.backend.cad_extend(self, ttl_ms):
            return True
        self.mark_lost("extend refused: the lock expired or was taken")
        return False

    async def release(self) -> bool:
        """Release if still ours (compare-and-delete); False if it was lost or released already.

        The token is kept until the server answered, so a release that raised
        :class:`LockUnavailable` can be retried.
        """
        await self.stop_watchdog()
        if self._released:
            return False
        held = bool(await self.backend.cad_release(self))  # 2: an earlier send released it
        self._released = True
        if not held:
            self.mark_lost("released after it expired or was taken")
        return held

    async def start_watchdog(self) -> None:
        """Extend the lock every ttl/3 in a task until released or lost."""
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(
                self._watch(), name=f"onceflow-lock-watchdog-{self.task[:20]}"
            )

    async def stop_watchdog(self) -> None:
        """Stop extending (idempotent); returns once no extend is in flight."""
        self._stopping = True
        task = self._watchdog
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # never raises: our own cancellation stays ours

    async def _watch(self) -> None:
        # The flag, not only the cancellation, ends the loop: redis-py (8.1) can swallow a
        # cancellation that lands during a command and return its reply instead.
        interval = self.ttl_ms / 3000.0
        while not self._stopping:
            await asyncio.sleep(interval)
            if self._stopping:
                return
            try:
                held = await self.backend.cad_extend(self, self.ttl_ms)
            except LockUnavailable as exc:
                # The backend may answer again before the TTL runs out: keep trying.
                log.warning("compute lock %s: extend failed: %s", self.key, exc)
                continue
            if not held:
                self.mark_lost("watchdog extend refused: the lock expired or was taken")
                return

    # The async context-manager protocol (alike by shape everywhere): Python fixes its signature.
    async def __aenter__(self) -> AsyncLockHandle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()
        if exc_type is None:
            self.ensure_held()  # lost while the block ran: say so


class _Watchdog(threading.Thread):
    """Extends a held lock every ttl/3; on a refused extend, marks the handle lost."""

    def __init__(self, handle: LockHandle) -> None:
        super().__init__(name=f"onceflow-lock-watchdog-{handle.task[:20]}", daemon=True)
        # Not `_handle`: threading.Thread keeps its own `_handle` since Python 3.13.
        self._lock_handle = handle
        self._stop_event = threading.Event()

    def run(self) -> None:
        handle = self._lock_handle
        interval = handle.ttl_ms / 3000.0
        while not self._stop_event.wait(interval):
            try:
                held = handle.backend.cad_extend(handle, handle.ttl_ms)
            except LockUnavailable as exc:
                # The backend may answer again before the TTL runs out: keep trying.
                log.warning("compute lock %s: extend failed: %s", handle.key, exc)
                continue
            if not held:
                handle.mark_lost("watchdog extend refused: the lock expired or was taken")
                return

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=10)


#: The longest lock TTL (as the ``lock_ttl_seconds`` setting's bound): a day.
TTL_MAX_SECONDS = 86_400
#: The shortest lock TTL: one millisecond, the unit Redis keeps it in.
TTL_MIN_SECONDS = 0.001


def ttl_to_ms(ttl: float) -> int:
    """A TTL in seconds as whole milliseconds.

    A caller's mistake is an :class:`InvalidRequest` (never retried), raised before any
    call to the backend: not a number (``True`` included), not finite, under
    :data:`TTL_MIN_SECONDS` or over :data:`TTL_MAX_SECONDS` (before: ``1e16`` reached
    Redis and came back as a retryable "Redis unavailable", ``True`` was a one-second
    lock, and ``1e-9`` was taken as a 1 ms lock: an extend that "held" it let the next
    acquire in at once)."""
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not TTL_MIN_SECONDS <= ttl <= TTL_MAX_SECONDS  # NaN fails this too
    ):
        raise InvalidRequest(
            f"a lock TTL must be a number of seconds in [{TTL_MIN_SECONDS:g}, "
            f"{TTL_MAX_SECONDS}], got {ttl!r}"
        )
    return max(1, round(ttl * 1000))
