"""Layer-1 batch benchmark: ``depth()`` vs ``counts()``, ``complete_many`` vs N ``complete``.

    .venv/bin/python bench/batch_bench.py [--finished 200000] [--rounds 15] [--batch 100]

Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), the admin URL only: the run
creates its own database and drops it at the end (``bench.harness.bench_database``).

1. Depth. A table with ``--finished`` succeeded rows (the history) and about 2,000
   live ones (1,500 queued, 500 of them claimed: running). First the plans:
   ``EXPLAIN (ANALYZE, BUFFERS)`` of both depth statements, checked to read only the
   partial indexes ix_wpr_claim / ix_wpr_lease (no Seq Scan, no other index); then
   ``Queue.depth()`` and ``Queue.counts()`` timed call by call, interleaved, the
   median of each and their ratio.
2. Batched completion. Each round claims 2 x ``--batch`` rows (outside the timers),
   then completes one half with ``--batch`` single ``Queue.complete`` calls and the
   other with one ``Queue.complete_many`` call, in alternating order; rows/s of each
   per round, the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import admin_url, bench_database, log, raw_connect
from bench.queue_bench import (
    SEED_FINISHED,
    SEED_QUEUED,
    TABLE,
    WC,
)
from onceflow.queue import Queue, sql


def plan_of(url: str, query: str, params: dict[str, Any]) -> str:
    with raw_connect(url) as conn:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query, params).fetchall()
    return "\n".join(r[0] for r in rows)


def check_plan(plan: str) -> None:
    """The depth statements must read the live rows through their partial indexes only."""
    if "Seq Scan" in plan:
        raise SystemExit("depth plan has a Seq Scan:\n" + plan)
    for line in plan.splitlines():
        if " using " in line and not ("ix_wpr_claim" in line or "ix_wpr_lease" in line):
            raise SystemExit("depth plan reads another index:\n" + plan)
    if "ix_wpr_claim" not in plan or "ix_wpr_lease" not in plan:
        raise SystemExit("depth plan does not read both partial indexes:\n" + plan)


def bench_depth(url: str, finished: int, rounds: int) -> dict[str, float]:
    q = Queue(url)
    with raw_connect(url) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
        conn.execute(SEED_FINISHED, {"wc": WC, "lo": 1, "hi": finished})
        conn.execute(SEED_QUEUED, {"prefix": "live-", "wc": WC, "n": 1500})
    claimed = q.claim_next(WC, "bench", limit=500, lease_seconds=600)
    with raw_connect(url) as conn:
        conn.execute(f"VACUUM ANALYZE {TABLE}")
    log(f"depth: {finished:,} finished rows, 1,500 queued ({len(claimed)} running)")
    for name, query, params in (
        ("every class", sql.DEPTH_ALL.sql, {"now": None}),
        ("one class", sql.DEPTH_FOR.sql, {"now": None, "worker_classes": [WC]}),
    ):
        plan = plan_of(url, query, params)
        check_plan(plan)
        print(f"EXPLAIN depth ({name}):\n{plan}\n")
    print("EXPLAIN counts():\n" + plan_of(url, sql.COUNTS.sql, {}) + "\n")
    depth = q.depth()
    assert depth[WC].queued_due == 1000 and depth[WC].running == 500, depth
    for _ in range(3):  # warm up
        q.depth()
        q.counts()
    d_times: list[float] = []
    c_times: list[float] = []
    for i in range(rounds):
        pair = [(q.depth, d_times), (q.counts, c_times)]
        for fn, out in pair if i % 2 == 0 else reversed(pair):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            out.append(time.perf_counter() - t0)
    d, c = statistics.median(d_times), statistics.median(c_times)
    return {"depth_ms": d * 1e3, "counts_ms": c * 1e3, "ratio": c / d}


def bench_complete(url: str, batch: int, rounds: int) -> dict[str, float]:
    q = Queue(url)
    with raw_connect(url) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
        conn.execute(SEED_QUEUED, {"prefix": "c-", "wc": WC, "n": 2 * batch * (rounds + 1)})
        conn.execute(f"VACUUM ANALYZE {TABLE}")
    result = {"ok": True, "score": 0.5}
    singles: list[float] = []
    batched: list[float] = []
    ratios: list[float] = []
    for i in range(rounds + 1):  # round 0 warms up
        one = q.claim_next(WC, "bench", limit=batch, lease_seconds=600)
        many = q.claim_next(WC, "bench", limit=batch, lease_seconds=600)
        assert len(one) == len(many) == batch
        timed: dict[str, float] = {}

        def run_single(claims: list[Any] = one) -> None:
            for c in claims:
                q.complete(c, result)

        def run_many(claims: list[Any] = many) -> None:
            out = q.complete_many([(c, result) for c in claims])
            assert all(not isinstance(r, Exception) for r in out)

        order = [("single", run_single), ("many", run_many)]
        for name, fn in order if i % 2 == 0 else reversed(order):
            t0 = time.perf_counter()
            fn()
            timed[name] = time.perf_counter() - t0
        if i == 0:
            continue
        singles.append(batch / timed["single"])
        batched.append(batch / timed["many"])
        ratios.append(timed["single"] / timed["many"])
    return {
        "single_rows_s": statistics.median(singles),
        "many_rows_s": statistics.median(batched),
        "median_ratio": statistics.median(ratios),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--finished", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    admin = admin_url()
    with bench_database(admin) as url:
        d = bench_depth(url, args.finished, args.rounds * 2)
        c = bench_complete(url, args.batch, args.rounds)
    load = os.getloadavg()[0]
    print(
        f"depth(): median {d['depth_ms']:.2f} ms; counts(): median {d['counts_ms']:.2f} ms; "
        f"counts/depth = {d['ratio']:.1f}x  ({args.finished:,} finished rows, ~2,000 live)"
    )
    print(
        f"complete: {c['single_rows_s']:,.0f} rows/s one by one; complete_many "
        f"({args.batch} rows): {c['many_rows_s']:,.0f} rows/s; median ratio "
        f"{c['median_ratio']:.1f}x over {args.rounds} rounds  (load average {load:.2f})"
    )


if __name__ == "__main__":
    main()
