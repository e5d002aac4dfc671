"""What only the asyncio API of the compute lock has: tasks on one loop, cancellation, its handle.

The protocol's tests run on both APIs in ``test_locks.py``; these cover the async
side's own parts on real Redis: many waiter tasks on one event loop sharing one
:class:`AsyncRedisLockBackend` while a sync holder computes, a cancelled caller that
still releases and announces, the async handle's token checks (against a sync
owner), and its watchdog's stop. Conditions are waited for with deadlines.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from onceflow.errors import InvalidRequest, LockLost
from onceflow.keys import lock_key
from onceflow.locks import (
    AsyncRedisLockBackend,
    Path,
    RedisLockBackend,
    acompute_once,
    compute_once,
    get_async_backend,
)
from onceflow.settings import get_settings
from tests.acceptance.procs import wait_for
from tests.integration.lock_callers import cell_name
from tests.integration.standin import StandIn, call_provider, store_get, store_put


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture()
def ws() -> str:
    return f"ws-{secrets.token_hex(4)}"


@pytest.fixture()
def sync_backend(redis_url: str) -> RedisLockBackend:
    return RedisLockBackend(redis.Redis.from_url(redis_url, socket_timeout=30))


def test_async_waiters_on_one_loop_share_a_sync_holders_call(
    standin: StandIn, sync_backend: RedisLockBackend, redis_url: str, ws: str
) -> None:
    """A sync leader (a thread) computes; 8 tasks on one loop and one backend wait for it."""
    cell = ("job-l", "eval:fit")
    name = cell_name(ws, *cell)
    standin.block_next(name)
    leader: dict[str, Any] = {}

    def lead() -> None:
        leader["out"] = compute_once(
            ws, *cell, check=lambda: store_get(standin.url, name),
            compute=lambda: call_provider(standin.url, name),
            store=lambda v: store_put(standin.url, name, v), backend=sync_backend,
        )  # fmt: skip

    thread = threading.Thread(target=lead)
    thread.start()
    wait_for(lambda: standin.calls[name] == 1, what="the sync leader's provider call")

    async def waiters() -> list[Any]:
        waiting = asyncio.Event()
        count = 0

        def on_wait() -> None:  # a plain callable, called on the loop
            nonlocal count
            count += 1
            if count == 8:
                waiting.set()

        async with AsyncRedisLockBackend(redis_url) as backend:

            async def one() -> Any:
                return await acompute_once(
                    ws, *cell, check=lambda: asyncio.to_thread(store_get, standin.url, name),
                    compute=lambda: asyncio.to_thread(call_provider, standin.url, name),
                    store=lambda v: asyncio.to_thread(store_put, standin.url, name, v),
                    backend=backend, on_wait=on_wait,
                )  # fmt: skip

            tasks = [asyncio.create_task(one()) for _ in range(8)]
            await asyncio.wait_for(waiting.wait(), 60)  # all 8 subscribed and waiting
            standin.unblock(name)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    try:
        outs = asyncio.run(waiters())
    finally:
        standin.unblock(name)
        thread.join(timeout=60)
    assert leader["out"].path is Path.COMPUTED
    assert standin.calls[name] == 1  # the provider's own count: one call for 9 callers
    assert {o.value for o in outs} == {f"answer-{name}-1"}
    assert Counter((o.path, o.served_by) for o in outs) == {(Path.WAITED, "broadcast"): 8}


def test_a_cancelled_async_caller_releases_and_announces(redis_url: str, ws: str) -> None:
    cell = ("job-c", "eval:x")

    async def main() -> tuple[Any, Any]:
        async with AsyncRedisLockBackend(redis_url) as backend:
            sub = await backend.subscribe(ws)
            computing = asyncio.Event()

            async def compute() -> str:
                computing.set()
                await asyncio.Event().wait()  # the paid call, still out when cancelled
                return "never"

            task = asyncio.create_task(
                acompute_once(
                    ws,
                    *cell,
                    check=lambda: None,
                    compute=compute,
                    store=lambda v: None,
                    backend=backend,
                )
            )
            await asyncio.wait_for(computing.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            owner = await backend.owner_token(ws, *cell)
            message = await sub.wait(30)
            await sub.close()
            return owner, message

    owner, message = asyncio.run(main())
    assert owner is None  # released before the cancellation reached the caller
    assert message is not None
    assert message["kind"] == "lock_released" and message["ok"] is False
    assert (message["job_id"], message["task"]) == cell


def test_the_async_handle_never_deletes_a_sync_owners_lock(
    sync_backend: RedisLockBackend, redis_url: str, ws: str
) -> None:
    cell = ("job-e", "eval:x")

    async def main() -> None:
        async with AsyncRedisLockBackend(redis_url) as backend:
            old = await backend.acquire(ws, *cell, ttl=0.2)
            assert old is not None
            wait_for(lambda: sync_backend.owner_token(ws, *cell) is None, what="expiry")
            new = sync_backend.acquire(ws, *cell, ttl=30)  # a sync caller takes it over
            assert new is not None
            assert await old.release() is False
            assert old.lost and await old.extend() is False
            with pytest.raises(LockLost):
                old.ensure_held()
            assert sync_backend.owner_token(ws, *cell) == new.token
            assert new.release() is True
            assert backend.counters.snapshot(ws)["locks_lost"] == 1

    asyncio.run(main())


def test_the_async_watchdog_flags_a_lock_taken_from_it(redis_url: str, ws: str) -> None:
    cell = ("job-s", "eval:x")

    async def main() -> None:
        async with AsyncRedisLockBackend(redis_url) as backend:
            handle = await backend.acquire(ws, *cell, ttl=0.3, watchdog=True)
            assert handle is not None
            await backend.client.delete(lock_key(ws, *cell))  # e.g. evicted
            async with asyncio.timeout(30):
                while not handle.lost:
                    await asyncio.sleep(0.01)  # polls a local flag; no time is asserted
            with pytest.raises(LockLost):
                handle.ensure_held()
            assert await handle.release() is False
            assert backend.counters.snapshot(ws)["locks_lost"] == 1  # counted once

    asyncio.run(main())


def test_the_async_watchdog_stops_even_when_its_cancellation_is_swallowed(
    redis_url: str, ws: str
) -> None:
    """redis-py (8.1) can swallow a cancellation that lands during a command; the release
    must not wait forever for the watchdog (before the fix it did, within a few rounds)."""

    async def main() -> None:
        async with AsyncRedisLockBackend(redis_url) as backend:
            rng = random.Random(7)
            for i in range(150):
                handle = await backend.acquire(ws, "job-w", f"t{i}", ttl=0.03, watchdog=True)
                assert handle is not None
                await asyncio.sleep(rng.random() * 0.03)  # lands anywhere in its cycle
                try:
                    # True, or False when a loaded machine let the 30 ms lock expire
                    await asyncio.wait_for(handle.release(), 30)
                except TimeoutError:
                    raise AssertionError(f"release {i} waited 30 s for its watchdog") from None
                assert handle.released

    asyncio.run(main())


def test_the_default_async_backend_is_one_per_loop() -> None:
    async def twice() -> tuple[Any, Any]:
        return get_async_backend(), get_async_backend()

    a1, a2 = asyncio.run(twice())
    b1, _ = asyncio.run(twice())
    assert a1 is a2 and a1 is not b1
    with pytest.raises(RuntimeError):
        get_async_backend()  # no running loop: no backend to bind to


def test_the_sql_lock_backend_has_no_async_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCEFLOW_LOCK_BACKEND", "sql")
    get_settings.cache_clear()

    async def default() -> Any:
        return get_async_backend()

    try:
        with pytest.raises(InvalidRequest, match="sync-only"):
            asyncio.run(default())
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
