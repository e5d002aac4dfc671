"""The Redis compute lock: ``SET key token NX PX ttl``, owner-checked Lua release and extend;
a resent acquire or release (its reply lost, the command resent) answers as the first did.

The key is ``onceflow:{<workspace_id>}:lock:<job_id>:<task>`` (:func:`onceflow.keys.lock_key`):
the workspace is a Redis Cluster hash tag, so a workspace's locks, its broadcast
channel and its counters share a slot. Redis expires the key itself, so a
crashed holder blocks nobody past the TTL and no client clock is ever compared.
``release.lua`` and ``extend.lua`` ship beside this module and are registered
by their SHA1 (``EVALSHA``; on ``NOSCRIPT``, a restarted or new node, ``EVAL`` of the
text: one round trip to the key's node, which caches it). Not ``SCRIPT LOAD``: on a
cluster that goes to every primary, and one node down would fail every release.

While tracing is on, an acquire also keeps the holder's trace context beside the lock
(``acquire_traced.lua``, the same round trip; :func:`holder_key`, with the lock's TTL,
extended and deleted with it), for a waiter's span to link to the holder's.

``redis_url`` may name a Redis Cluster (``redis+cluster://…``, see
:mod:`onceflow.redis_clients`): every command of a lock names one key, so it goes to the
node of the workspace's slot; the ``lock_released`` broadcast is a sharded ``SPUBLISH``
on that slot, and waiters ``SSUBSCRIBE`` on its primary. A node that is down fails the
locks of its own workspaces (:class:`LockUnavailable`), no other workspace's.

Every redis-py error (:data:`~onceflow.redis_clients.REDIS_ERRORS`) is translated to
:class:`LockUnavailable` here; none reaches stage code. At first use the backend reads
``maxmemory-policy`` and warns when Redis may evict keys with a TTL (an evicted lock is a
lock lost); a server that refuses ``CONFIG`` is noted at INFO and used anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from onceflow.errors import LockUnavailable
from onceflow.keys import counters_key, lock_key, workspace_channel
from onceflow.locks.base import (
    SUBSCRIPTION_ENDED,
    LockHandle,
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
from onceflow.locks.steps import run_sync
from onceflow.redis_clients import (
    REDIS_ERRORS,
    REDIS_OR_OS_ERRORS,
    SyncRedis,
    channel_pubsub,
    is_cluster,
    node_namer,
    publish,
    sync_client,
)
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.locks")

RELEASE_LUA = files("onceflow.locks").joinpath("release.lua").read_text()
EXTEND_LUA = files("onceflow.locks").joinpath("extend.lua").read_text()
ACQUIRE_TRACED_LUA = files("onceflow.locks").joinpath("acquire_traced.lua").read_text()

_clients: dict[tuple[str, float, int], SyncRedis] = {}
_clients_lock = threading.Lock()


#: Delete a key that has no TTL (never one of onceflow's locks); 1 if it did.
REAP_UNTIMED_LUA = """
if redis.call('pttl', KEYS[1]) == -1 then
    redis.call('del', KEYS[1])
    return 1
end
return 0
"""

#: A Lua script: (text, SHA1 of the text), run by ``EVALSHA`` with ``EVAL`` on ``NOSCRIPT``.
Lua = tuple[str, str]


def lua(text: str) -> Lua:
    """A script and its SHA1 (the name ``EVALSHA`` calls it by)."""
    return text, hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


RELEASE = lua(RELEASE_LUA)
EXTEND = lua(EXTEND_LUA)
ACQUIRE_TRACED = lua(ACQUIRE_TRACED_LUA)
REAP_UNTIMED = lua(REAP_UNTIMED_LUA)


def holds_token(held: bytes | str | None, token: str) -> bool:
    """Whether a lock key's value is ``token`` (bytes or text, as the client decodes)."""
    return held is not None and (held.decode() if isinstance(held, bytes) else held) == token


def release_mark(key: str) -> str:
    """The key ``release.lua`` marks a release with (the lock key's hash slot; no lock key
    can end so: a key part's colons are escaped)."""
    return f"{key}:released"


def holder_key(key: str) -> str:
    """The key beside a lock that keeps its holder's trace context (``acquire_traced.lua``
    writes it, ``extend.lua`` extends it, ``release.lua`` deletes it): the lock key's hash
    slot, and no lock key can end so (a key part's colons are escaped)."""
    return f"{key}:holder"


