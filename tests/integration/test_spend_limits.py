"""Provider limits on the real Redis: requests, tokens and concurrency per window, the
estimate corrected at settle, cooling after a 429, bounded and cancellable waits, the
spend hooks' seam, permits that expire, and the asyncio API."""

from __future__ import annotations

import asyncio
import threading
import time
from decimal import Decimal

import pytest
import redis

from onceflow.errors import InvalidRequest, PermitCancelled, PermitTimeout
from onceflow.spend import Price, Provider, Usage
from tests.integration.spend_parts import RecordingHooks, fresh, most_in_any_window, redis_ms


def test_rpm_holds_within_the_window(redis_url: str) -> None:
    provider = fresh(redis_url, rpm=5, window_seconds=1)
    granted = []
    deadline = time.monotonic() + 2.6
    while time.monotonic() < deadline:
        try:
            with provider.permit("ws", timeout=0) as permit:
                granted.append(permit.granted_at_ms)
        except PermitTimeout as exc:
            assert exc.reason == "rpm"
            time.sleep(0.01)
    assert most_in_any_window(granted, 1000) == 5
    assert len(granted) >= 10  # the window slides: more came once the first left it


def test_tokens_are_reserved_then_corrected(redis_url: str) -> None:
    provider = fresh(redis_url, tpm=100, window_seconds=30)
    with provider.permit("ws", tokens=80) as permit:
        with pytest.raises(PermitTimeout, match="tpm"), provider.permit("ws", 30, timeout=0.2):
            pass
        permit.settle(Usage(10, 10))  # 80 reserved, 20 used: 60 come back
    assert provider.stats()["window_tokens"] == 20
    with provider.permit("ws", tokens=80) as permit:
        permit.settle(Usage(50, 50))  # above the estimate: counted in full
    assert provider.stats()["window_tokens"] == 120
    with pytest.raises(PermitTimeout), provider.permit("ws", tokens=1, timeout=0.1):
        pass


def test_concurrency_slots_come_back_at_settle(redis_url: str) -> None:
    provider = fresh(redis_url, concurrency=2)
    with provider.permit("a") as one, provider.permit("b") as two:
        assert provider.stats()["in_flight"] == 2
        with pytest.raises(PermitTimeout, match="concurrency"), provider.permit("c", timeout=0.3):
            pass
        one.settle(Usage(1, 1))
        with provider.permit("c", timeout=1) as three:
            three.settle(Usage(1, 1))
        two.settle(Usage(1, 1))
    assert provider.stats()["in_flight"] == 0


def test_nonsense_or_second_settle_changes_nothing(redis_url: str) -> None:
    hooks = RecordingHooks()
    provider = fresh(redis_url, tpm=1000, concurrency=1, hooks=hooks)
    with provider.permit("ws", tokens=50) as permit:
        for bad in (None, (1, 2), {"input_tokens": 1}):
            with pytest.raises(InvalidRequest, match="Usage"):
                permit.settle(bad)  # type: ignore[arg-type]
        assert provider.stats()["in_flight"] == 1 and provider.stats()["window_tokens"] == 50
        assert not permit.settled
        permit.settle(Usage(5, 5))
        with pytest.raises(InvalidRequest, match="already settled"):
            permit.settle(Usage(1, 1))
        with pytest.raises(InvalidRequest, match="already settled"):
            permit.rate_limited(3)
    assert provider.stats()["window_tokens"] == 10
    assert hooks.kinds() == ["admit", "settle"]


def test_leaving_without_settle_counts_the_estimate(redis_url: str) -> None:
    hooks = RecordingHooks()
    provider = fresh(redis_url, tpm=1000, concurrency=1, hooks=hooks)
    with pytest.raises(ZeroDivisionError), provider.permit("ws", tokens=70):
        _ = 1 / 0
    with provider.permit("ws", tokens=30):
        pass
    stats = provider.stats()
    assert (stats["in_flight"], stats["window_tokens"]) == (0, 100)
    assert (stats["settled_error"], stats["settled_unsettled"]) == (1, 1)
    outcomes = [(s[1], s[2]) for s in hooks.settles()]
    assert outcomes == [(None, "error"), (None, "unsettled")]


