"""Where the result cache keeps its entries: Postgres (``onceflow.cache.ResultCache``) beside
the same operations in Redis (``SET key value PX ttl`` / ``GET``), one client.

    .venv/bin/python bench/result_cache.py [--ops 1000] [--json]

Postgres: a scratch database made on ``ONCEFLOW_TEST_DATABASE_URL`` (else
``ONCEFLOW_DATABASE_URL``), migrated, dropped at the end. Redis: ``ONCEFLOW_TEST_REDIS_URL``
(else ``ONCEFLOW_REDIS_URL``); the bench's keys are deleted at the end. For each value size
(1 KiB and 64 KiB of JSON) and each store: ``--ops`` writes of distinct keys, then as many
reads of them (hits), then as many reads of absent keys (misses); p50 and p95 per operation
in microseconds, and operations per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
import redis
from sqlalchemy import make_url

from onceflow.cache import CacheKey, ResultCache
from onceflow.db import dispose_engines
from onceflow.migrate import migrate


def _libpq(url: str) -> str:
    u = make_url(url)
    return u.set(drivername="postgresql").render_as_string(hide_password=False)


def _timed(n: int, op: Callable[[int], Any]) -> dict[str, float]:
    took = []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        op(i)
        took.append((time.perf_counter() - t) * 1e6)
    total = time.perf_counter() - start
    took.sort()
    return {
        "p50_us": round(statistics.median(took), 1),
        "p95_us": round(took[int(len(took) * 0.95)], 1),
        "ops_per_s": round(n / total),
    }


def bench_postgres(url: str, n: int, value: Any) -> dict[str, dict[str, float]]:
    cache = ResultCache(url)
    keys = [CacheKey("global", f"pg-{uuid.uuid4().hex}", 3600) for _ in range(n)]
    text = cache.encode(value)
    out = {"put": _timed(n, lambda i: cache.put("bench", keys[i], text))}
    out["get_hit"] = _timed(n, lambda i: cache.get("bench", keys[i]))
    absent = [CacheKey("global", f"none-{uuid.uuid4().hex}", 3600) for _ in range(n)]
    out["get_miss"] = _timed(n, lambda i: cache.get("bench", absent[i]))
    return out


def bench_redis(url: str, n: int, value: Any) -> dict[str, dict[str, float]]:
    client = redis.Redis.from_url(url)
    prefix = f"onceflow-bench-cache:{uuid.uuid4().hex}:"
    try:
        out = {
            "put": _timed(n, lambda i: client.set(f"{prefix}{i}", json.dumps(value), px=3_600_000))
        }
        out["get_hit"] = _timed(n, lambda i: json.loads(client.get(f"{prefix}{i}") or "null"))
        out["get_miss"] = _timed(n, lambda i: client.get(f"{prefix}none-{i}"))
        return out
    finally:
        for i in range(0, n, 500):
            client.delete(*[f"{prefix}{j}" for j in range(i, min(i + 500, n))])
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    admin = os.environ.get("ONCEFLOW_TEST_DATABASE_URL") or os.environ["ONCEFLOW_DATABASE_URL"]
    redis_url = os.environ.get("ONCEFLOW_TEST_REDIS_URL") or os.environ["ONCEFLOW_REDIS_URL"]
    name = f"onceflow_bench_cache_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(_libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(admin).set(database=name).render_as_string(hide_password=False)
    results: dict[str, Any] = {}
    try:
        migrate(url)
        for size in (1024, 64 * 1024):
            value = {"text": "x" * size}
            results[f"{size // 1024}KiB"] = {
                "postgres": bench_postgres(url, args.ops, value),
                "redis": bench_redis(redis_url, args.ops, value),
            }
    finally:
        dispose_engines()
        with psycopg.connect(_libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'value':6} {'store':9} {'op':9} {'p50 µs':>8} {'p95 µs':>8} {'ops/s':>8}")
    for size, stores in results.items():
        for store, ops in stores.items():
            for op, r in ops.items():
                print(
                    f"{size:6} {store:9} {op:9} {r['p50_us']:8} {r['p95_us']:8} {r['ops_per_s']:8}"
                )


if __name__ == "__main__":
    main()
