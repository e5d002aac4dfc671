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
    pytest.importorskip("pgserver")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "consumer_bench.py"), "--quick", "--json",
         "--no-docs", "--no-install", "--only", "onceflow",
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
