"""Parts the spend tests share: hooks that record what a provider tells them, a provider
with a fresh name, and the Redis clock."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

import redis

from onceflow.spend import Grant, Provider, Usage


class RecordingHooks:
    """Spend hooks that keep every call (thread-safe); ``refuse`` makes admit raise."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, Any]] = []
        self.refuse: Exception | None = None
        self.fail_settles = 0

    def admit(self, grant: Grant) -> None:
        with self.lock:
            self.calls.append(("admit", grant))
        if self.refuse is not None:
            raise self.refuse

    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime,
        ended_at: datetime,
    ) -> None:
        with self.lock:
            if self.fail_settles:
                self.fail_settles -= 1
                raise ConnectionError("the ledger's database did not answer")
            self.calls.append(
                ("settle", (grant, usage, outcome, provider, model, cost, started_at, ended_at))
            )

    def release(self, grant: Grant) -> None:
        with self.lock:
            self.calls.append(("release", grant))

    def kinds(self) -> list[str]:
        with self.lock:
            return [kind for kind, _ in self.calls]

    def settles(self) -> list[tuple[Any, ...]]:
        with self.lock:
            return [args for kind, args in self.calls if kind == "settle"]


def fresh(redis_url: str, **limits: Any) -> Provider:
    """A provider of a name no other test uses, trusting an empty Redis unless told."""
    limits.setdefault("cold_start", "empty")
    return Provider(f"p-{uuid.uuid4().hex[:10]}", redis_url=redis_url, **limits)


def redis_ms(url: str) -> int:
    """The Redis clock now, in ms."""
    seconds, micros = redis.Redis.from_url(url).time()
    return int(seconds) * 1000 + int(micros) // 1000


def most_in_any_window(times_ms: list[int], window_ms: int) -> int:
    """The most grant times that fall within one window [t, t + window_ms)."""
    times = sorted(times_ms)
    best, start = 0, 0
    for end, t in enumerate(times):
        while times[start] <= t - window_ms:
            start += 1
        best = max(best, end - start + 1)
    return best
