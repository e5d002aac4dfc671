"""Layer 2: the compute lock — N callers racing one expensive call pay for it once.

The protocol per call (pre-flight, acquire, double-check, compute,
store, release) is :func:`compute_once` (for asyncio: :func:`acompute_once`, on
:class:`AsyncRedisLockBackend`); its waiters are woken by a broadcast on
the workspace's channel, never by polling. Locks live in Redis
(:class:`RedisLockBackend`, ``SET NX PX`` with owner-checked Lua release) or in
Postgres (:class:`SqlLockBackend`, the ``compute_locks`` table), chosen by the
``lock_backend`` setting. It is an efficiency lock: it never deadlocks, never
deletes another owner's lock, and counts every call it saved; the correctness of
a stored result is layer 3's job. See ``docs/locks.md``.
"""

from onceflow.errors import LockLost, LockUnavailable
from onceflow.locks.aio import acompute_once, get_async_backend
from onceflow.locks.base import (
    AsyncLockBackend,
    AsyncLockHandle,
    AsyncSubscription,
    LockBackend,
    LockHandle,
    Subscription,
)
from onceflow.locks.counters import COUNTER_NAMES, Counters, calls_saved
from onceflow.locks.once import compute_once
from onceflow.locks.protocol import Locked, Outcome, Path, get_backend
from onceflow.locks.redis_async import AsyncRedisLockBackend
from onceflow.locks.redis_lock import RedisLockBackend, redis_client
from onceflow.locks.sql_lock import SqlLockBackend

__all__ = [
    "COUNTER_NAMES",
    "AsyncLockBackend",
    "AsyncLockHandle",
    "AsyncRedisLockBackend",
    "AsyncSubscription",
    "Counters",
    "LockBackend",
    "LockHandle",
    "LockLost",
    "LockUnavailable",
    "Locked",
    "Outcome",
    "Path",
    "RedisLockBackend",
    "SqlLockBackend",
    "Subscription",
    "acompute_once",
    "calls_saved",
    "compute_once",
    "get_async_backend",
    "get_backend",
    "redis_client",
]
