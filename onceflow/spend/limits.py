"""Provider limits in Redis: requests and tokens per window, concurrency, cooling after a 429.

Every process that calls a provider shares one state in Redis, so the limits hold across
workers, agents and standalone scripts, and every decision is taken by one Lua script on
the Redis clock (``redis.call('TIME')``), never a worker's. The scripts ship beside this
module (``acquire.lua``, ``settle.lua``, ``cool.lua``, ``abandon.lua``) and run by SHA1
(``EVALSHA``, ``EVAL`` of the text on ``NOSCRIPT``).

The algorithm is an exact sliding log: a sorted set of the permits granted within the last
window (scored by their grant time) and each one's tokens, with running sums. It was
measured against GCRA and the two-window approximation (``bench/spend_limits.py``, one
client, a private Redis): GCRA and the approximation are the cheaper (about 7 and 8 µs of
Redis time per acquire against the log's 32; 22-24k acquires/s from one client against
11k), but at a window's boundary both granted 37-39 calls within one window under a limit
of 20 — a full burst at the end of one window and another at the start of the next — and a
provider that counts per minute, fixed or sliding, answers the second burst with 429s. The
log never grants more than the limit within any window, which also satisfies a provider
that counts by token bucket. Its cost is one sorted-set entry per call of the last window
(not per token); at 10,000 requests a minute it is well under 1% of one Redis core.

Every key of a provider carries its hash tag (:func:`onceflow.keys.provider_key`), so a
script touches one Redis Cluster slot. Per-workspace counts (the fairness policy of
``acquire.lua``) are hash fields in that slot, not keys of the workspace's own slot: a
script may not reach across slots.

Every redis-py error becomes :class:`~onceflow.errors.LimitsUnavailable` (retryable).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Final

import redis

from onceflow.errors import LimitsUnavailable
from onceflow.keys import provider_key
from onceflow.redis_clients import REDIS_ERRORS, AsyncRedis, SyncRedis, async_client, sync_client
from onceflow.settings import get_settings

#: The wait hint when only a release can make room (a concurrency slot, a fair share), and
#: the longest a waiter sleeps between two attempts (so it counts as waiting, and its
#: heartbeat and cancel event are seen).
POLL_MS: Final = 250
#: A workspace counts as waiting while one of its callers asked within this long.
STALE_MS: Final = 2000
#: How much longer than a window and a permit's TTL a provider's keys outlive its last
#: acquire or settle (:attr:`LimitSpec.keep_ms`).
KEEP_MARGIN_MS: Final = 1000


@dataclass(frozen=True)
class Script:
    """A Lua script and its SHA1."""

    text: str
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        text = files("onceflow.spend").joinpath(name).read_text()
        return cls(text, hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest())


ACQUIRE: Final = Script.load("acquire.lua")
SETTLE: Final = Script.load("settle.lua")
COOL: Final = Script.load("cool.lua")
ABANDON: Final = Script.load("abandon.lua")


@dataclass(frozen=True)
class LimitSpec:
    """A provider's limits as the scripts take them (-1: no limit)."""

    rpm: int
    tpm: int
    concurrency: int
    window_ms: int
    ttl_ms: int
    cold_start: str

    @property
    def keep_ms(self) -> int:
        """How long the provider's keys (all but its epoch) outlive its last acquire or
        settle: past a window and a permit's TTL, every entry they held is gone."""
        return self.window_ms + self.ttl_ms + KEEP_MARGIN_MS


@dataclass(frozen=True)
class Decision:
    """An acquire's answer: granted at ``at_ms`` (Redis clock), or wait ``wait_ms`` and why
    (``cooling``, ``state_lost``, ``concurrency``, ``rpm``, ``tpm``, ``share``)."""

    granted: bool
    at_ms: int = 0
    wait_ms: int = 0
    reason: str = ""
    #: The provider state's epoch on the server (when it began: Redis µs since the Unix
    #: epoch, as text).
    epoch: str = ""


@dataclass(frozen=True)
class Settled:
    """A settle's answer: whether the permit still held its slot, and the Redis time."""

    held: bool
    at_ms: int


