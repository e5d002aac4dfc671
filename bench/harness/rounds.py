"""Rounds: a candidate and its baseline in turns, and the figures of a run's rounds (the
median of per-round ratios, percentiles, a latency summary)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def rotated(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order of ``names``: each one first in turn, so none always runs first."""
    k = r % len(names) if names else 0
    return [*names[k:], *names[:k]]


def interleaved(
    contenders: dict[str, Callable[[], None]], calls: int, rounds: int, warmup: int = 200
) -> dict[str, Any]:
    """``rounds`` rounds of ``calls`` calls of each contender, in :func:`rotated` order, after
    ``warmup`` calls each (connections, scripts, caches); per contender its calls, the
    seconds they took and calls per second."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    spent = dict.fromkeys(contenders, 0.0)
    for r in range(rounds):
        for name in rotated(list(contenders), r):
            fn = contenders[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            spent[name] += time.perf_counter() - start
    total = calls * rounds
    return {name: {"pairs": total, "seconds": s, "per_s": total / s} for name, s in spent.items()}


def per_round_ratios(side: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """The ratio of each round's candidate figure to its baseline's of the same round, and
    their median (the figure a report gives: one slow round cannot carry it)."""
    ratios = [s / b for s, b in zip(side, base, strict=True)]
    return {"ratios": ratios, "median": statistics.median(ratios)}


def median_or_none(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def latency_ms(xs: Sequence[float]) -> dict[str, float]:
    """Seconds as a latency summary in milliseconds: p50, p99, mean, max."""
    return {
        "p50_ms": pct(xs, 50) * 1e3,
        "p99_ms": pct(xs, 99) * 1e3,
        "mean_ms": statistics.fmean(xs) * 1e3,
        "max_ms": max(xs) * 1e3,
    }
