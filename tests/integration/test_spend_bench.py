"""A smoke run of ``bench/spend_limits.py``: every algorithm measured, and at the window's
boundary the sliding log onceflow uses grants no more than the limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_spend_limits_bench_measures_every_algorithm() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "spend_limits.py"), "--calls", "500", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    algorithms = {"GCRA", "two windows", "sliding log"}
    assert set(result["speed"]) == algorithms == set(result["boundary_limit_20"])
    assert all(row["calls_per_s"] > 0 for row in result["speed"].values())
    assert result["boundary_limit_20"]["sliding log"] <= 20