class ProviderKeys:
    """The keys of one provider's limits (one hash tag)."""

    def __init__(self, provider: str) -> None:
        def k(part: str) -> str:
            return provider_key(provider, part)

        self.log, self.meta, self.sums = k("log"), k("meta"), k("sums")
        self.ws_req, self.ws_tok, self.holders = k("ws-req"), k("ws-tok"), k("holders")
        self.cool, self.epoch, self.blackout = k("cool"), k("epoch"), k("blackout")
        self.waiters, self.waiter_ws, self.ws_waiting = k("waiters"), k("waiter-ws"), k("ws-wait")
        self.stats = k("stats")

    def acquire(self) -> list[str]:
        return [
            self.log, self.meta, self.sums, self.ws_req, self.ws_tok, self.holders, self.cool,
            self.epoch, self.blackout, self.waiters, self.waiter_ws, self.ws_waiting, self.stats,
        ]  # fmt: skip

    def settle(self) -> list[str]:
        return [self.log, self.meta, self.sums, self.ws_req, self.ws_tok, self.holders, self.stats]


def acquire_args(
    spec: LimitSpec, permit_id: str, workspace_id: str, tokens: int, seen: str
) -> list[Any]:
    return [
        permit_id, workspace_id, tokens, spec.rpm, spec.tpm, spec.concurrency, spec.window_ms,
        spec.ttl_ms, spec.cold_start, STALE_MS, POLL_MS, seen, spec.keep_ms,
    ]  # fmt: skip


def settle_args(
    spec: LimitSpec,
    permit_id: str,
    workspace_id: str,
    estimate: int,
    actual: int | None,
    outcome: str,
) -> list[Any]:
    actual_arg = -1 if actual is None else actual
    return [permit_id, workspace_id, estimate, actual_arg, outcome, spec.keep_ms]


def decision(reply: Sequence[Any]) -> Decision:
    if int(reply[0]) == 1:
        return Decision(True, at_ms=int(reply[1]), epoch=_text(reply[2]))
    return Decision(False, wait_ms=int(reply[1]), reason=_text(reply[2]), epoch=_text(reply[3]))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_stats(
    raw: dict[Any, Any], in_flight: int, sums: Sequence[Any], cooling: int
) -> dict[str, int]:
    stats = {_text(k): int(v) for k, v in raw.items()}
    stats["in_flight"] = in_flight
    stats["window_requests"] = int(sums[0] or 0)
    stats["window_tokens"] = int(sums[1] or 0)
    stats["cooling_ms"] = max(int(cooling), 0)
    return stats


@contextmanager
def translated(what: str) -> Iterator[None]:
    """redis-py's errors as :class:`LimitsUnavailable`."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise LimitsUnavailable(f"Redis unavailable ({what}): {exc}") from exc


#: The most limit calls one process has in flight at once: redis-py's pool refuses a
#: command beyond its 100 connections ("Too many connections"), and a process may have
#: hundreds of threads waiting for permits; past this bound they queue in the process.
IN_FLIGHT: Final = 64

_sync: dict[tuple[str, int], SyncRedis] = {}
_gates: dict[int, threading.BoundedSemaphore] = {}
#: Per event loop (a client belongs to the loop it first connects on): each URL's client and
#: the loop's bound of calls in flight. Weak: a closed loop's entry goes with it.
_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_made = threading.Lock()


def _url(url: str | None) -> str:
    return url or get_settings().redis_url


def sync_redis(url: str | None) -> SyncRedis:
    """This process's client for the limits (made lazily, again after a fork)."""
    key = (_url(url), os.getpid())
    client = _sync.get(key)
    if client is None:
        with _made:
            client = _sync.get(key)
            if client is None:
                with translated("connect"):
                    client = sync_client(
                        key[0], timeout=get_settings().lock_timeout_seconds, retries=1
                    )
                _sync[key] = client
    return client


def async_redis(url: str | None) -> tuple[AsyncRedis, asyncio.Semaphore]:
    """This event loop's asyncio client for the limits, and the loop's bound of calls in
    flight (:data:`IN_FLIGHT`)."""
    made = _async.setdefault(asyncio.get_running_loop(), {})
    gate = made.get("")
    if gate is None:
        gate = made[""] = asyncio.Semaphore(IN_FLIGHT)
    key = _url(url)
    client = made.get(key)
    if client is None:
        with translated("connect"):
            client = async_client(key, timeout=get_settings().lock_timeout_seconds, retries=1)
        made[key] = client
    return client, gate


