"""Wake-up latency of Queue.wait_for_work and the cost of the NOTIFY on enqueue.

    .venv/bin/python bench/notify_bench.py [--wakeups 200] [--rounds 6] [--n 400] [--json]

Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), used as the admin URL: the
run creates its own database (see bench/queue_bench.py) and drops it at the end.

1. Latency enqueue-commit → waiter wakes: a waiter in another process (spawn)
   loops ``wait_for_work("lat", 10)`` then claims what woke it; this process,
   once the waiter says it is about to wait (and 20 ms more, so it is past its
   check query), enqueues one due row. Latency = the waiter's ``time.time()`` at
   wake-up minus this process's ``time.time()`` when ``enqueue`` returned (the
   commit acknowledged; it can be negative: the NOTIFY reaches the waiter before
   the commit's answer reaches the enqueuer), and from the ``enqueue`` call's start
   (an upper bound: includes the statement). p50/p90/p99/max over ``--wakeups``.
2. Enqueue cost: single-row ``Queue.enqueue`` rate with ``notify`` on and off,
   two Queues in the same run, ``--rounds`` interleaved rounds of ``--n`` rows
   each (the order alternates per round), with a LISTENing connection draining
   the channel (a listener exists, as in production). Ratio off/on of the medians.
3. The same with ``--procs`` processes enqueueing at once (4 worker classes):
   Postgres serialises the commits of notifying transactions (a global lock on
   the notification queue), so this is where NOTIFY could cost most.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (
    admin_url,
    bench_database,
    command_line,
    database_machine,
    log,
    pct,
    raw_connect,
)

WC = "lat"


def _make_queue(url: str, notify: bool) -> Any:
    from onceflow.db import make_engine
    from onceflow.queue.store import Queue
    from onceflow.settings import Settings

    return Queue(make_engine(url, pool_size=2), settings=Settings(database_url=url, notify=notify))


def _waiter(url: str, n: int, conn: Any) -> None:
    queue = _make_queue(url, True)
    queue.wait_for_work(WC, 0.01)  # start the listener before the first round
    for _ in range(n):
        conn.send("ready")
        woke = queue.wait_for_work(WC, 10)
        at = time.time()
        queue.claim_next(WC, "bench", 10)  # consume it, so the next wait really waits
        conn.send((woke, at))
    queue.close()


def bench_latency(url: str, n: int) -> dict[str, Any]:
    queue = _make_queue(url, True)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_waiter, args=(url, n, there))
    proc.start()
    samples: list[float] = []
    from_call: list[float] = []
    spurious = 0
    for i in range(n):
        assert here.recv() == "ready"
        time.sleep(0.02)  # past its check query: the NOTIFY path, not "already due"
        called = time.time()
        queue.enqueue("s", "w", f"lat-{i}", worker_class=WC)
        committed = time.time()
        woke, at = here.recv()
        if not woke:
            spurious += 1
        samples.append((at - committed) * 1000)
        from_call.append((at - called) * 1000)
    proc.join(30)
    ms = {f"p{q}": round(pct(samples, q), 3) for q in (50, 90, 99)}
    calls = {f"p{q}": round(pct(from_call, q), 3) for q in (50, 90, 99)}
    return {
        "wakeups": n,
        **ms,
        "max": round(max(samples), 3),
        "from_enqueue_call": {**calls, "max": round(max(from_call), 3)},
        "timeouts": spurious,
    }


def _drain(url: str, stop: threading.Event) -> None:
    with raw_connect(url) as conn:
        conn.execute("LISTEN onceflow_work")
        while not stop.is_set():
            for _ in conn.notifies(timeout=0.2):
                pass


def bench_enqueue(url: str, rounds: int, n: int) -> dict[str, Any]:
    queues = {True: _make_queue(url, True), False: _make_queue(url, False)}
    stop = threading.Event()
    drain = threading.Thread(target=_drain, args=(url, stop), daemon=True)
    drain.start()
    for notify, q in queues.items():  # warm-up: connections, prepared statements
        for i in range(50):
            q.enqueue("s", "w", f"warm-{notify}-{i}", worker_class="enq")
    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for notify in (True, False) if r % 2 == 0 else (False, True):
            q = queues[notify]
            start = time.perf_counter()
            for i in range(n):
                q.enqueue("s", "w", f"e-{r}-{notify}-{i}", worker_class="enq")
            rates[notify].append(n / (time.perf_counter() - start))
    stop.set()
    drain.join(5)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    return {
        "rounds": rounds,
        "rows_per_round": n,
        "notify_on_rows_s": round(on, 1),
        "notify_off_rows_s": round(off, 1),
        "off_over_on": round(off / on, 3),
        "per_round_on": [round(x) for x in rates[True]],
        "per_round_off": [round(x) for x in rates[False]],
    }


def _enqueuer(url: str, notify: bool, tag: str, n: int, conn: Any) -> None:
    queue = _make_queue(url, notify)
    for i in range(20):
        queue.enqueue("s", "w", f"cw-{tag}-{i}", worker_class="conc")
    conn.send("ready")
    conn.recv()
    start = time.perf_counter()
    for i in range(n):
        queue.enqueue("s", "w", f"c-{tag}-{i}", worker_class=f"conc{i % 4}")
    conn.send(time.perf_counter() - start)


def bench_concurrent(url: str, procs: int, rounds: int, n: int) -> dict[str, Any]:
    """``procs`` processes enqueueing single rows at once: NOTIFY's commit-time lock shows here."""
    ctx = mp.get_context("spawn")
    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for notify in (True, False) if r % 2 == 0 else (False, True):
            pipes, workers = [], []
            for k in range(procs):
                here, there = ctx.Pipe()
                proc = ctx.Process(
                    target=_enqueuer, args=(url, notify, f"{r}-{notify}-{k}", n, there)
                )
                proc.start()
                pipes.append(here)
                workers.append(proc)
            for here in pipes:
                assert here.recv() == "ready"
            for here in pipes:
                here.send("go")
            took = max(here.recv() for here in pipes)
            for proc in workers:
                proc.join(30)
            rates[notify].append(procs * n / took)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    return {
        "procs": procs,
        "rounds": rounds,
        "rows_per_proc": n,
        "notify_on_rows_s": round(on, 1),
        "notify_off_rows_s": round(off, 1),
        "off_over_on": round(off / on, 3),
    }


