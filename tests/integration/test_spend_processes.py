"""Provider limits across processes: spawned callers never exceed the limits within any
window of the Redis clock, a caller killed holding permits gets them back to the others
after their TTL (counted), and a burst of one workspace does not starve the others."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from onceflow.errors import PermitCancelled, PermitTimeout
from onceflow.spend import Provider
from tests.integration.spend_parts import fresh, most_in_any_window


def _most_overlapping(spans: list[tuple[int, int]]) -> int:
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    # A slot given back at t and taken at t: the release comes first (-1 sorts before 1).
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _most_tokens_in_any_window(taken: list[tuple[int, int, int]], window_ms: int) -> int:
    times = sorted((t, k) for t, _, k in taken)
    best = 0
    for i, (start, _) in enumerate(times):
        best = max(best, sum(k for t, k in times[i:] if t < start + window_ms))
    return best


@pytest.mark.slow
def test_processes_never_exceed_the_limits(redis_url: str) -> None:
    from tests.integration.spend_callers import take_permits

    limits = {"rpm": 12, "tpm": 100, "concurrency": 3, "window_seconds": 1.0}
    name = fresh(redis_url).name
    with ProcessPoolExecutor(4, mp_context=mp.get_context("spawn")) as pool:
        runs = [pool.submit(take_permits, redis_url, name, limits, f"ws{i}", 10, 0.05)
                for i in range(4)]  # fmt: skip
        taken = [t for run in runs for t in run.result(timeout=120)]
    assert len(taken) == 40
    assert most_in_any_window([g for g, _, _ in taken], 1000) <= 12
    assert _most_tokens_in_any_window(taken, 1000) <= 100
    assert _most_overlapping([(g, s) for g, s, _ in taken]) <= 3
    # The limits were the bound, not idleness: 40 calls at 12 a second take over 3 s.
    assert max(g for g, _, _ in taken) - min(g for g, _, _ in taken) >= 2000


@pytest.mark.slow
def test_a_killed_holder_frees_its_slots_after_the_ttl(redis_url: str) -> None:
    name = fresh(redis_url).name
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.spend_callers", redis_url, name, "3", "2.0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        granted = [int(t) for t in holder.stdout.readline().split()]
        assert len(granted) == 3
    finally:
        holder.kill()  # SIGKILL: no finally, no settle
        holder.wait(timeout=10)
    provider = Provider(
        name, redis_url=redis_url, concurrency=3, permit_ttl=2.0, cold_start="empty"
    )
    assert provider.stats()["in_flight"] == 3
    with pytest.raises(PermitTimeout, match="concurrency"), provider.permit("ws", timeout=0.5):
        pass
    permits = [provider.permit("ws", timeout=10).__enter__() for _ in range(3)]
    # Each slot came back when its holder's permit expired (granted + TTL), not before.
    for new, old in zip(sorted(p.granted_at_ms for p in permits), sorted(granted), strict=True):
        assert new >= old + 2000
    assert provider.stats()["expired"] == 3


@pytest.mark.slow
def test_a_burst_does_not_starve_the_other_workspaces(redis_url: str) -> None:
    """One workspace with 200 waiting calls and three with 5 each, under 60 calls a window
    (a window of 6 s instead of a minute: the same shares, ten times faster). The big
    workspace's burst takes the first window; in the next one, while the others wait, each
    workspace gets a quarter (15) of it: the small ones are all served at its start."""
    provider = fresh(redis_url, rpm=60, window_seconds=6)
    stop = threading.Event()
    grants: list[tuple[str, int]] = []
    lock = threading.Lock()

    def call(ws: str) -> None:
        try:
            with provider.permit(ws, timeout=30, cancel=stop) as permit, lock:
                grants.append((ws, permit.granted_at_ms))
        except (PermitCancelled, PermitTimeout):
            pass

    big = [threading.Thread(target=call, args=("big",)) for _ in range(200)]
    for t in big:
        t.start()
    deadline = time.monotonic() + 20
    while len(grants) < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(grants) == 60  # the burst has the first window
    small = [threading.Thread(target=call, args=(f"small{i}",)) for i in range(3) for _ in range(5)]
    for t in small:
        t.start()
    for t in small:
        t.join(timeout=30)
    stop.set()
    for t in big:
        t.join(timeout=30)
    first_window_end = min(at for _, at in grants) + 6000
    small_at = [at for ws, at in grants if ws != "big"]
    assert len(small_at) == 15
    assert max(small_at) < first_window_end + 1000, "the small workspaces waited past the burst"
    # While all four waited, the big workspace held at most its quarter of any window.
    all_waiting_until = min(max(at for w, at in grants if w == f"small{i}") for i in range(3))
    big_at = sorted(at for ws, at in grants if ws == "big")
    for t in big_at:
        if first_window_end <= t < all_waiting_until:
            assert sum(1 for b in big_at if t - 6000 < b <= t) <= 15
    assert most_in_any_window([at for _, at in grants], 6000) <= 60
