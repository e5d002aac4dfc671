"""Validation of what a provider is declared with and what a permit is asked for.

Each check answers the value or raises :class:`~onceflow.errors.InvalidRequest` naming the
parameter and the value; nothing is written before every check has passed.
"""

from __future__ import annotations

import math

from onceflow.errors import InvalidRequest


def limit(name: str, value: object) -> int | None:
    """A limit: None (no limit) or a whole number at least 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(
            f"{name} must be a whole number at least 1, or None for no limit; got {value!r}"
        )
    if value < 1:
        raise InvalidRequest(f"{name} must be at least 1 (None means no limit), got {value}")
    return value


def seconds(
    name: str, value: object, *, low: float = 0.0, high: float = 86_400.0, zero: bool = True
) -> float:
    """A duration in seconds: a finite number in [low, high] (above low when not ``zero``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number of seconds, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be finite, got {value!r}")
    if number < low or (not zero and number <= low) or number > high:
        bound = f"above {low:g}" if not zero else f"at least {low:g}"
        raise InvalidRequest(f"{name} must be {bound} and at most {high:g} seconds, got {value!r}")
    return number


def tokens(name: str, value: object) -> int:
    """A token count: a whole number, not negative."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be a whole number of tokens, got {value!r}")
    if value < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value}")
    return value