def test_a_429_cools_the_provider_for_every_client(redis_url: str) -> None:
    provider = fresh(redis_url, rpm=1000)
    # Another process's declaration of the same provider: it shares the state in Redis.
    other_client = Provider(provider.name, rpm=1000, redis_url=redis_url, cold_start="empty")
    with provider.permit("ws") as permit:
        permit.rate_limited(retry_after=1.0)
    assert 0 < provider.stats()["cooling_ms"] <= 1000
    start = redis_ms(redis_url)
    with other_client.permit("another-ws", timeout=5) as later:
        assert later.granted_at_ms - start >= 900
    stats = provider.stats()
    assert stats["cooled"] == 1 and stats["settled_rate_limited"] == 1
    assert stats["denied_cooling"] >= 1


def test_the_wait_is_bounded_cancellable_and_heartbeats(redis_url: str) -> None:
    hooks = RecordingHooks()
    provider = fresh(redis_url, concurrency=1, hooks=hooks)
    beats: list[float] = []
    with provider.permit("ws"):
        started = time.monotonic()
        beat = lambda: beats.append(1)  # noqa: E731
        with (
            pytest.raises(PermitTimeout) as caught,
            provider.permit("ws", timeout=0.8, heartbeat=beat, heartbeat_every=0.1),
        ):
            pass
        assert 0.8 <= time.monotonic() - started < 2.0
        assert caught.value.retryable and 2 <= len(beats) <= 8  # every 0.1 s, not every poll

        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        with pytest.raises(PermitCancelled), provider.permit("ws", timeout=30, cancel=cancel):
            pass

        class LostLease(Exception):
            pass

        def lose() -> None:
            raise LostLease

        with (
            pytest.raises(LostLease),
            provider.permit("ws", 0, heartbeat=lose, heartbeat_every=0.1),
        ):
            pass
    # Three admitted waits that gave up: each released, none settled.
    assert hooks.kinds() == ["admit", "admit", "release", "admit", "release", "admit", "release",
                             "settle"]  # fmt: skip


def test_hooks_refuse_before_any_limit_is_taken(redis_url: str) -> None:
    hooks = RecordingHooks()
    hooks.refuse = RuntimeError("over budget")
    provider = fresh(redis_url, rpm=10, hooks=hooks)
    with pytest.raises(RuntimeError, match="over budget"), provider.permit("ws"):
        pass
    assert provider.stats().get("granted", 0) == 0 and provider.stats()["window_requests"] == 0


def test_settle_tells_the_hooks_usage_cost_and_redis_times(redis_url: str) -> None:
    hooks = RecordingHooks()
    provider = fresh(redis_url, tpm=10_000, price=Price("2", "8"), model="m-1", hooks=hooks)
    with provider.permit("ws", tokens=1000, stage="summarise", request_id="r1", cell_key="c") as p:
        p.settle(Usage(500, 250))
    ((grant, usage, outcome, name, model, cost, started, ended),) = hooks.settles()
    assert (grant.stage, grant.request_id, grant.cell_key) == ("summarise", "r1", "c")
    assert grant.estimate_cost == Decimal("0.008")
    assert (usage, outcome, name, model) == (Usage(500, 250), "ok", provider.name, "m-1")
    assert cost == Decimal("0.003")
    assert started <= ended and abs(started.timestamp() * 1000 - p.granted_at_ms) < 1


def test_a_failed_record_is_retried_by_the_same_settle(redis_url: str) -> None:
    hooks = RecordingHooks()
    hooks.fail_settles = 1
    provider = fresh(redis_url, tpm=1000, hooks=hooks)
    with provider.permit("ws", tokens=100) as permit:
        with pytest.raises(ConnectionError):
            permit.settle(Usage(10, 10))
        with pytest.raises(InvalidRequest, match="same usage"):
            permit.settle(Usage(1, 1))
        permit.settle(Usage(10, 10))
    assert [s[2] for s in hooks.settles()] == ["ok"]
    assert provider.stats()["window_tokens"] == 20  # corrected once


