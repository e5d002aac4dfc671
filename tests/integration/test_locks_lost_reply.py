"""Lock round trips that go wrong between client and server, on a real Redis.

A lock command whose reply was lost after Redis ran it, resent by the client (redis-py
retries a command once on a failed connection): the resend answers as the first would have.

Before: the acquire was a ``SET NX``, whose resend found the caller's own key and answered
"taken" — a lock nobody held, blocking the cell (its own caller included) for a whole TTL;
and a resent release found the key gone and reported the lock lost (``locks_lost``).
Real Redis, behind a forwarder that cuts the connection instead of delivering one reply.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from onceflow.keys import lock_key
from onceflow.locks import (
    AsyncRedisLockBackend,
    Path,
    RedisLockBackend,
    acompute_once,
    compute_once,
)
from onceflow.settings import get_settings
from tests.acceptance.procs import wait_for
from tests.integration.late_reply_proxy import LateReplyProxy


@pytest.fixture()
def through_proxy(redis_url: str) -> Iterator[tuple[LateReplyProxy, str]]:
    """A proxy in front of the test Redis, and the URL going through it."""
    parts = urlsplit(redis_url)
    with LateReplyProxy(parts.hostname or "127.0.0.1", parts.port or 6379) as proxy:
        yield proxy, f"redis://127.0.0.1:{proxy.port}{parts.path}"


def test_a_resent_acquire_and_release_answer_as_the_first(
    through_proxy: tuple[LateReplyProxy, str], redis_url: str
) -> None:
    proxy, url = through_proxy
    ws = f"ws-{secrets.token_hex(4)}"
    key = lock_key(ws, "j", "t")
    direct = redis.Redis.from_url(redis_url)
    be = RedisLockBackend(url, settings=get_settings())
    warm = be.acquire(ws, "warm", "t")  # scripts loaded: the armed command is the one acting
    assert warm is not None and warm.release()
    proxy.lose_reply_to(key.encode())
    handle = be.acquire(ws, "j", "t", ttl=60)
    assert proxy.lost.is_set()  # Redis took the lock; its answer was lost, the acquire resent
    assert handle is not None  # before: None (the resend found our own key: "taken")
    assert direct.get(key) == handle.token.encode()
    proxy.lose_reply_to(key.encode())
    assert handle.release() is True  # before: False, the lock "lost"
    assert proxy.lost.is_set()
    assert not handle.lost and direct.exists(key) == 0
    assert be.counters.snapshot(ws).get("locks_lost", 0) == 0
    # A release of a lock that did lapse is still reported lost (the mark is the owner's).
    short = be.acquire(ws, "j", "t", ttl=60)
    assert short is not None
    direct.delete(key)
    assert short.release() is False and short.lost


def test_the_async_backend_too(through_proxy: tuple[LateReplyProxy, str], redis_url: str) -> None:
    proxy, url = through_proxy
    ws = f"ws-{secrets.token_hex(4)}"
    key = lock_key(ws, "j", "t")
    direct = redis.Redis.from_url(redis_url)

    async def main() -> None:
        be = AsyncRedisLockBackend(url, settings=get_settings())
        warm = await be.acquire(ws, "warm", "t")
        assert warm is not None and await warm.release()
        proxy.lose_reply_to(key.encode())
        handle = await be.acquire(ws, "j", "t", ttl=60)
        assert proxy.lost.is_set()
        assert handle is not None
        assert direct.get(key) == handle.token.encode()
        proxy.lose_reply_to(key.encode())
        assert await handle.release() is True
        assert proxy.lost.is_set()
        assert not handle.lost and direct.exists(key) == 0
        assert be.counters.snapshot(ws).get("locks_lost", 0) == 0
        await be.client.aclose()

    asyncio.run(main())


# ------------------------------------------------ a subscription the server ended


def test_a_waiter_whose_subscription_the_server_ended_subscribes_anew(redis_url: str) -> None:
    """The server ends a waiter's subscription (on a Redis Cluster, a slot that moved: an
    unsubscribe reply the client did not ask for; here the same reply on one server). The
    waiter subscribes anew and is served by the holder's broadcast. Before: it counted a
    wait timeout and kept waiting on the ended subscription until the lock's TTL ran out."""
    ws = f"ws-{secrets.token_hex(4)}"
    be = RedisLockBackend(redis_url, settings=get_settings())
    subs: list[Any] = []
    subscribe = be.subscribe

    def recording(workspace_id: str) -> Any:
        sub = subscribe(workspace_id)
        subs.append(sub)
        return sub

    be.subscribe = recording  # type: ignore[method-assign]
    leader = be.acquire(ws, "j", "t", ttl=60)
    assert leader is not None
    stored: dict[str, str] = {}
    waits: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        waiter = pool.submit(
            compute_once, ws, "j", "t", check=lambda: stored.get("v"),
            compute=lambda: "not this one", store=lambda v: None, backend=be, ttl=60,
            on_wait=lambda: waits.append(1),
        )  # fmt: skip
        wait_for(lambda: waits, what="the waiter waiting")
        subs[0]._pubsub.unsubscribe()  # the unsubscribe reply the waiter did not ask for
        wait_for(lambda: len(waits) >= 2 and len(subs) >= 2, what="a new subscription")
        stored["v"] = "value"
        assert leader.release()
        be.announce(leader, ok=True)
        out = waiter.result(timeout=60)
    assert (out.value, out.path) == ("value", Path.WAITED)
    assert be.counters.snapshot(ws).get("wait_timeouts", 0) == 0


def test_the_async_waiter_subscribes_anew_too(redis_url: str) -> None:
    ws = f"ws-{secrets.token_hex(4)}"

    async def main() -> Any:
        be = AsyncRedisLockBackend(redis_url, settings=get_settings())
        subs: list[Any] = []
        subscribe = be.subscribe

        async def recording(workspace_id: str) -> Any:
            sub = await subscribe(workspace_id)
            subs.append(sub)
            return sub

        be.subscribe = recording  # type: ignore[method-assign]
        leader = await be.acquire(ws, "j", "t", ttl=60)
        assert leader is not None
        stored: dict[str, str] = {}
        waits: list[int] = []

        async def check() -> str | None:
            return stored.get("v")

        async def never() -> str:
            return "not this one"

        async def nothing(value: Any) -> None:
            return None

        waiter = asyncio.ensure_future(
            acompute_once(
                ws, "j", "t", check=check, compute=never, store=nothing, backend=be, ttl=60,
                on_wait=lambda: waits.append(1),
            )
        )  # fmt: skip
        await _until(lambda: bool(waits))
        await subs[0]._pubsub.unsubscribe()
        await _until(lambda: len(waits) >= 2 and len(subs) >= 2)
        stored["v"] = "value"
        assert await leader.release()
        await be.announce(leader, ok=True)
        out = await asyncio.wait_for(waiter, 60)
        timeouts = be.counters.snapshot(ws).get("wait_timeouts", 0)
        await be.client.aclose()
        return out, timeouts

    out, timeouts = asyncio.run(main())
    assert (out.value, out.path) == ("value", Path.WAITED)
    assert timeouts == 0


async def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s")
        await asyncio.sleep(0.02)
