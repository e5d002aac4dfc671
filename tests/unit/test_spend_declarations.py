"""Spend control's values and declarations, checked before anything touches Redis: usage,
prices, grants, providers, the cascade, and ``ONCEFLOW_PROVIDERS``."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import pytest
from redis.crc import key_slot

from onceflow.errors import (
    CascadeExhausted,
    InvalidRequest,
    LimitsUnavailable,
    PermitCancelled,
    PermitTimeout,
    ProviderError,
)
from onceflow.settings import Settings
from onceflow.spend import Cascade, Grant, Price, Provider, UnknownProvider, Usage, registry
from onceflow.spend.limits import ProviderKeys


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None, math.nan])
def test_usage_refuses_nonsense(bad: Any) -> None:
    with pytest.raises(InvalidRequest, match="input_tokens"):
        Usage(bad, 1)
    with pytest.raises(InvalidRequest, match="output_tokens"):
        Usage(1, bad)


def test_usage_counts_both_sides() -> None:
    assert Usage(1200, 300).total_tokens == 1500
    assert Usage(0, 0).total_tokens == 0


def test_price_costs_exactly() -> None:
    price = Price("2.50", "10.00")
    assert price.cost(Usage(1_000_000, 0)) == Decimal("2.50")
    assert price.cost(Usage(1000, 500)) == Decimal("0.0075")
    assert Price(0.1, 3).input_per_million == Decimal("0.1")
    with pytest.raises(InvalidRequest, match="takes a Usage"):
        price.cost((1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, "-0.5", math.nan, math.inf, "NaN", "abc", True, [1]])
def test_price_refuses_nonsense(bad: Any) -> None:
    with pytest.raises(InvalidRequest, match="input_per_million"):
        Price(bad, 1)


def test_grant_checks_its_estimate_and_has_a_fresh_id() -> None:
    a = Grant(workspace_id="w", provider="p", estimate_tokens=5)
    b = Grant(workspace_id="w", provider="p", estimate_tokens=5)
    assert len(a.permit_id) == 32 and a.permit_id != b.permit_id
    for bad in (-1, 2.0, False):
        with pytest.raises(InvalidRequest, match="estimate_tokens"):
            Grant(workspace_id="w", provider="p", estimate_tokens=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["rpm", "tpm", "concurrency"])
@pytest.mark.parametrize("bad", [0, -5, 1.5, math.nan, math.inf, True, "10"])
def test_provider_refuses_bad_limits(name: str, bad: Any) -> None:
    with pytest.raises(InvalidRequest, match=name):
        Provider("p", **{name: bad})


@pytest.mark.parametrize(
    ("option", "bad"),
    [("window_seconds", 0), ("window_seconds", math.nan), ("permit_ttl", -1),
     ("permit_ttl", math.inf), ("cooldown", -0.1), ("cold_start", "lukewarm"),
     ("price", (1, 2)), ("hooks", object())],
)  # fmt: skip
def test_provider_refuses_bad_options(option: str, bad: Any) -> None:
    with pytest.raises(InvalidRequest, match=option):
        Provider("p", **{option: bad})


def test_provider_refuses_bad_names() -> None:
    with pytest.raises(InvalidRequest, match="provider name"):
        Provider("")
    with pytest.raises(InvalidRequest, match="provider name"):
        Provider("a\x00b")


def test_permit_arguments_are_checked_before_any_wait() -> None:
    provider = Provider("p", tpm=1000, redis_url="redis://127.0.0.1:1/0")  # never reached
    with pytest.raises(InvalidRequest, match="never be granted"):
        provider.permit("w", tokens=1001)
    with pytest.raises(InvalidRequest, match="tokens"):
        provider.permit("w", tokens=-1)
    with pytest.raises(InvalidRequest, match="workspace_id"):
        provider.permit("", tokens=1)
    with pytest.raises(InvalidRequest, match="timeout"):
        provider.permit("w", tokens=1, timeout=math.nan)
    with pytest.raises(InvalidRequest, match="retry_after"):
        provider.cooling_ms(-1)


def test_how_a_permit_waits_is_checked() -> None:
    provider = Provider("p")
    with pytest.raises(InvalidRequest, match="heartbeat must be a function"):
        provider.permit("w", heartbeat="beat")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="heartbeat_every"):
        provider.permit("w", heartbeat_every=0)
    with pytest.raises(InvalidRequest, match=r"cancel must be a threading\.Event"):
        provider.permit("w", cancel=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="heartbeat_every"):
        Cascade([provider]).call("w", lambda permit: None, heartbeat_every=math.inf)


def test_estimate_cost_is_an_upper_bound() -> None:
    provider = Provider("p", price=Price("1", "4"))
    assert provider.estimate_cost(1_000_000) == Decimal(4)
    assert Provider("q").estimate_cost(10) is None


def test_every_key_of_a_provider_is_in_one_slot() -> None:
    keys = ProviderKeys("open{ai}:x")
    slots = {key_slot(k.encode()) for k in keys.acquire()}
    assert len(slots) == 1
    assert all(k.startswith("{onceflow:prov:open%7Bai%7D%3Ax}:") for k in keys.acquire())


def test_cascade_refuses_an_empty_or_repeated_chain() -> None:
    with pytest.raises(InvalidRequest, match="at least one"):
        Cascade([])
    with pytest.raises(InvalidRequest, match="each provider once"):
        Cascade([Provider("a"), Provider("a")])
    with pytest.raises(InvalidRequest, match="takes Providers"):
        Cascade(["a"])  # type: ignore[list-item]


@pytest.fixture()
def clean_registry() -> Any:
    """An empty registry for the test; what other modules of the session declared (the
    contract suite's providers, declared at import) is put back afterwards."""
    saved = (dict(registry._providers), set(registry._loaded), list(registry._default_hooks))
    registry.forget()
    yield
    registry.forget()
    with registry._lock:
        registry._providers.update(saved[0])
        registry._loaded.update(saved[1])
        registry._default_hooks[:] = saved[2]


def test_providers_from_settings(clean_registry: None) -> None:
    settings = Settings(
        providers={
            "openai": {"rpm": 500, "tpm": 200_000, "input_per_million": "2.50",
                       "output_per_million": "10", "model": "gpt-4o"},
            "maps": {"rpm": 50, "window_seconds": 1},
        }
    )  # fmt: skip
    openai = registry.get_provider("openai", settings=settings)
    assert (openai.rpm, openai.tpm, openai.model) == (500, 200_000, "gpt-4o")
    assert openai.price == Price("2.50", "10")
    assert [p.name for p in registry.providers(settings=settings)] == ["maps", "openai"]
    with pytest.raises(UnknownProvider, match=r"'anthropic'.*declared: maps, openai"):
        registry.get_provider("anthropic", settings=settings)


@pytest.mark.parametrize(
    ("spec", "match"),
    [({"rpm": -1}, "rpm"), ({"rmp": 5}, "unknown keys"), ({"input_per_million": "1"}, "both"),
     ({"tpm": math.nan}, "tpm"), ({"cold_start": "warm"}, "cold_start")],
)  # fmt: skip
def test_bad_declarations_declare_nothing(clean_registry: None, spec: Any, match: str) -> None:
    settings = Settings(providers={"good": {"rpm": 5}, "bad": spec})
    with pytest.raises(InvalidRequest, match=match):
        registry.get_provider("good", settings=settings)
    assert registry.providers(settings=Settings()) == []


def test_a_declaration_is_an_object() -> None:
    with pytest.raises(InvalidRequest, match="JSON object"):
        registry.from_declaration("p", "fast")


def test_a_name_is_declared_one_way(clean_registry: None) -> None:
    first = registry.register(Provider("p", rpm=5))
    assert registry.register(Provider("p", rpm=5)) is first
    with pytest.raises(InvalidRequest, match="already declared"):
        registry.register(Provider("p", rpm=6))
    assert registry.get_provider("p", settings=Settings()).rpm == 5


@pytest.mark.parametrize(
    "error",
    [
        PermitTimeout("openai", 30.0, "rpm"),
        PermitCancelled("openai"),
        ProviderError("openai", 429, "slow down", retry_after=2.5),
        ProviderError("openai", None),
        CascadeExhausted(["a", "b"], ["a: answered 503", "b: timed out"]),
        UnknownProvider("x", ["a"]),
    ],
)
def test_spend_errors_rebuild_from_their_reduce(error: Exception) -> None:
    """Celery carries exceptions between processes by their ``__reduce__``."""
    cls, args = error.__reduce__()[:2]
    again = cls(*args)
    assert type(again) is type(error) and str(again) == str(error)
    assert again.__dict__ == error.__dict__


def test_retryable_spend_errors() -> None:
    assert PermitTimeout("p", 1.0).retryable and ProviderError("p", 503).retryable
    assert LimitsUnavailable("down").retryable
    assert isinstance(CascadeExhausted(["a"], []), ProviderError)


def test_use_hooks_reaches_providers_without_their_own(clean_registry: None) -> None:
    from onceflow.spend import NO_HOOKS

    class Ledger:
        def admit(self, grant: Grant) -> None: ...
        def settle(self, *args: Any) -> None: ...
        def release(self, grant: Grant) -> None: ...

    ledger, own = Ledger(), Ledger()
    before = registry.register(Provider("before"))
    mine = registry.register(Provider("mine", hooks=own))  # type: ignore[arg-type]
    registry.use_hooks(ledger)  # type: ignore[arg-type]
    later = registry.get_provider("later", settings=Settings(providers={"later": {"rpm": 1}}))
    assert before.hooks is ledger and later.hooks is ledger and mine.hooks is own
    with pytest.raises(InvalidRequest, match="admit, settle and release"):
        registry.use_hooks(object())  # type: ignore[arg-type]
    registry.forget()
    assert registry.register(Provider("after")).hooks is NO_HOOKS


def test_the_default_ledger_follows_the_environments_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ledger installed without settings of its own (a Flow's, by default) writes where
    the environment's settings point when it writes, not where they pointed at the first
    Flow of the process: a process that reads its settings anew (another database or shard
    map) records its spend there."""
    from onceflow.settings import get_settings
    from onceflow.spend.defaults import ProcessLedger

    monkeypatch.setenv("ONCEFLOW_DATABASE_URL", "postgresql://first@127.0.0.1:1/a")
    get_settings.cache_clear()
    try:
        ledger = ProcessLedger()
        first = ledger.hooks()
        assert ledger.hooks() is first  # built once while the settings stay
        monkeypatch.setenv("ONCEFLOW_DATABASE_URL", "postgresql://second@127.0.0.1:1/b")
        get_settings.cache_clear()
        assert ledger.hooks() is not first
        pinned = ProcessLedger(get_settings())
        kept = pinned.hooks()
        get_settings.cache_clear()
        assert pinned.hooks() is kept  # settings given: its own, kept
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