def test_an_unsettled_permit_expires_counted(redis_url: str) -> None:
    provider = fresh(redis_url, concurrency=1, permit_ttl=0.5)
    held = provider.permit("ws").__enter__()  # a holder that never comes back
    with provider.permit("ws", timeout=5) as later:
        assert later.granted_at_ms - held.granted_at_ms >= 500
    assert provider.stats()["expired"] == 1


def test_fair_shares_while_workspaces_wait(redis_url: str) -> None:
    """A workspace that took its share waits while another workspace waits: the other's
    calls are granted first."""
    provider = fresh(redis_url, rpm=4, window_seconds=2)
    for _ in range(4):
        with provider.permit("big"):
            pass
    order: list[str] = []

    def take(ws: str) -> None:
        try:
            with provider.permit(ws, timeout=3):
                order.append(ws)
        except PermitTimeout:
            pass  # the big workspace's later calls: not granted within the test's time

    threads = [threading.Thread(target=take, args=(ws,)) for ws in ["big"] * 20 + ["small"] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The next window: two calls each (rpm 4 over two waiting workspaces). Without the
    # shares, both small calls among the first four of 22 waiters would be a 1 in 40 chance.
    assert order[:4].count("small") == 2, order


def test_apermit_shares_the_limits(redis_url: str) -> None:
    hooks = RecordingHooks()
    provider = fresh(redis_url, rpm=3, window_seconds=30, hooks=hooks)

    async def main() -> None:
        async with provider.apermit("ws", tokens=5) as permit:
            await permit.settle(Usage(2, 2))
        async with provider.apermit("ws") as permit:
            await permit.rate_limited(0.05)
        with pytest.raises(PermitTimeout):
            async with provider.apermit("ws"), provider.apermit("ws", timeout=0.3):
                pass

    asyncio.run(main())
    assert [s[2] for s in hooks.settles()] == ["ok", "rate_limited", "error"]
    assert provider.stats()["window_requests"] == 3


def test_a_new_provider_starts_with_a_full_window(redis_url: str) -> None:
    provider = fresh(redis_url, rpm=100, window_seconds=0.5, cold_start="full")
    start = redis_ms(redis_url)
    with provider.permit("ws", timeout=5) as permit:
        assert permit.granted_at_ms - start >= 450
    assert provider.stats()["state_lost"] == 1


def test_a_state_begun_again_by_a_newcomer_counts_as_full(redis_url: str) -> None:
    """The state is lost (here: deleted), a process that never saw it starts it again and is
    served at once; a process that had seen the old state then waits out the new state's
    first window, and so does everyone."""
    seen = fresh(redis_url, rpm=100, window_seconds=1.0, cold_start="known")
    with seen.permit("ws"):
        pass
    seen.reset()  # the server's state is gone
    newcomer = Provider(seen.name, rpm=100, window_seconds=1.0, redis_url=redis_url)
    with newcomer.permit("ws", timeout=0) as first:
        pass
    with seen.permit("ws", timeout=5) as later:
        assert later.granted_at_ms >= first.granted_at_ms + 1000 - 5
    stats = seen.stats()
    assert stats["state_lost"] == 1 and stats["denied_state_lost"] >= 1


def test_a_retry_after_above_the_cap_cools_only_up_to_it(redis_url: str) -> None:
    provider = fresh(redis_url, rpm=1000, max_cooldown=2)
    with provider.permit("ws") as permit:
        permit.rate_limited(retry_after=86_400)  # a day, reported by one caller
    assert 0 < provider.stats()["cooling_ms"] <= 2000
    assert provider.rate_limited(3600) <= 2000  # outside a permit too
    assert fresh(redis_url).max_cooldown == 300  # a few minutes unless declared
    assert fresh(redis_url, cooldown=10, max_cooldown=5).cooling_ms(None) == 5000
    with pytest.raises(InvalidRequest, match="max_cooldown"):
        fresh(redis_url, max_cooldown=-1)


def _provider_keys(redis_url: str, provider: Provider) -> dict[str, int]:
    """Every key of the provider in Redis, and its PTTL (-1: none)."""
    client = redis.Redis.from_url(redis_url)
    tag = provider.keys.epoch.rsplit(":", 1)[0]
    return {
        k.decode(): int(client.pttl(k))
        for k in client.scan_iter(match=tag.replace("{", "[{]").replace("}", "[}]") + ":*")
    }


def test_every_key_but_the_epoch_expires_and_idleness_is_no_lost_state(redis_url: str) -> None:
    """After grants, a refusal, settles and a 429, every key of the provider but its epoch
    has a TTL; once they have all expired (an idle provider), its next permit is granted at
    once: the epoch is still there, so nothing reads as a state lost."""
    provider = fresh(
        redis_url, rpm=100, tpm=1000, concurrency=1, window_seconds=0.2, permit_ttl=0.3,
        cold_start="known", cooldown=0.05,
    )  # fmt: skip
    with provider.permit("ws-a", tokens=20) as permit:
        with pytest.raises(PermitTimeout), provider.permit("ws-b", timeout=0):
            pass
        permit.settle(Usage(5, 5))
    with provider.permit("ws-b", tokens=20) as permit:
        permit.rate_limited()
    keys = _provider_keys(redis_url, provider)
    for name in ("log", "meta", "sums", "ws-req", "ws-tok", "stats", "epoch"):
        assert provider.keys.__dict__[name.replace("-", "_")] in keys, name
    untimed = [k for k, ttl in keys.items() if ttl < 0]
    assert untimed == [provider.keys.epoch]
    assert max(keys.values()) <= provider.spec.keep_ms

    deadline = time.monotonic() + provider.spec.keep_ms / 1000 + 5
    while set(_provider_keys(redis_url, provider)) != {provider.keys.epoch}:
        assert time.monotonic() < deadline, _provider_keys(redis_url, provider)
        time.sleep(0.05)
    start = redis_ms(redis_url)
    with provider.permit("ws-a", tokens=20, timeout=0) as permit:  # not a lost state: at once
        assert permit.granted_at_ms - start < 150
        permit.settle(Usage(1, 1))
    stats = provider.stats()
    assert stats.get("state_lost", 0) == 0 and stats["window_tokens"] == 2


def test_an_empty_window_starts_its_sums_again(redis_url: str) -> None:
    """Sums that drifted from the log (here: written by hand) are counted again from zero
    once the window holds nothing: a drift cannot throttle for good."""
    provider = fresh(redis_url, tpm=100, window_seconds=0.2)
    client = redis.Redis.from_url(redis_url)
    client.hset(provider.keys.sums, mapping={"req": 7, "tok": 95})
    with provider.permit("ws", tokens=50, timeout=0) as permit:
        permit.settle(Usage(25, 25))
    assert provider.stats()["window_tokens"] == 50


def test_a_settle_corrects_the_workspace_the_permit_was_granted_to(redis_url: str) -> None:
    provider = fresh(redis_url, tpm=1000)
    limits, keys, spec = provider.limits, provider.keys, provider.spec
    assert limits.acquire(keys, spec, "permit-one", "ws-a", 50).granted
    limits.settle(keys, spec, "permit-one", "ws-b", 50, 10, "ok")  # another workspace named
    counted = redis.Redis.from_url(redis_url).hgetall(keys.ws_tok)
    assert counted == {b"ws-a": b"10"}


def test_a_tpm_wait_looks_at_the_oldest_entries_only(redis_url: str) -> None:
    """A refusal whose room needs more than the oldest 200 entries of the window answers the
    whole window (an upper bound of the wait) without reading the rest of the log."""
    provider = fresh(redis_url, tpm=1000, window_seconds=30)
    limits, keys, spec = provider.limits, provider.keys, provider.spec
    for i in range(300):
        assert limits.acquire(keys, spec, f"small-{i}", "ws", 1).granted
    near = limits.acquire(keys, spec, "fits-150", "ws", 850)  # 150 entries free the room
    assert not near.granted and near.reason == "tpm" and near.wait_ms < 30_000
    far = limits.acquire(keys, spec, "needs-250", "ws", 950)  # 250 entries: past the scan
    assert not far.granted and far.reason == "tpm" and far.wait_ms == 30_000
