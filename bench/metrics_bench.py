"""What Prometheus metrics cost a draining worker: no scraping vs an aggressive scraper.

    .venv/bin/python bench/metrics_bench.py [--n 4000] [--rounds 8] [--concurrency 8] [--json]

The worker is the standalone one (``onceflow work``, one process, threads; no
Celery), started as a user would, on a no-op handler (``bench.metrics_bench:noop``),
so the queue's own overhead — where every metric is recorded — is all there is to
measure. Four sides, interleaved in every round, each on a fresh table of N
requests enqueued before the worker starts:

* ``metrics``: ``PROMETHEUS_MULTIPROC_DIR`` set (a fresh empty directory: every
  recording writes the process's mmap file) and ``--metrics-port``, never scraped;
* ``scraped``: the same, with a scraper hitting that port every 0.5 s during the
  drain (Prometheus scrapes every 15 s by default: this is 30 times as often). The
  server runs inside the worker process, so each scrape's merge of the files and its
  database query (the live counts by class and stage) compete with the worker;
* ``exporter``: the same, scraped every 0.5 s through a separate ``onceflow metrics``
  process over the same directory (the worker only writes its files);
* ``in-memory``: no ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's in-process
  values), not scraped: the price of multiprocess mode's file writes.

Then one scrape's direct cost (wall time, and the serving process's CPU) with 0, 4,000
and 40,000 live queued rows: the figure a shared, noisy machine disturbs least.

The rate is (N - 1) / (last finished_at - first finished_at), both by the database
clock, so worker start-up is outside it; so is the worker's CPU per request (user +
system seconds of the worker process from its first finished request to the last, from
/proc), which a shared machine's load disturbs less than the wall-clock rate. Reported:
each side's medians, and the medians of the per-round ratios against ``metrics``.
Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default ``postgresql+psycopg://root@127.0.0.1:5432/postgres``),
used as the admin URL: the run creates ``onceflow_bench_metrics_<random>`` and drops it
at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench.harness import (
    ROOT,
    admin_url,
    bench_database,
    command_line,
    cpu_seconds,
    free_port,
    libpq,
    log,
    per_round_ratios,
)

WC = "mbench"
SIDES = ("metrics", "scraped", "exporter", "in-memory")


def noop(ctx: Any) -> dict[str, Any]:
    """The benchmark's handler: nothing, so the queue's own work is all that is timed."""
    return {}


class Scraper(threading.Thread):
    """GET /metrics every ``interval`` seconds until stopped; counts scrapes and their time."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.stop_event = threading.Event()
        self.times: list[float] = []
        self.errors = 0

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:  # noqa: S310
                    resp.read()
                self.times.append(time.perf_counter() - start)
            except OSError:
                self.errors += 1  # the server is not up yet (start-up) or going down


