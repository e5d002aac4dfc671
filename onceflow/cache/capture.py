"""What a cached computation paid: the provider calls settled while it ran.

The result cache keeps, with an entry, what computing it cost, so that each later hit
can record the money it saved. :func:`collecting` opens a collection for the current
context (a ``contextvars`` variable: the thread, or the asyncio task, that computes);
:func:`settled` — called by a spend permit settled with its usage — adds a call to it.
A call settled in another thread than the computation's is not seen: the entry's cost is
then unknown (None), never a guess.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal


@dataclass
class Paid:
    """The provider calls settled within one computation, summed."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    #: None once any call's cost was unknown (a provider without a price).
    cost: Decimal | None = Decimal(0)
    providers: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)

    @property
    def provider(self) -> str | None:
        """The provider that served, when exactly one did."""
        return self.providers[0] if len(set(self.providers)) == 1 else None

    @property
    def model(self) -> str | None:
        """The model that served, when exactly one did."""
        return self.models[0] if len(set(self.models)) == 1 and self.calls == 1 else None


_current: contextvars.ContextVar[Paid | None] = contextvars.ContextVar(
    "onceflow_cache_paid", default=None
)


@contextmanager
def collecting() -> Iterator[Paid]:
    """Collect the calls settled in this context until the block ends."""
    paid = Paid()
    token = _current.set(paid)
    try:
        yield paid
    finally:
        _current.reset(token)


def settled(
    provider: str,
    model: str | None,
    input_tokens: int,
    output_tokens: int,
    cost: Decimal | None,
) -> None:
    """A provider call settled with its usage: counted in the open collection, if any."""
    paid = _current.get()
    if paid is None:
        return
    paid.calls += 1
    paid.input_tokens += input_tokens
    paid.output_tokens += output_tokens
    paid.cost = None if cost is None or paid.cost is None else paid.cost + cost
    paid.providers.append(provider)
    if model is not None:
        paid.models.append(model)
