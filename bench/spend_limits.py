"""Provider-limit algorithms side by side: GCRA, the two-window approximation, and the exact
sliding log that ``onceflow/spend/acquire.lua`` uses — speed, and what each grants at a
window's boundary.

    .venv/bin/python bench/spend_limits.py [--calls 5000] [--json]

Redis is a private ``redis-server`` (or ``valkey-server``) this script starts on a free
loopback port with no persistence. Every script reads the Redis clock (``TIME``).

1. Speed: ``--calls`` acquires from one client, one connection, by ``EVALSHA``, for each
   algorithm in interleaved blocks of 500, the limit high enough that every call is
   granted and the window (1 s) short enough that the log is in its steady state (entries
   leave it as fast as they come). Calls/s, and Redis's own time per call
   (``INFO commandstats``, ``usec_per_call`` of ``evalsha``).
2. The boundary: a limit of 20 per 1 s window. The client waits for 0.9 s into a window,
   asks as fast as it can for 0.3 s (a burst at the end of one window and the start of
   the next), then once every 10 ms for 1.5 s. The most grants within any 1 s interval
   (Redis times of the grants): a provider that counts per minute (fixed or sliding)
   would answer 429 to everything past 20.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from bench.harness.redis_server import private_redis
from onceflow.spend.limits import ACQUIRE, KEEP_MARGIN_MS, STALE_MS, ProviderKeys

GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local emission = window / limit
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + emission
if new_tat - now > window then return {0, math.floor(now)} end
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now) + 1)
return {1, math.floor(now)}
"""

TWO_WINDOWS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local index = math.floor(now / window)
local elapsed = now - index * window
local cur = tonumber(redis.call('HGET', KEYS[1], tostring(index)) or '0')
local prev = tonumber(redis.call('HGET', KEYS[1], tostring(index - 1)) or '0')
if prev * (window - elapsed) / window + cur + 1 > limit then return {0, now} end
redis.call('HINCRBY', KEYS[1], tostring(index), 1)
redis.call('HDEL', KEYS[1], tostring(index - 2))
redis.call('PEXPIRE', KEYS[1], 3 * window)
return {1, now}
"""


class Algorithm:
    """One algorithm's script and how to call it for one permit."""

    def __init__(
        self, name: str, client: redis.Redis, text: str | None, limit: int, window_ms: int
    ):
        self.name = name
        self.client = client
        self.limit = limit
        self.window_ms = window_ms
        self.provider = f"bench-{uuid.uuid4().hex[:8]}"
        if text is None:  # onceflow's own
            self.sha = client.script_load(ACQUIRE.text)
            self.keys = ProviderKeys(self.provider).acquire()
            client.set(ProviderKeys(self.provider).epoch, 0)  # a known provider: no cold start
        else:
            self.sha = client.script_load(text)
            self.keys = [f"{{bench}}:{self.provider}"]

    def acquire(self) -> tuple[bool, int]:
        if self.name == "sliding log":
            keep = self.window_ms + 600_000 + KEEP_MARGIN_MS
            args = [uuid.uuid4().hex, "ws", 1, self.limit, -1, -1, self.window_ms, 600_000,
                    "empty", STALE_MS, 250, "", keep]  # fmt: skip
        else:
            args = [self.limit, self.window_ms]
        reply: Any = self.client.evalsha(self.sha, len(self.keys), *self.keys, *args)
        granted = int(reply[0]) == 1
        return granted, int(reply[1])


def algorithms(client: redis.Redis, limit: int, window_ms: int) -> list[Algorithm]:
    return [
        Algorithm("GCRA", client, GCRA, limit, window_ms),
        Algorithm("two windows", client, TWO_WINDOWS, limit, window_ms),
        Algorithm("sliding log", client, None, limit, window_ms),
    ]


def speed(client: redis.Redis, calls: int) -> dict[str, dict[str, float]]:
    algos = algorithms(client, limit=10_000_000, window_ms=1000)
    rates: dict[str, list[float]] = {a.name: [] for a in algos}
    server_us: dict[str, float] = {}
    block = 500
    for _ in range(max(1, calls // block)):
        for algo in algos:
            start = time.perf_counter()
            for _ in range(block):
                algo.acquire()
            rates[algo.name].append(block / (time.perf_counter() - start))
    for algo in algos:  # Redis's own time per call, one algorithm at a time
        client.config_resetstat()
        for _ in range(block):
            algo.acquire()
        stats: Any = client.info("commandstats")
        server_us[algo.name] = float(stats["cmdstat_evalsha"]["usec_per_call"])
    return {
        name: {"calls_per_s": round(statistics.median(r)), "redis_us_per_call": server_us[name]}
        for name, r in rates.items()
    }


def most_in_any_window(times: list[int], window_ms: int) -> int:
    times = sorted(times)
    best = start = 0
    for end, t in enumerate(times):
        while times[start] <= t - window_ms:
            start += 1
        best = max(best, end - start + 1)
    return best


def boundary(client: redis.Redis, limit: int = 20, window_ms: int = 1000) -> dict[str, int]:
    found = {}
    for algo in algorithms(client, limit, window_ms):
        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        time.sleep(((window_ms - now_ms % window_ms) + 0.9 * window_ms) / 1000)
        grants = []
        burst_end = time.monotonic() + 0.3 * window_ms / 1000
        while time.monotonic() < burst_end:
            ok, at = algo.acquire()
            if ok:
                grants.append(at)
        trickle_end = time.monotonic() + 1.5 * window_ms / 1000
        while time.monotonic() < trickle_end:
            ok, at = algo.acquire()
            if ok:
                grants.append(at)
            time.sleep(0.01)
        found[algo.name] = most_in_any_window(grants, window_ms)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with private_redis() as url:
        client = redis.Redis.from_url(url)
        result = {"speed": speed(client, args.calls), "boundary_limit_20": boundary(client)}
    if args.json:
        print(json.dumps(result))
        return
    print("algorithm      calls/s   Redis µs/call   most granted in any window (limit 20)")
    for name, row in result["speed"].items():
        print(f"{name:<12} {row['calls_per_s']:>9} {row['redis_us_per_call']:>15.2f}"
              f" {result['boundary_limit_20'][name]:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
