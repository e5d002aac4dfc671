"""What one provider call used (tokens in and out) and what a provider charges for it.

:class:`Usage` is what a caller reports when it settles a permit; :class:`Price` turns it
into money. Both refuse nonsense at construction (a negative or non-integer token count,
a negative or non-finite price), so a settled call never records a value that cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from onceflow.errors import InvalidRequest
from onceflow.spend.checks import tokens

_MILLION = Decimal(1_000_000)


def _check_price(name: str, value: object) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, Decimal | int | float | str):
        raise InvalidRequest(f"{name} must be a number (a Decimal), got {value!r}")
    try:
        price = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
    except (InvalidOperation, ValueError):
        raise InvalidRequest(f"{name} must be a number (a Decimal), got {value!r}") from None
    if not price.is_finite():
        raise InvalidRequest(f"{name} must be finite, got {value!r}")
    if price < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value!r}")
    return price


@dataclass(frozen=True)
class Usage:
    """The tokens one call used, as the provider reported them."""

    input_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        tokens("input_tokens", self.input_tokens)
        tokens("output_tokens", self.output_tokens)

    @property
    def total_tokens(self) -> int:
        """Input and output tokens together (what a tokens-per-minute limit counts)."""
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True)
class Price:
    """A provider's price per million input and per million output tokens.

    Given as a ``Decimal``, an ``int``, or a decimal string (``"2.50"``); a ``float`` is read
    through its shortest decimal form (``0.1`` is ``Decimal("0.1")``).
    """

    input_per_million: Decimal
    output_per_million: Decimal

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ once, at construction.
        object.__setattr__(
            self, "input_per_million", _check_price("input_per_million", self.input_per_million)
        )
        object.__setattr__(
            self,
            "output_per_million",
            _check_price("output_per_million", self.output_per_million),
        )

    def cost(self, usage: Usage) -> Decimal:
        """What ``usage`` costs at this price (exact decimal arithmetic, never a float)."""
        if not isinstance(usage, Usage):
            raise InvalidRequest(f"cost() takes a Usage, got {usage!r}")
        return (
            usage.input_tokens * self.input_per_million
            + usage.output_tokens * self.output_per_million
        ) / _MILLION
