"""The pressure cells of ``bench/consumer_bench.py``: what loads a queue without breaking it.

Each cell drains a standing backlog (offered load above capacity throughout: the consumers
never wait for work) in three equal windows — clean, under pressure, after — so the
throughput during and after the pressure sits beside the clean throughput of the same run,
on the same database. The pressures:

* ``no_pressure``: the control — nothing is applied, so its windows show how the
  throughput drifts on its own as the table churns;
* ``idle_in_tx``: one session opens a transaction, takes a transaction id and a snapshot,
  and sits idle for the window: vacuum can remove no dead row version made meanwhile, so
  every claim and completion steps over more of them (the classic queue-table killer);
* ``active_readers``: four sessions run repeatable-read reads of the whole queue table,
  back to back, for the window: long snapshots and scans beside the queue;
* ``high_load``: four busy processes per core for the window, beside the consumers: a
  loaded machine (the consumers' threads, the database and the feeder all get less CPU);
* ``event_burst``: one producer enqueues a burst (twice the clean window's throughput,
  at least 5,000 jobs) as fast as it can, at the window's start, on top of the backlog.

Every row the harness opens connects directly (``application_name`` ``bench-harness``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from bench.harness import loadavg

KINDS = ("no_pressure", "idle_in_tx", "active_readers", "high_load", "event_burst")
#: The queue table of each system (what the readers read).
TABLES = {
    "onceflow": "workspace_process_requests",
    "procrastinate": "procrastinate_jobs",
    "pgqueuer": "pgqueuer",
}
READERS = 4
HOGS_PER_CORE = 4


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


@contextlib.contextmanager
def applied(
    kind: str,
    system: str,
    connect: Callable[[], psycopg.Connection[Any]],
    burst: Callable[[], None],
) -> Iterator[list[str]]:
    """Apply pressure ``kind`` while the block runs; yields notes on what it did."""
    notes: list[str] = []
    if kind == "no_pressure":
        yield notes
        return
    if kind == "idle_in_tx":
        with connect() as conn:
            conn.autocommit = False
            xid = conn.execute("SELECT txid_current()").fetchone()[0]  # type: ignore[index]
            conn.execute(f"SELECT count(*) FROM {TABLES[system]}")  # a snapshot held too
            notes.append(f"transaction {xid} idle with a snapshot")
            try:
                yield notes
            finally:
                conn.rollback()
        return
    if kind == "active_readers":
        stop = threading.Event()
        reads = [0] * READERS

        def read(i: int) -> None:
            with connect() as conn:
                while not stop.is_set():
                    with conn.transaction():
                        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                        conn.execute(
                            f"SELECT count(*), sum(length(t::text)) FROM {TABLES[system]} t"
                        )
                        conn.execute("SELECT pg_sleep(0.2)")  # the snapshot outlives the scan
                    reads[i] += 1

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(READERS)]
        for t in threads:
            t.start()
        try:
            yield notes
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
            notes.append(f"{READERS} readers, {sum(reads)} repeatable-read scans")
        return
    if kind == "high_load":
        ctx = multiprocessing.get_context("spawn")
        stop_hogs = ctx.Event()
        n = HOGS_PER_CORE * (os.cpu_count() or 1)
        hogs = [ctx.Process(target=_spin, args=(stop_hogs,), daemon=True) for _ in range(n)]
        for h in hogs:
            h.start()
        try:
            yield notes
        finally:
            stop_hogs.set()
            for h in hogs:
                h.join(timeout=10)
                if h.is_alive():
                    h.kill()
            notes.append(f"{n} busy processes; load {loadavg().split()[0]} at the end")
        return
    if kind == "event_burst":
        t0 = time.monotonic()
        burst()
        notes.append(f"burst enqueued in {time.monotonic() - t0:.1f} s")
        yield notes
        return
    raise ValueError(f"unknown pressure {kind!r} (one of {', '.join(KINDS)})")


def window_rates(ends: list[float], t0: float, window: float) -> list[float]:
    """Completions per second in the three windows [t0, t0+w), [t0+w, t0+2w), [t0+2w, t0+3w)."""
    counts = [0, 0, 0]
    for end in ends:
        k = int((end - t0) // window)
        if 0 <= k < 3:
            counts[k] += 1
    return [c / window for c in counts]
