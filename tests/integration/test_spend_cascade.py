"""The cascade against two stand-in providers on local HTTP servers: the first with room
serves; a 429 cools the provider for every client and the call moves on; a 5xx or a
timeout moves on too; each permit is settled on the provider that took it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest

from onceflow.errors import CascadeExhausted, InvalidRequest, ProviderError
from onceflow.spend import AsyncPermit, Cascade, Permit, Price, Usage
from tests.integration.spend_parts import RecordingHooks, fresh
from tests.integration.spend_standin import LimitedProvider, complete


@pytest.fixture()
def servers() -> Iterator[tuple[LimitedProvider, LimitedProvider]]:
    primary = LimitedProvider(limit=3, window=60, retry_after=30)
    fallback = LimitedProvider(limit=1000, window=60)
    yield primary, fallback
    primary.stop()
    fallback.stop()


def _cascade(redis_url: str, hooks: RecordingHooks, **primary_limits: object) -> Cascade:
    # onceflow is not told the primary's true limit (3 a minute): its 429 teaches it.
    primary = fresh(redis_url, rpm=100, hooks=hooks, price=Price("1", "2"), **primary_limits)
    fallback = fresh(redis_url, rpm=100, hooks=hooks)
    return Cascade([primary, fallback])


def test_a_429_cools_the_primary_and_the_fallback_serves(
    redis_url: str, servers: tuple[LimitedProvider, LimitedProvider]
) -> None:
    primary_server, fallback_server = servers
    hooks = RecordingHooks()
    cascade = _cascade(redis_url, hooks)
    primary, fallback = cascade.providers
    urls = {primary.name: primary_server.url, fallback.name: fallback_server.url}

    def ask(permit: Permit) -> str:
        return complete(urls[permit.provider.name], permit)

    answers = [cascade.call("ws", ask, tokens=50) for _ in range(8)]
    assert answers == [f"{primary.name}:ok"] * 3 + [f"{fallback.name}:ok"] * 5
    # The primary saw its three calls and one 429, then nothing: it is cooling (30 s) for
    # every client, so the cascade went straight to the fallback.
    assert primary_server.answered == Counter({200: 3, 429: 1})
    assert fallback_server.answered == Counter({200: 5})
    assert primary.stats()["cooling_ms"] > 25_000
    settled = [(s[3], s[2]) for s in hooks.settles()]
    assert (
        settled
        == [(primary.name, "ok")] * 3
        + [(primary.name, "rate_limited")]
        + [(fallback.name, "ok")] * 5
    )
    costs = [s[5] for s in hooks.settles()]
    assert costs[0] is not None and costs[-1] is None  # the fallback has no price


@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_a_5xx_or_a_timeout_moves_on(
    redis_url: str, servers: tuple[LimitedProvider, LimitedProvider], mode: str
) -> None:
    primary_server, fallback_server = servers
    primary_server.mode = mode
    hooks = RecordingHooks()
    cascade = _cascade(redis_url, hooks)
    primary, fallback = cascade.providers
    urls = {primary.name: primary_server.url, fallback.name: fallback_server.url}
    answer = cascade.call("ws", lambda p: complete(urls[p.provider.name], p), tokens=10)
    assert answer == f"{fallback.name}:ok"
    assert len(primary_server.seen) == 1 and fallback_server.answered == Counter({200: 1})
    assert [(s[3], s[2]) for s in hooks.settles()] == [
        (primary.name, "error"),
        (fallback.name, "ok"),
    ]
    assert primary.stats()["in_flight"] == 0 and primary.stats()["cooling_ms"] == 0


def test_the_first_with_room_serves(
    redis_url: str, servers: tuple[LimitedProvider, LimitedProvider]
) -> None:
    primary_server, fallback_server = servers
    hooks = RecordingHooks()
    cascade = _cascade(redis_url, hooks, concurrency=1)
    primary, fallback = cascade.providers
    urls = {primary.name: primary_server.url, fallback.name: fallback_server.url}
    with primary.permit("another-ws"):  # the primary's one slot is taken
        answer = cascade.call("ws", lambda p: complete(urls[p.provider.name], p))
    assert answer == f"{fallback.name}:ok"
    assert primary_server.seen == []


def test_when_every_provider_fails(
    redis_url: str, servers: tuple[LimitedProvider, LimitedProvider]
) -> None:
    for server in servers:
        server.mode = "fail"
    hooks = RecordingHooks()
    cascade = _cascade(redis_url, hooks)
    urls = dict(zip([p.name for p in cascade.providers], [s.url for s in servers], strict=True))
    with pytest.raises(CascadeExhausted, match="503") as caught:
        cascade.call("ws", lambda p: complete(urls[p.provider.name], p))
    assert len(caught.value.errors) == 2
    assert [len(s.seen) for s in servers] == [1, 1]


def test_when_none_has_room_in_time(redis_url: str) -> None:
    primary, fallback = fresh(redis_url, concurrency=1), fresh(redis_url, concurrency=1)
    cascade = Cascade([primary, fallback])
    called: list[Permit] = []
    beats: list[int] = []
    with (
        primary.permit("a"),
        fallback.permit("b"),
        pytest.raises(CascadeExhausted, match="no room"),
    ):
        cascade.call("ws", called.append, timeout=0.6, heartbeat=lambda: beats.append(1),
                     heartbeat_every=0.1)  # fmt: skip
    assert called == [] and len(beats) >= 2
    assert primary.stats()["denied_concurrency"] >= 2


def test_other_errors_are_the_callers(redis_url: str) -> None:
    hooks = RecordingHooks()
    cascade = _cascade(redis_url, hooks)

    def broken(permit: Permit) -> None:
        raise KeyError("a bug in the caller")

    with pytest.raises(KeyError):
        cascade.call("ws", broken)
    assert [(s[3], s[2]) for s in hooks.settles()] == [(cascade.providers[0].name, "error")]
    with pytest.raises(InvalidRequest, match="workspace_id"):
        cascade.call("", broken)


def test_acall_moves_on_and_settles_on_the_provider_that_served(redis_url: str) -> None:
    hooks = RecordingHooks()
    cascade = _cascade(redis_url, hooks)
    primary, fallback = cascade.providers

    async def ask(permit: AsyncPermit) -> str:
        await asyncio.sleep(0)
        if permit.provider is primary:
            raise ProviderError(primary.name, 429, retry_after=0.5)
        await permit.settle(Usage(30, 20))
        return permit.provider.name

    assert asyncio.run(cascade.acall("ws", ask, tokens=100)) == fallback.name
    assert [(s[3], s[2]) for s in hooks.settles()] == [
        (primary.name, "rate_limited"),
        (fallback.name, "ok"),
    ]
    assert 0 < primary.stats()["cooling_ms"] <= 500
    assert fallback.stats()["window_tokens"] == 50