def one_drain(url: str, side: str, n: int, concurrency: int) -> dict[str, Any]:
    from onceflow.models.requests import NewRequest
    from onceflow.queue import Queue

    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("TRUNCATE workspace_process_requests")
    queue = Queue(url)
    items = [NewRequest("ws", f"j{i}", "noop", worker_class=WC) for i in range(n)]
    for start in range(0, n, 5000):
        queue.enqueue_many(items[start : start + 5000])
    port = free_port()
    env = {**os.environ, "ONCEFLOW_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    tmp = None
    if side != "in-memory":
        tmp = tempfile.mkdtemp(prefix="onceflow-mbench-")
        env["PROMETHEUS_MULTIPROC_DIR"] = tmp  # fresh and empty, as a start script makes it
    args = [sys.executable, "-m", "onceflow.cli", "work", "bench.metrics_bench:noop", "-w", WC]
    args += ["-c", str(concurrency), "--no-sweep", "--loglevel", "WARNING"]
    args += ["--metrics-port", str(port)]
    exporter = None
    if side == "exporter":  # a separate `onceflow metrics` process over the same directory
        port = free_port()
        exporter = subprocess.Popen(
            [sys.executable, "-m", "onceflow.cli", "metrics", "--port", str(port)],
            env=env, cwd=ROOT, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    proc = subprocess.Popen(args, env=env, cwd=ROOT)
    scraped = side in ("scraped", "exporter")
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics", 0.5) if scraped else None
    if scraper is not None:
        scraper.start()
    try:
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            done_sql = "SELECT count(*) FROM workspace_process_requests WHERE status = 'succeeded'"
            deadline = time.monotonic() + 600
            cpu_start, done_start = None, 0
            while (done := conn.execute(done_sql).fetchone()[0]) < n:  # type: ignore[index]
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{side}: the drain did not finish")
                if cpu_start is None and done > 0:  # start-up (imports, connects) excluded
                    cpu_start, done_start = cpu_seconds([proc.pid]), done
                time.sleep(0.02)
            cpu = cpu_seconds([proc.pid]) - (cpu_start or 0.0)
            row = conn.execute(
                "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(finished_at)) "
                "FROM workspace_process_requests"
            ).fetchone()
    finally:
        if scraper is not None:
            scraper.stop_event.set()
            scraper.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        if exporter is not None:
            exporter.terminate()
            exporter.wait(timeout=30)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        queue.engine.dispose()
    seconds = float(row[0])  # type: ignore[index]
    out: dict[str, Any] = {"side": side, "rate": (n - 1) / seconds, "seconds": seconds}
    # The worker's own CPU per request (its threads, and the in-process metrics server).
    out["cpu_us_per_request"] = 1e6 * cpu / max(1, n - done_start)
    if scraper is not None:
        out["scrapes"] = len(scraper.times)
        out["scrape_ms_median"] = 1000 * statistics.median(scraper.times or [0.0])
    return out


def scrape_cost(url: str, backlogs: tuple[int, ...] = (0, 4000, 40000)) -> list[dict[str, Any]]:
    """One scrape's direct cost by live backlog: wall time and this process's CPU.

    The registry a worker serves (this process's metrics and the database's live counts),
    scraped 30 times per backlog of queued rows (no worker running); the wall time is
    mostly the database's index-only count, the CPU the serving process's own share.
    """
    from prometheus_client import generate_latest

    from onceflow.metrics import registry
    from onceflow.models.requests import NewRequest
    from onceflow.queue import Queue

    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("TRUNCATE workspace_process_requests")
    queue = Queue(url)
    reg = registry(url)
    out, have = [], 0
    for backlog in backlogs:
        while have < backlog:
            take = min(5000, backlog - have)
            queue.enqueue_many(
                [NewRequest("ws", f"s{have + i}", "noop", worker_class=WC) for i in range(take)]
            )
            have += take
        generate_latest(reg)
        walls, cpus = [], []
        for _ in range(30):
            start, cpu = time.perf_counter(), time.process_time()
            generate_latest(reg)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        out.append({
            "queued": backlog, "wall_ms": 1000 * statistics.median(walls),
            "cpu_ms": 1000 * statistics.median(cpus),
        })  # fmt: skip
        wall, cpu_ms = out[-1]["wall_ms"], out[-1]["cpu_ms"]
        log(f"scrape at {backlog} queued: {wall:.1f} ms, CPU {cpu_ms:.2f} ms")
    queue.engine.dispose()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, dict[str, Any]]] = []
    with bench_database(admin_url(), prefix="onceflow_bench_metrics", quiet=True) as url:
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
            result = {}
            for side in order:
                result[side] = one_drain(url, side, args.n, args.concurrency)
                log(f"round {r + 1}: {side:<9} {result[side]['rate']:8.0f}/s "
                    f"{result[side].get('scrapes', '')}")  # fmt: skip
            rounds.append(result)
        costs = scrape_cost(url)
    summary: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "n": args.n, "rounds": args.rounds, "concurrency": args.concurrency,
    }  # fmt: skip
    for side in SIDES:
        summary[f"{side}_rate_median"] = statistics.median(r[side]["rate"] for r in rounds)
    for side in SIDES:
        per_request = [r[side]["cpu_us_per_request"] for r in rounds]
        summary[f"{side}_cpu_us_median"] = statistics.median(per_request)
    for side in ("scraped", "exporter", "in-memory"):
        base = [r["metrics"]["rate"] for r in rounds]
        rate = per_round_ratios([r[side]["rate"] for r in rounds], base)
        summary[f"{side}_vs_metrics_ratio_median"] = rate["median"]
        summary[f"{side}_vs_metrics_ratios"] = rate["ratios"]
        cpu = per_round_ratios(
            [r[side]["cpu_us_per_request"] for r in rounds],
            [r["metrics"]["cpu_us_per_request"] for r in rounds],
        )
        summary[f"{side}_vs_metrics_cpu_ratio_median"] = cpu["median"]
    summary["scrapes_per_drain"] = [r["scraped"]["scrapes"] for r in rounds]
    summary["exporter_scrapes_per_drain"] = [r["exporter"]["scrapes"] for r in rounds]
    summary["scrape_ms_median"] = statistics.median(
        r["scraped"]["scrape_ms_median"] for r in rounds
    )
    summary["scrape_cost"] = costs
    summary["load_average"] = os.getloadavg()
    summary["rounds_detail"] = rounds
    return summary


def main(argv: list[str] | None = None) -> int:
    p = command_line(__doc__, "print the summary as JSON", full=True)
    p.add_argument("--n", type=int, default=4000, help="requests per drain")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    summary = run(args)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['date']}  {summary['machine']}  N={args.n} x {args.rounds} rounds, "
          f"-c {args.concurrency}")  # fmt: skip
    print("| side | median drain rate (req/s) | median rate ratio vs `metrics` "
          "| worker CPU per request (µs) | median CPU ratio vs `metrics` |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    rate, cpu = summary["metrics_rate_median"], summary["metrics_cpu_us_median"]
    print(f"| metrics (multiprocess files, not scraped) | {rate:.0f} | 1 | {cpu:.0f} | 1 |")
    for side in ("scraped", "exporter", "in-memory"):
        print(f"| {side} | {summary[f'{side}_rate_median']:.0f} | "
              f"{summary[f'{side}_vs_metrics_ratio_median']:.3f} | "
              f"{summary[f'{side}_cpu_us_median']:.0f} | "
              f"{summary[f'{side}_vs_metrics_cpu_ratio_median']:.3f} |")  # fmt: skip
    print("| live queued rows | one scrape, wall (ms) | serving process CPU (ms) |")
    print("|---:|---:|---:|")
    for c in summary["scrape_cost"]:
        print(f"| {c['queued']} | {c['wall_ms']:.1f} | {c['cpu_ms']:.2f} |")
    print(f"load average at the end: {summary['load_average']}")
    print(f"scrapes per drain: {summary['scrapes_per_drain']}, "
          f"median scrape {summary['scrape_ms_median']:.1f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
