"""One side of bench/tracing_bench.py's lock rounds: a process of its own, so that each side
imports its own onceflow (``PYTHONPATH``) and sets up (or not) its own tracer provider.

    python -P bench/tracing_side.py REDIS_URL SERVICE_NAME

It answers one JSON line with what it imported, then reads commands from stdin, one per
line: ``<path> <calls>``, and answers each with ``{"seconds": …}`` for that many calls of
the path on one Redis connection:

* ``pair``: ``RedisLockBackend.acquire`` + ``LockHandle.release``, uncontended;
* ``computed``: ``compute_once`` that finds nothing stored: acquire, double-check,
  compute (returns a constant), store (into a dict), release;
* ``preflight``: ``compute_once`` whose first check finds the value stored (no lock).

Tracing is set up from ``OTEL_*`` (``onceflow.tracing.configure``) when this onceflow has
it; ``SERVICE_NAME`` names the process when ``OTEL_SERVICE_NAME`` does not.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any

import redis

import onceflow
from onceflow.locks import RedisLockBackend, compute_once


def _value() -> str:
    return "v"


def main() -> int:
    url, service = sys.argv[1], sys.argv[2]
    try:
        tracing: Any = importlib.import_module("onceflow.tracing")
    except ImportError:  # an onceflow from before tracing
        tracing = None
    traced = bool(tracing is not None and tracing.configure(service))
    client = redis.Redis.from_url(url, single_connection_client=True)
    backend = RedisLockBackend(client)
    ws = f"bench-{service}"
    print(json.dumps({"onceflow": onceflow.__file__, "traced": traced}), flush=True)
    stored: dict[str, None] = {}  # store(value): the values computed, as keys
    job = 0
    for line in sys.stdin:
        path, count = line.split()
        n = int(count)
        stored.clear()
        start = time.perf_counter()
        if path == "pair":
            for _ in range(n):
                handle = backend.acquire(ws, "pair", "t", 60)
                assert handle is not None and handle.release()
        elif path in ("computed", "preflight"):
            found = "stored" if path == "preflight" else None

            def check(found: str | None = found) -> str | None:
                return found

            for _ in range(n):
                job += 1
                compute_once(
                    ws, f"job-{job}", "t", check=check, compute=_value, store=stored.setdefault,
                    backend=backend, watchdog=False,
                )  # fmt: skip
        else:
            raise SystemExit(f"unknown path {path!r}")
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds}), flush=True)
    if tracing is not None:
        tracing.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
