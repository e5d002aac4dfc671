"""A lock command whose reply was lost after Redis ran it, resent by the client (redis-py
retries a command once on a failed connection): the resend answers as the first would have.

Before: the acquire was a ``SET NX``, whose resend found the caller's own key and answered
"taken" — a lock nobody held, blocking the cell (its own caller included) for a whole TTL;
and a resent release found the key gone and reported the lock lost (``locks_lost``).
Real Redis, behind a forwarder that cuts the connection instead of delivering one reply.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis

from onceflow.keys import lock_key
from onceflow.locks import AsyncRedisLockBackend, RedisLockBackend
from onceflow.settings import get_settings
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