def script_keys(key: str, also: str | tuple[str, ...]) -> tuple[str, ...]:
    """A script's keys: ``key``, then ``also`` (one key or several)."""
    return (key, also) if isinstance(also, str) else (key, *also)


def mark_ms(timeout: float) -> int:
    """How long a release mark lives: well past a resent release (the socket timeout, at
    most twice, as the client retries once), at least a second."""
    return max(1000, round(4 * timeout * 1000))


def redis_client(url: str | None = None, *, timeout: float | None = None) -> SyncRedis:
    """This process's Redis client for ``url`` (made lazily, again after a fork).

    Socket timeouts bound every call (``lock_timeout_seconds``); one immediate
    retry lets a pooled connection that died with a restarted server reconnect.
    A cluster URL gives a ``RedisCluster``, which reads the topology when it is made:
    a redis-py error here (:data:`~onceflow.redis_clients.REDIS_ERRORS`) leaves nothing
    cached, and the next call tries again.
    """
    settings = get_settings()
    url = url or settings.redis_url
    timeout = settings.lock_timeout_seconds if timeout is None else timeout
    key = (url, timeout, os.getpid())
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = sync_client(url, timeout=timeout, retries=1)
                _clients[key] = client
    return client


@contextmanager
def translate_redis_errors(what: str) -> Iterator[None]:
    """Any redis-py error becomes :class:`LockUnavailable` (ours pass through)."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise _unavailable(what, exc) from exc


def _unavailable(what: str, exc: Exception) -> LockUnavailable:
    return LockUnavailable(f"Redis unavailable ({what}): {exc}")


class RedisLockBackend:
    """Compute locks in Redis. Thread-safe; one per process (see :func:`get_backend`)."""

    name = "redis"

    def __init__(
        self, client: SyncRedis | str | None = None, *, settings: Settings | None = None
    ) -> None:
        self.settings = settings or get_settings()
        self.counters = Counters()
        self._policy_checked = False
        self._url = (client if isinstance(client, str) else None) or self.settings.redis_url
        self._client: SyncRedis | None = None
        self._client_lock = threading.Lock()
        #: A Redis Cluster: broadcasts are sharded (``SPUBLISH``/``SSUBSCRIBE``).
        self.sharded = False
        if client is not None and not isinstance(client, str):
            self._use(client)

    def _use(self, client: SyncRedis) -> None:
        self.sharded = is_cluster(client)
        self._client = client

    @property
    def client(self) -> SyncRedis:
        """The Redis client (made at first use: a cluster client connects when it is made).

        :class:`LockUnavailable` when a cluster's startup nodes cannot be reached.
        """
        client = self._client
        if client is None:
            with self._client_lock:
                client = self._client
                if client is None:
                    with translate_redis_errors("connect"):
                        client = redis_client(self._url)
                    self._use(client)
        return client

    # LockBackend.acquire's signature (alike by shape in every backend): the protocol's.
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
        """``SET key token NX PX ttl`` (then, if refused, ``GET``: a resend of this call's own
        SET finds its token): a handle if taken now, None if someone else holds it.

        ``holder``: the caller's trace context (:func:`onceflow.tracing.carrier_of`), kept
        beside the lock for as long as it is held (:func:`holder_key`) so that waiters can
        link to the holder's span; taken and written in one round trip
        (``acquire_traced.lua``)."""
        key = lock_key(workspace_id, job_id, task)
        ttl_ms = ttl_to_ms(self.settings.lock_ttl_seconds if ttl is None else ttl)
        token = secrets.token_hex(16)
        if not self._policy_checked:
            self._check_eviction_policy()
        try:  # inline rather than a context manager: this is the hot path
            if holder is not None:
                also = holder_key(key)
                taken: Any = bool(self._run(ACQUIRE_TRACED, key, token, ttl_ms, holder, also=also))
            else:
                taken = self.client.set(key, token, nx=True, px=ttl_ms)
                # Refused: taken by someone else — or by this very call, when the client
                # resent a SET whose reply was lost (redis-py resends once). Our own token: ours.
                taken = taken or self._resent(key, token)
        except REDIS_ERRORS as exc:
            raise _unavailable("acquire", exc) from exc
        if not taken:
            return None
        handle = LockHandle(self, workspace_id, job_id, task, key, token, ttl_ms)
        if watchdog:
            handle.start_watchdog()
        return handle

    def _resent(self, key: str, token: str) -> bool:
        """Whether a refused acquire was refused by its own earlier send (``key`` holds
        ``token``). A value of another type there (``WRONGTYPE``) is nobody's lock."""
        try:
            return holds_token(self.client.get(key), token)
        except redis.exceptions.ResponseError:
            return False

    def cad_release(self, handle: LockHandle) -> int:
        """``release.lua``: delete the key only if it still holds the handle's token."""
        try:
            lifetime = mark_ms(self.settings.lock_timeout_seconds)
            also = (release_mark(handle.key), holder_key(handle.key))
            return int(self._run(RELEASE, handle.key, handle.token, lifetime, also=also))
        except REDIS_ERRORS as exc:
            raise _unavailable("release", exc) from exc

    def cad_extend(self, handle: LockHandle, ttl_ms: int) -> bool:
        """``extend.lua``: reset the TTL only if the key still holds the handle's token."""
        try:
            also = holder_key(handle.key)
            return bool(self._run(EXTEND, handle.key, handle.token, ttl_ms, also=also))
        except REDIS_ERRORS as exc:
            raise _unavailable("extend", exc) from exc

    def _run(
        self, script: Lua, key: str, *args: str | int, also: str | tuple[str, ...] = ()
    ) -> Any:
        # EVALSHA straight away (one round trip, no per-call bookkeeping); on NOSCRIPT (a
        # restarted, failed-over or new node) EVAL of the text, on the key's node alone.
        # ``also``: more keys in the same hash slot (release.lua's mark, the holder key).
        client = self.client
        text, sha = script
        keys = script_keys(key, also)
        try:
            return client.evalsha(sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(text, len(keys), *keys, *args)

    def remaining_ms(self, workspace_id: str, job_id: str, task: str) -> int | None:
        """``PTTL`` of the cell's lock; None when no lock exists."""
        with translate_redis_errors("pttl"):
            pttl = int(self.client.pttl(lock_key(workspace_id, job_id, task)))
        if pttl == -2:
            return None
        if pttl == -1:
            # onceflow writes a lock only with SET NX PX: a key here without a TTL (a
            # list LPUSHed there, a SET without PX) is not a lock and would never expire,
            # so every waiter would wait forever. Delete it — atomically, only while it
            # still has no TTL — and report the cell free, so the caller acquires now.
            key = lock_key(workspace_id, job_id, task)
            with translate_redis_errors("reap"):
                reaped = self._run(REAP_UNTIMED, key)
            if reaped:
                log.error("compute lock %r held a value with no TTL (not a lock): deleted", key)
            return None
        return pttl

    def holder_of(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The trace context the cell's holder kept beside its lock (see :meth:`acquire`),
        or None: one ``GET``, asked only while tracing is on."""
        with translate_redis_errors("get"):
            value = self.client.get(holder_key(lock_key(workspace_id, job_id, task)))
        return value.decode() if isinstance(value, bytes) else value

    def owner_token(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The token in the cell's lock key, or None."""
        with translate_redis_errors("get"):
            value = self.client.get(lock_key(workspace_id, job_id, task))
        return value.decode() if isinstance(value, bytes) else value

    def subscribe(self, workspace_id: str) -> RedisSubscription:
        """``SUBSCRIBE`` (a cluster: ``SSUBSCRIBE``) to the workspace's channel; returns once
        Redis confirmed it."""
        channel = workspace_channel(workspace_id)
        return RedisSubscription(self.client, channel, self.settings.lock_timeout_seconds)

    def announce(self, handle: LockHandle, *, ok: bool) -> None:
        """One pipelined round trip: ``PUBLISH`` lock_released, plus pending counters.

        On a Redis Cluster the round trip goes to the workspace's node: ``SPUBLISH`` and
        the counters whose keys live there; pending counters of other nodes follow, one
        pipeline per node. A counter whose node failed stays pending; only a failed
        broadcast raises :class:`LockUnavailable`.
        """
        message = json.dumps(released_message(handle.job_id, handle.task, ok=ok))
        channel = workspace_channel(handle.workspace_id)
        pending = self.counters.take_pending()
        try:
            client = self.client
            node_of = node_namer(client)
            groups = by_node(pending, node_of)
            first = groups.pop(node_of(channel), [])
            pipe = client.pipeline(transaction=False)
            publish(pipe, self.sharded, channel, message)
            queue_group(pipe, first)
            replies = pipe.execute(raise_on_error=False)
        except REDIS_ERRORS as exc:
            self.counters.restore_pending(pending)
            raise _unavailable("publish", exc) from exc
        except BaseException:
            self.counters.restore_pending(pending)
            raise
        restore_failed(self.counters, first, replies[1:])
        self._send(client, groups)
        if isinstance(replies[0], Exception):
            raise _unavailable("publish", replies[0])

    def flush_counters(self) -> None:
        """Send pending increments (``HINCRBY``, one pipelined round trip per Redis node);
        kept on failure."""
        pending = self.counters.take_pending()
        if not pending:
            return
        try:
            client = self.client
            groups = by_node(pending, node_namer(client))
        except (LockUnavailable, redis.RedisError, RedisClusterException) as exc:
            self.counters.restore_pending(pending)
            log.debug("compute-lock counters not flushed: %s", exc)
            return
        self._send(client, groups)

    def _send(self, client: SyncRedis, groups: dict[str, list[Increment]]) -> None:
        run_sync(send_groups(client, self.counters, groups))

    def workspace_counters(self, workspace_id: str) -> dict[str, int]:
        """``HGETALL`` of the workspace's counters: every process's flushed increments."""
        with translate_redis_errors("counters"):
            raw = self.client.hgetall(counters_key(workspace_id))
        return parse_hash(raw)

    def _check_eviction_policy(self) -> None:
        try:
            reply = self.client.config_get("maxmemory-policy")
        except redis.ResponseError as exc:
            note_config_refused(exc)
            self._policy_checked = True
            return
        except (LockUnavailable, redis.RedisError, RedisClusterException):
            return  # not reachable now; the acquire says so, and we check again next time
        warn_on_eviction_policy(reply)
        self._policy_checked = True


def note_config_refused(exc: redis.ResponseError) -> None:
    """``CONFIG`` renamed away or denied by an ACL (managed Redis often does this): INFO."""
    log.info(
        "compute locks: could not read Redis maxmemory-policy (%s); make sure keys "
        "with a TTL are never evicted",
        exc,
    )


def warn_on_eviction_policy(reply: Any) -> None:
    """Warn when ``CONFIG GET maxmemory-policy`` says Redis may evict keys with a TTL."""
    policy = _text(dict(reply).get("maxmemory-policy"))
    if policy and policy != "noeviction":
        log.warning(
            "compute locks: Redis maxmemory-policy is %r, which can evict keys with a "
            "TTL under memory pressure; an evicted lock lets a second caller pay for the "
            "same call. Use 'noeviction' (or a Redis of its own) for onceflow.",
            policy,
        )


class RedisSubscription:
    """A confirmed ``SUBSCRIBE`` to one channel on its own connection.

    On a Redis Cluster: ``SSUBSCRIBE`` on a connection to the primary of the channel's slot.
    """

    def __init__(self, client: SyncRedis, channel: str, timeout: float) -> None:
        with translate_redis_errors("subscribe"):
            self._pubsub, self._kinds = channel_pubsub(client, channel)
        try:
            with translate_redis_errors("subscribe"):
                if self._kinds.subscribe == "ssubscribe":
                    self._pubsub.ssubscribe(channel)
                else:
                    self._pubsub.subscribe(channel)
                # Only after Redis confirmed is every later publish guaranteed to reach us:
                # the caller re-checks the store after this returns (subscribe first).
                deadline = time.monotonic() + timeout
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise LockUnavailable(f"Redis did not confirm SUBSCRIBE {channel}")
                    reply = self._pubsub.get_message(timeout=remaining)
                    if reply is not None and reply["type"] == self._kinds.subscribe:
                        break
        except BaseException:
            self.close()
            raise

    def wait(self, timeout: float) -> Message | None:
        """The next published message, or None once ``timeout`` seconds passed.

        :data:`~onceflow.locks.base.SUBSCRIPTION_ENDED` at once when the server ends the
        subscription (a cluster slot that moved to another node): the caller subscribes
        anew (this one will never deliver again).
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with translate_redis_errors("wait"):
                reply = self._pubsub.get_message(timeout=remaining)
            if reply is None:
                continue
            if reply["type"] == self._kinds.message:
                return parse_message(reply["data"])
            if reply["type"] == self._kinds.unsubscribe:
                return SUBSCRIPTION_ENDED

    def close(self) -> None:
        """Unsubscribe by closing the connection (errors ignored: it may be dead already)."""
        with contextlib.suppress(*REDIS_OR_OS_ERRORS):
            self._pubsub.close()


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)