def _gate() -> threading.BoundedSemaphore:
    """This process's bound of limit calls in flight (:data:`IN_FLIGHT`)."""
    pid = os.getpid()
    gate = _gates.get(pid)
    if gate is None:
        with _made:
            gate = _gates.setdefault(pid, threading.BoundedSemaphore(IN_FLIGHT))
    return gate


class SyncLimits:
    """The limit scripts on a sync client."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url

    @property
    def client(self) -> SyncRedis:
        return sync_redis(self.url)

    def run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        client = self.client
        with _gate(), translated("provider limits"):
            try:
                return client.evalsha(script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return client.eval(script.text, len(keys), *keys, *args)

    def acquire(
        self,
        keys: ProviderKeys,
        spec: LimitSpec,
        permit_id: str,
        workspace_id: str,
        tokens: int,
        seen: str = "",
    ) -> Decision:
        args = acquire_args(spec, permit_id, workspace_id, tokens, seen)
        return decision(self.run(ACQUIRE, keys.acquire(), args))

    # Alike by shape on purpose: the sync twin of AsyncLimits.settle; every step is I/O.
    def settle(
        self,
        keys: ProviderKeys,
        spec: LimitSpec,
        permit_id: str,
        workspace_id: str,
        estimate: int,
        actual: int | None,
        outcome: str,
    ) -> Settled:
        args = settle_args(spec, permit_id, workspace_id, estimate, actual, outcome)
        reply = self.run(SETTLE, keys.settle(), args)
        return Settled(bool(int(reply[0])), int(reply[1]))

    def cool(self, keys: ProviderKeys, spec: LimitSpec, ms: int) -> int:
        return int(self.run(COOL, [keys.cool, keys.stats], [ms, spec.keep_ms]))

    def abandon(self, keys: ProviderKeys, permit_id: str) -> None:
        """A waiter gives up; a Redis error here is left unsaid (its entry goes stale)."""
        with suppress(LimitsUnavailable):
            self.run(ABANDON, [keys.waiters, keys.waiter_ws, keys.ws_waiting], [permit_id])

    def stats(self, keys: ProviderKeys) -> dict[str, int]:
        with translated("provider stats"):
            client = self.client
            raw = client.hgetall(keys.stats)
            in_flight = client.zcard(keys.holders)
            sums = client.hmget(keys.sums, ["req", "tok"])
            cooling = client.pttl(keys.cool)
        return parse_stats(raw, int(in_flight), sums, int(cooling))

    def reset(self, keys: ProviderKeys) -> None:
        with translated("provider reset"):
            self.client.delete(*keys.acquire())


class AsyncLimits:
    """The limit scripts on an asyncio client (the same scripts, the same answers)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url

    async def run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        client: Any
        client, gate = async_redis(self.url)
        async with gate:
            return await self._run(client, script, keys, args)

    @staticmethod
    async def _run(client: Any, script: Script, keys: list[str], args: list[Any]) -> Any:
        with translated("provider limits"):
            try:
                return await client.evalsha(script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return await client.eval(script.text, len(keys), *keys, *args)

    async def acquire(
        self,
        keys: ProviderKeys,
        spec: LimitSpec,
        permit_id: str,
        workspace_id: str,
        tokens: int,
        seen: str = "",
    ) -> Decision:
        args = acquire_args(spec, permit_id, workspace_id, tokens, seen)
        return decision(await self.run(ACQUIRE, keys.acquire(), args))

    # Alike by shape on purpose: the async twin of SyncLimits.settle; every step is I/O.
    async def settle(
        self,
        keys: ProviderKeys,
        spec: LimitSpec,
        permit_id: str,
        workspace_id: str,
        estimate: int,
        actual: int | None,
        outcome: str,
    ) -> Settled:
        args = settle_args(spec, permit_id, workspace_id, estimate, actual, outcome)
        reply = await self.run(SETTLE, keys.settle(), args)
        return Settled(bool(int(reply[0])), int(reply[1]))

    async def cool(self, keys: ProviderKeys, spec: LimitSpec, ms: int) -> int:
        return int(await self.run(COOL, [keys.cool, keys.stats], [ms, spec.keep_ms]))

    async def abandon(self, keys: ProviderKeys, permit_id: str) -> None:
        with suppress(LimitsUnavailable):
            await self.run(ABANDON, [keys.waiters, keys.waiter_ws, keys.ws_waiting], [permit_id])
