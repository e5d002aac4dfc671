"""Validation of what a provider is declared with and what a permit is asked for, and how
a permit waits (:class:`Wait`).

Each check answers the value or raises :class:`~onceflow.errors.InvalidRequest` naming the
parameter and the value; nothing is written before every check has passed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

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


#: How often a waiting permit calls its heartbeat, by default (a stage's lease is far longer).
DEFAULT_HEARTBEAT_EVERY: Final = 10.0


class CancelFlag(Protocol):
    """What ends a permit's wait once set: a ``threading.Event``, or any flag with ``is_set``."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class Wait:
    """How a permit waits: at most ``timeout`` seconds, calling ``heartbeat`` every
    ``heartbeat_every`` seconds while it waits, and ending once ``cancel`` is set."""

    timeout: float
    heartbeat: Callable[[], Any] | None = None
    heartbeat_every: float = DEFAULT_HEARTBEAT_EVERY
    cancel: CancelFlag | None = None

    @classmethod
    def checked(
        cls,
        timeout: object,
        heartbeat: object = None,
        heartbeat_every: object = DEFAULT_HEARTBEAT_EVERY,
        cancel: object = None,
    ) -> Wait:
        if heartbeat is not None and not callable(heartbeat):
            raise InvalidRequest(f"heartbeat must be a function or None, got {heartbeat!r}")
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise InvalidRequest(f"cancel must be a threading.Event or None, got {cancel!r}")
        return cls(
            seconds("timeout", timeout),
            heartbeat,
            seconds("heartbeat_every", heartbeat_every, low=0.0, zero=False),
            cancel,  # type: ignore[arg-type]  # checked above: it has is_set
        )

    def beats(self, clock: Callable[[], float]) -> Callable[[], bool]:
        """A function that answers True when the heartbeat is due (then not again for
        ``heartbeat_every`` seconds); the first is due ``heartbeat_every`` after now."""
        due = [clock() + self.heartbeat_every]

        def is_due() -> bool:
            now = clock()
            if self.heartbeat is None or now < due[0]:
                return False
            due[0] = now + self.heartbeat_every
            return True

        return is_due
