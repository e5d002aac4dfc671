"""``acompute_once``: the compute lock for asyncio, on the protocol :func:`compute_once` runs.

Both APIs drive one implementation, :func:`onceflow.locks.protocol.protocol_steps`
(see :mod:`onceflow.locks.steps`): the same pre-flight, acquire, wait for the
``lock_released`` broadcast, double-check, compute, store retrying, release and
announce, counted by the same counters, with the same outcomes. Only the calls
differ: here they are awaited on an :class:`~onceflow.locks.base.AsyncLockBackend`
(:class:`~onceflow.locks.redis_async.AsyncRedisLockBackend`, redis.asyncio), and
``check``, ``compute``, ``store`` and ``on_wait`` may be coroutine functions.

Plain callables are called in place, on the event loop: one that blocks (a
sync HTTP call, a sync database query) blocks the loop, and the watchdog with
it, for as long as it runs. Give blocking work to ``asyncio.to_thread``.

The watchdog of an :class:`~onceflow.locks.base.AsyncLockHandle` is a task on the caller's loop. A
sync holder and an async waiter (or the reverse) share a cell's lock: the keys,
tokens and broadcasts are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal, TypeAlias, TypeVar, overload

from onceflow import tracing
from onceflow.errors import InvalidRequest
from onceflow.locks import spans
from onceflow.locks.base import AsyncLockBackend, AsyncLockHandle, BackendOptions, backend_options
from onceflow.locks.protocol import Locked, Outcome, protocol_steps
from onceflow.locks.steps import run_async
from onceflow.loops import PerLoop, drop_redis_sockets
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.locks")

T = TypeVar("T")


MaybeAwaitable: TypeAlias = T | Awaitable[T]


# acompute_once's overloads (alike by shape with compute_once's): one per ``wait`` literal.
@overload
async def acompute_once(
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], MaybeAwaitable[T | None]],
    compute: Callable[[], MaybeAwaitable[T]],
    store: Callable[[T], object],
    wait: Literal[True] = True,
    ttl: float | None = None,
    watchdog: bool | None = None,
    backend: AsyncLockBackend | None = None,
    on_wait: Callable[[], object] | None = None,
) -> Outcome[T]: ...
@overload
async def acompute_once(
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], MaybeAwaitable[T | None]],
    compute: Callable[[], MaybeAwaitable[T]],
    store: Callable[[T], object],
    wait: bool,
    ttl: float | None = None,
    watchdog: bool | None = None,
    backend: AsyncLockBackend | None = None,
    on_wait: Callable[[], object] | None = None,
) -> Outcome[T] | Locked: ...
async def acompute_once(
    workspace_id: str,
    job_id: str,
    task: str,
    *,
    check: Callable[[], MaybeAwaitable[T | None]],
    compute: Callable[[], MaybeAwaitable[T]],
    store: Callable[[T], object],
    wait: bool = True,
    ttl: float | None = None,
    watchdog: bool | None = None,
    backend: AsyncLockBackend | None = None,
    on_wait: Callable[[], object] | None = None,
) -> Outcome[T] | Locked:
    """:func:`~onceflow.locks.compute_once` for asyncio: the same protocol, awaited.

    ``check``, ``compute``, ``store`` and ``on_wait`` may be coroutine functions
    or plain callables (called on the loop). ``backend`` defaults to
    :func:`get_async_backend` (this loop's). Cancelling the caller releases the
    lock and announces ``ok: false`` before the cancellation propagates.
    """
    steps = protocol_steps(
        workspace_id, job_id, task, check, compute, store, wait, ttl, watchdog,
        backend, get_async_backend, on_wait,
    )  # fmt: skip
    if tracing.active():
        steps = spans.traced(steps)
    return await run_async(steps)


_ByUrl: TypeAlias = dict[tuple[str, BackendOptions], AsyncLockBackend]


def _drop_backends(backends: _ByUrl) -> None:
    for backend in backends.values():
        drop_redis_sockets(getattr(backend, "client", None))


# Per loop, Redis URL and lock options, pruned of closed loops (their sockets shut): a weak
# table kept every backend (a redis.asyncio client holds its loop).
_async_backends: PerLoop[_ByUrl] = PerLoop(_drop_backends)


def get_async_backend(settings: Settings | None = None) -> AsyncLockBackend:
    """The running loop's async backend for ``redis_url`` of ``settings`` (the environment's
    if None): made lazily, one per loop, shared by every caller whose settings name the same
    URL and lock options.

    A redis.asyncio connection belongs to the loop that opened it, so each loop
    gets its own backend; it goes with the loop. Only ``lock_backend="redis"``
    has an async backend: with ``"sql"`` this raises :class:`InvalidRequest`.
    """
    settings = settings or get_settings()
    if settings.lock_backend != "redis":
        raise InvalidRequest(
            f"acompute_once needs lock_backend='redis' (it is {settings.lock_backend!r}); "
            "the SQL lock backend is sync-only: use compute_once"
        )
    mine = _async_backends.get()
    if mine is None:
        mine = _async_backends.setdefault(dict)
    key = (settings.redis_url, backend_options(settings))
    backend = mine.get(key)
    if backend is None:
        from onceflow.locks.redis_async import AsyncRedisLockBackend

        backend = AsyncRedisLockBackend(settings.redis_url, settings=settings)
        backend = mine.setdefault(key, backend)
    return backend


__all__ = ["AsyncLockHandle", "MaybeAwaitable", "acompute_once", "get_async_backend"]
