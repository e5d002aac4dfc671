"""The Redis compute lock on redis.asyncio: :class:`RedisLockBackend`'s calls, awaited.

The same key, token, ``SET NX PX``, ``release.lua`` / ``extend.lua``, channel,
``lock_released`` message and counters hash as the sync backend, so sync and
async callers share every cell's lock. A redis.asyncio client belongs to the
event loop it first connects on: build one backend per loop
(:func:`onceflow.locks.aio.get_async_backend` does), and close it with
:meth:`AsyncRedisLockBackend.aclose` (or ``async with``) when it is yours.

``redis_url`` may name a Redis Cluster (``redis.asyncio``'s cluster client; see
:class:`~onceflow.locks.redis_lock.RedisLockBackend` for what runs where). Every redis-py
error (:data:`~onceflow.redis_clients.REDIS_ERRORS`) is translated to
:class:`LockUnavailable` here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from types import TracebackType
from typing import Any

import redis
import redis.asyncio

from onceflow.errors import LockUnavailable
from onceflow.keys import counters_key, lock_key, workspace_channel
from onceflow.locks.base import (
    SUBSCRIPTION_ENDED,
    AsyncLockHandle,
    HeldLock,
    Message,
    parse_message,
    released_message,
    ttl_to_ms,
)
from onceflow.locks.counters import (
    Counters,
    Increment,
    by_node,
    parse_hash,
    queue_group,
    restore_failed,
    send_groups,
)
from onceflow.locks.redis_lock import (
    ACQUIRE_TRACED,
    EXTEND,
    REAP_UNTIMED,
    RELEASE,
    Lua,
    holder_key,
    holds_token,
    mark_ms,
    note_config_refused,
    release_mark,
    script_keys,
    warn_on_eviction_policy,
)
from onceflow.locks.steps import run_async
from onceflow.redis_clients import (
    PLAIN,
    REDIS_ERRORS,
    REDIS_OR_OS_ERRORS,
    SHARDED,
    AsyncRedis,
    Kinds,
    async_client,
    is_cluster,
    node_client,
    node_namer,
    publish,
    shard_node,
)
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.locks")


def _unavailable(what: str, exc: Exception) -> LockUnavailable:
    return LockUnavailable(f"Redis unavailable ({what}): {exc}")


class AsyncRedisLockBackend:
    """Compute locks in Redis, for asyncio. One per event loop.

    ``client`` is a ``redis.asyncio.Redis`` (or its ``RedisCluster``) or a URL (default:
    ``redis_url``, see :mod:`onceflow.redis_clients`), with socket timeouts of
    ``lock_timeout_seconds``. ``counters`` may be shared
    with a sync backend of the same process, so both APIs count in one place.
    """

    name = "redis"

    def __init__(
        self,
        client: AsyncRedis | str | None = None,
        *,
        settings: Settings | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        if client is None or isinstance(client, str):
            timeout = self.settings.lock_timeout_seconds
            client = async_client(client or self.settings.redis_url, timeout=timeout, retries=1)
        self.client = client
        #: A Redis Cluster: broadcasts are sharded (``SPUBLISH``/``SSUBSCRIBE``).
        self.sharded = is_cluster(client)
        self.counters = counters if counters is not None else Counters()
        self._policy_checked = False

    async def aclose(self) -> None:
        """Close the client's connections.

        Pending counter increments stay pending (as with the sync backend, they ride on
        the next round trip): :meth:`flush_counters` sends them.
        """
        await self.client.aclose()

    async def __aenter__(self) -> AsyncRedisLockBackend:
        return self

    # The async context-manager protocol (alike by shape everywhere): Python fixes its signature.
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # AsyncLockBackend.acquire's signature (alike by shape in every backend): the protocol's.
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
        """``SET key token NX PX ttl`` (then, if refused, ``GET``: a resend of this call's own
        SET finds its token): a handle if taken now, None if someone else holds it.
        ``holder``: as :meth:`RedisLockBackend.acquire`."""
        key = lock_key(workspace_id, job_id, task)
        ttl_ms = ttl_to_ms(self.settings.lock_ttl_seconds if ttl is None else ttl)
        token = secrets.token_hex(16)
        if not self._policy_checked:
            await self._check_eviction_policy()
        try:
            if holder is not None:
                also = holder_key(key)
                taken: Any = bool(
                    await self._run(ACQUIRE_TRACED, key, token, ttl_ms, holder, also=also)
                )
            else:
                taken = await self.client.set(key, token, nx=True, px=ttl_ms)
                taken = taken or await self._resent(key, token)
        except REDIS_ERRORS as exc:
            raise _unavailable("acquire", exc) from exc
        if not taken:
            return None
        handle = AsyncLockHandle(self, workspace_id, job_id, task, key, token, ttl_ms)
        if watchdog:
            await handle.start_watchdog()
        return handle

    async def _resent(self, key: str, token: str) -> bool:
        """As :meth:`RedisLockBackend._resent`."""
        try:
            return holds_token(await self.client.get(key), token)
        except redis.exceptions.ResponseError:
            return False

    async def cad_release(self, handle: HeldLock[Any]) -> int:
        """``release.lua``: delete the key only if it still holds the handle's token."""
        try:
            lifetime = mark_ms(self.settings.lock_timeout_seconds)
            also = (release_mark(handle.key), holder_key(handle.key))
            return int(await self._run(RELEASE, handle.key, handle.token, lifetime, also=also))
        except REDIS_ERRORS as exc:
            raise _unavailable("release", exc) from exc

    async def cad_extend(self, handle: HeldLock[Any], ttl_ms: int) -> bool:
        """``extend.lua``: reset the TTL only if the key still holds the handle's token."""
        try:
            also = holder_key(handle.key)
            return bool(await self._run(EXTEND, handle.key, handle.token, ttl_ms, also=also))
        except REDIS_ERRORS as exc:
            raise _unavailable("extend", exc) from exc

    async def _run(
        self, script: Lua, key: str, *args: str | int, also: str | tuple[str, ...] = ()
    ) -> Any:
        # As RedisLockBackend._run: EVALSHA, and EVAL on the key's node on NOSCRIPT.
        text, sha = script
        keys = script_keys(key, also)
        try:
            return await self.client.evalsha(sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return await self.client.eval(text, len(keys), *keys, *args)

    async def remaining_ms(self, workspace_id: str, job_id: str, task: str) -> int | None:
        """``PTTL`` of the cell's lock; None when no lock exists (a key with no TTL is reaped)."""
        key = lock_key(workspace_id, job_id, task)
        try:
            pttl = int(await self.client.pttl(key))
            if pttl == -1:  # not a lock (see RedisLockBackend.remaining_ms): delete it
                if await self._run(REAP_UNTIMED, key):
                    log.error("compute lock %r held a value with no TTL (not a lock): deleted", key)
                return None
        except REDIS_ERRORS as exc:
            raise _unavailable("pttl", exc) from exc
        return None if pttl == -2 else pttl

    async def holder_of(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """As :meth:`RedisLockBackend.holder_of`."""
        try:
            value = await self.client.get(holder_key(lock_key(workspace_id, job_id, task)))
        except REDIS_ERRORS as exc:
            raise _unavailable("get", exc) from exc
        return value.decode() if isinstance(value, bytes) else value

    async def owner_token(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The token in the cell's lock key, or None."""
        try:
            value = await self.client.get(lock_key(workspace_id, job_id, task))
        except REDIS_ERRORS as exc:
            raise _unavailable("get", exc) from exc
        return value.decode() if isinstance(value, bytes) else value

    async def subscribe(self, workspace_id: str) -> AsyncRedisSubscription:
        """``SUBSCRIBE`` (a cluster: ``SSUBSCRIBE``) to the workspace's channel; returns once
        Redis confirmed it."""
        sub = AsyncRedisSubscription(self.client, workspace_channel(workspace_id))
        try:
            await sub.confirm(self.settings.lock_timeout_seconds)
        except BaseException:
            await sub.close()
            raise
        return sub

    async def announce(self, handle: HeldLock[Any], *, ok: bool) -> None:
        """One pipelined round trip: ``PUBLISH`` lock_released, plus pending counters.

        On a Redis Cluster, as :meth:`RedisLockBackend.announce`: the workspace's node first
        (``SPUBLISH`` and its counters), then one pipeline per other node; a failed counter
        stays pending, only a failed broadcast raises.
        """
        message = json.dumps(released_message(handle.job_id, handle.task, ok=ok))
        channel = workspace_channel(handle.workspace_id)
        pending = self.counters.take_pending()
        client = self.client
        try:
            if self.sharded:
                await client.initialize()
            node_of = node_namer(client)
            groups = by_node(pending, node_of)
            first = groups.pop(node_of(channel), [])
            pipe = client.pipeline(transaction=False)
            publish(pipe, self.sharded, channel, message)
            queue_group(pipe, first)
            replies = await pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            self.counters.restore_pending(pending)
            raise _unavailable("publish", exc) from exc
        except BaseException:
            self.counters.restore_pending(pending)
            raise
        restore_failed(self.counters, first, replies[1:])
        await self._send(groups)
        if isinstance(replies[0], Exception):
            raise _unavailable("publish", replies[0])

    async def flush_counters(self) -> None:
        """Send pending increments (``HINCRBY``, one pipelined round trip per Redis node);
        kept on failure."""
        pending = self.counters.take_pending()
        if not pending:
            return
        try:
            if self.sharded:
                await self.client.initialize()
            groups = by_node(pending, node_namer(self.client))
        except REDIS_ERRORS as exc:
            self.counters.restore_pending(pending)
            log.debug("compute-lock counters not flushed: %s", exc)
            return
        except BaseException:
            self.counters.restore_pending(pending)
            raise
        await self._send(groups)

    async def _send(self, groups: dict[str, list[Increment]]) -> None:
        await run_async(send_groups(self.client, self.counters, groups))

    async def workspace_counters(self, workspace_id: str) -> dict[str, int]:
        """``HGETALL`` of the workspace's counters: every process's flushed increments."""
        try:
            raw = await self.client.hgetall(counters_key(workspace_id))
        except REDIS_ERRORS as exc:
            raise _unavailable("counters", exc) from exc
        return parse_hash(raw)

    async def _check_eviction_policy(self) -> None:
        try:
            reply = await self.client.config_get("maxmemory-policy")
        except redis.ResponseError as exc:
            note_config_refused(exc)
            self._policy_checked = True
            return
        except REDIS_ERRORS:
            return  # not reachable now; the acquire says so, and we check again next time
        warn_on_eviction_policy(reply)
        self._policy_checked = True


class AsyncRedisSubscription:
    """A confirmed ``SUBSCRIBE`` to one channel on its own connection (redis.asyncio).

    On a Redis Cluster: ``SSUBSCRIBE`` on a connection of its own to the primary of the
    channel's slot (redis-py's ``ClusterPubSub`` would re-subscribe silently after a
    failure; see :mod:`onceflow.redis_clients`).
    """

    def __init__(self, client: AsyncRedis, channel: str) -> None:
        self._client = client
        self._channel = channel
        self._pubsub: Any = None
        self._node_client: redis.asyncio.Redis | None = None  # ours to close (a cluster's)
        self._kinds: Kinds | None = None

    async def confirm(self, timeout: float) -> None:
        """``SUBSCRIBE`` and wait for Redis to confirm it (every later publish then reaches us)."""
        try:
            node = await shard_node(self._client, self._channel)
            kinds = PLAIN if node is None else SHARDED
            self._kinds = kinds
            if node is None:
                self._pubsub = self._client.pubsub()
            else:
                self._node_client = node_client(node)
                self._pubsub = self._node_client.pubsub()
            if kinds is SHARDED:
                await self._pubsub.ssubscribe(self._channel)
            else:
                await self._pubsub.subscribe(self._channel)
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LockUnavailable(f"Redis did not confirm SUBSCRIBE {self._channel}")
                reply = await self._pubsub.get_message(timeout=remaining)
                if reply is not None and reply["type"] == kinds.subscribe:
                    return
        except REDIS_ERRORS as exc:
            raise _unavailable("subscribe", exc) from exc

    async def wait(self, timeout: float) -> Message | None:
        """As :meth:`RedisSubscription.wait` (``SUBSCRIPTION_ENDED`` when the server ended it)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                reply = await self._pubsub.get_message(timeout=remaining)
            except REDIS_ERRORS as exc:
                raise _unavailable("wait", exc) from exc
            if reply is None or self._kinds is None:
                continue
            if reply["type"] == self._kinds.message:
                return parse_message(reply["data"])
            if reply["type"] == self._kinds.unsubscribe:
                return SUBSCRIPTION_ENDED  # the server ended it (a cluster slot moved)

    async def close(self) -> None:
        """Unsubscribe by closing the connection (errors ignored: it may be dead already)."""
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_OR_OS_ERRORS):
                await self._pubsub.aclose()
        if self._node_client is not None:
            with contextlib.suppress(*REDIS_OR_OS_ERRORS):
                await self._node_client.aclose()
