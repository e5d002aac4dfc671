"""Caller processes of the spend tests (spawned: a fresh interpreter each)."""

from __future__ import annotations

import sys
import time
from typing import Any

from onceflow.spend import Provider, Usage


def take_permits(
    redis_url: str, name: str, limits: dict[str, Any], workspace: str, n: int, hold: float
) -> list[tuple[int, int, int]]:
    """Take ``n`` permits one after another, each held ``hold`` seconds and settled at half
    its estimate: (grant ms, settle ms, tokens used) on the Redis clock, per permit."""
    provider = Provider(name, redis_url=redis_url, cold_start="empty", **limits)
    taken = []
    for _ in range(n):
        with provider.permit(workspace, tokens=10, timeout=60) as permit:
            time.sleep(hold)
            permit.settle(Usage(3, 2))
        assert permit.settled_at_ms is not None
        taken.append((permit.granted_at_ms, permit.settled_at_ms, 5))
    return taken


def hold_forever(redis_url: str, name: str, n: int, ttl: float) -> None:
    """Take ``n`` permits, say so on stdout, and never give them back (killed by the test)."""
    provider = Provider(
        name, redis_url=redis_url, concurrency=n, permit_ttl=ttl, cold_start="empty"
    )
    held = [provider.permit("ws").__enter__() for _ in range(n)]
    print(" ".join(str(p.granted_at_ms) for p in held), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    hold_forever(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