def main() -> None:
    parser = command_line(__doc__)
    parser.add_argument("--wakeups", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--procs", type=int, default=4)
    args = parser.parse_args()
    with bench_database(admin_url()) as url:
        info = database_machine(url)
        log("latency: enqueue commit -> waiter (another process) wakes")
        latency = bench_latency(url, args.wakeups)
        log("enqueue rate, notify on vs off (interleaved rounds)")
        enqueue = bench_enqueue(url, args.rounds, args.n)
        log(f"enqueue rate, {args.procs} processes at once, notify on vs off")
        concurrent = bench_concurrent(url, args.procs, args.rounds, args.n)
    out = {
        "machine": info,
        "wake_latency_ms": latency,
        "enqueue": enqueue,
        "concurrent_enqueue": concurrent,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"machine: {info['nproc']} cpu, {info['cpu']}, Postgres {info['postgres']}")
    print(
        f"wake-up latency (ms, n={latency['wakeups']}): p50 {latency['p50']}  "
        f"p90 {latency['p90']}  p99 {latency['p99']}  max {latency['max']}  "
        f"(timeouts {latency['timeouts']})"
    )
    calls = latency["from_enqueue_call"]
    print(
        f"  from the enqueue call's start: p50 {calls['p50']}  p90 {calls['p90']}  "
        f"p99 {calls['p99']}  max {calls['max']}"
    )
    print(
        f"single-row enqueue: notify on {enqueue['notify_on_rows_s']} rows/s, "
        f"off {enqueue['notify_off_rows_s']} rows/s, off/on {enqueue['off_over_on']} "
        f"(median of {enqueue['rounds']} rounds x {enqueue['rows_per_round']})"
    )
    c = concurrent
    print(
        f"{c['procs']} processes enqueueing at once: notify on {c['notify_on_rows_s']} rows/s, "
        f"off {c['notify_off_rows_s']} rows/s, off/on {c['off_over_on']}"
    )


if __name__ == "__main__":
    main()
