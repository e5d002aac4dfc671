"""The providers of a deployment, declared once: in code (:func:`register`) or in the
settings (``ONCEFLOW_PROVIDERS``), the same in every process.

``ONCEFLOW_PROVIDERS`` is JSON, an object of provider name to its declaration::

    {"openai": {"rpm": 500, "tpm": 200000, "concurrency": 20,
                "input_per_million": "2.50", "output_per_million": "10.00", "model": "gpt-4o"},
     "anthropic": {"rpm": 50, "tpm": 40000}}

Every key is a keyword of :class:`~onceflow.spend.provider.Provider` but ``price``, which is
given as ``input_per_million`` and ``output_per_million`` (decimal strings keep cents exact).
"""

from __future__ import annotations

import threading
from typing import Any

from onceflow.errors import InvalidRequest
from onceflow.settings import Settings, get_settings
from onceflow.spend.hooks import NO_HOOKS, SpendHooks
from onceflow.spend.provider import Provider
from onceflow.spend.usage import Price

_providers: dict[str, Provider] = {}
_lock = threading.Lock()
_loaded: set[int] = set()
_default_hooks: list[SpendHooks] = [NO_HOOKS]

#: The keys of one declaration in ``ONCEFLOW_PROVIDERS``.
DECLARATION_KEYS = frozenset({
    "rpm", "tpm", "concurrency", "input_per_million", "output_per_million", "model",
    "operation", "window_seconds", "permit_ttl", "cooldown", "max_cooldown", "cold_start",
})  # fmt: skip


class UnknownProvider(InvalidRequest, LookupError):
    """No provider of this name is declared."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = list(known)
        names = ", ".join(known) if known else "none"
        super().__init__(
            f"no provider named {name!r} is declared (declared: {names}); declare it with "
            "onceflow.spend.register(Provider(...)) or in ONCEFLOW_PROVIDERS"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.known))


def register(provider: Provider) -> Provider:
    """Declare ``provider``; a second declaration of its name must be the same (it then
    answers the first), else :class:`InvalidRequest`."""
    if not isinstance(provider, Provider):
        raise InvalidRequest(f"register takes a Provider, got {provider!r}")
    with _lock:
        known = _providers.get(provider.name)
        if known is None:
            if provider.hooks is NO_HOOKS:
                provider.hooks = _default_hooks[0]
            _providers[provider.name] = provider
            return provider
    if known.declaration() != provider.declaration():
        raise InvalidRequest(
            f"provider {provider.name!r} is already declared as {known.declaration()}, "
            f"not {provider.declaration()}: every process must declare it the same"
        )
    return known


def get_provider(name: str, *, settings: Settings | None = None) -> Provider:
    """The declared provider ``name`` (those of ``ONCEFLOW_PROVIDERS`` are declared at the
    first look-up); :class:`UnknownProvider` if there is none."""
    load_settings(settings or get_settings())
    provider = _providers.get(name)
    if provider is None:
        raise UnknownProvider(name, sorted(_providers))
    return provider


def providers(*, settings: Settings | None = None) -> list[Provider]:
    """Every declared provider, by name."""
    load_settings(settings or get_settings())
    return [_providers[name] for name in sorted(_providers)]


def use_hooks(hooks: SpendHooks) -> None:
    """Give ``hooks`` (a spend ledger) to every declared provider that has none of its own
    (the :data:`~onceflow.spend.hooks.NO_HOOKS` default), and to those ``ONCEFLOW_PROVIDERS``
    declares later."""
    if not all(callable(getattr(hooks, m, None)) for m in ("admit", "settle", "release")):
        raise InvalidRequest(f"hooks must have admit, settle and release, got {hooks!r}")
    with _lock:
        _default_hooks[0] = hooks
        for provider in _providers.values():
            if provider.hooks is NO_HOOKS:
                provider.hooks = hooks


def default_hooks() -> SpendHooks:
    """The hooks a provider declared without its own gets (:func:`use_hooks`)."""
    return _default_hooks[0]


def load_settings(settings: Settings, *, hooks: SpendHooks | None = None) -> list[Provider]:
    """Declare the providers of ``settings.providers`` (once per settings object), with
    ``hooks`` (default: those of :func:`use_hooks`)."""
    if id(settings) in _loaded:
        return []
    hooks = _default_hooks[0] if hooks is None else hooks
    made = [from_declaration(name, spec, hooks=hooks) for name, spec in settings.providers.items()]
    declared = [register(p) for p in made]
    _loaded.add(id(settings))
    return declared


def from_declaration(name: str, spec: Any, *, hooks: SpendHooks = NO_HOOKS) -> Provider:
    """A :class:`Provider` from its JSON declaration (every key checked)."""
    if not isinstance(spec, dict):
        raise InvalidRequest(f"provider {name!r}: a declaration is a JSON object, got {spec!r}")
    unknown = sorted(set(spec) - DECLARATION_KEYS)
    if unknown:
        raise InvalidRequest(
            f"provider {name!r}: unknown keys {unknown} (known: {sorted(DECLARATION_KEYS)})"
        )
    options = dict(spec)
    prices = (options.pop("input_per_million", None), options.pop("output_per_million", None))
    price = None
    if prices != (None, None):
        if None in prices:
            raise InvalidRequest(
                f"provider {name!r}: give both input_per_million and output_per_million"
            )
        price = Price(prices[0], prices[1])
    return Provider(name, price=price, hooks=hooks, **options)


def forget() -> None:
    """Forget every declaration (tests)."""
    with _lock:
        _providers.clear()
        _loaded.clear()
        _default_hooks[0] = NO_HOOKS
