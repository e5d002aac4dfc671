"""What one provider call used, and what a provider charges for it."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from onceflow.errors import InvalidRequest

_MILLION = Decimal(1_000_000)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value}")
    return value


def _money(name: str, value: object) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | str):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}")
    try:
        amount = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except ArithmeticError:
        raise InvalidRequest(f"{name} must be a number, got {value!r}") from None
    if not amount.is_finite():
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    if amount < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value!r}")
    return amount


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens one call used, as the provider reported them (non-negative integers)."""

    input_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        _count("input_tokens", self.input_tokens)
        _count("output_tokens", self.output_tokens)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Price:
    """A provider's price per million input and output tokens (finite, non-negative)."""

    input_per_million: Decimal
    output_per_million: Decimal

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "input_per_million", _money("input_per_million", self.input_per_million)
        )
        object.__setattr__(
            self, "output_per_million", _money("output_per_million", self.output_per_million)
        )

    def cost(self, usage: Usage) -> Decimal:
        """What ``usage`` costs at this price."""
        return (
            usage.input_tokens * self.input_per_million
            + usage.output_tokens * self.output_per_million
        ) / _MILLION


__all__ = ["Price", "Usage"]
