"""A smoke run of ``bench/tracing_bench.py``: both of its benchmarks, each side in a process
of its own, the ``sdk`` side's spans exported to the bench's receiver. Nothing here asserts
a duration; the script checks that each drain ended with every row succeeded and that
only the ``sdk`` side's lock process has a tracer provider, and exits non-zero otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_tracing_bench_measures_each_side_and_the_sdk_side_exports_spans(
    services: tuple[str, str],
) -> None:
    args = ["--quick", "--requests", "20", "--calls", "30", "--rounds", "1", "--json"]
    env = {
        **os.environ,
        "ONCEFLOW_BENCH_DATABASE_URL": services[0],
        "ONCEFLOW_BENCH_REDIS_URL": services[1],
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tracing_bench.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    assert res["sides"] == ["off", "sdk"] and res["baseline"] is None
    (drain,) = res["drain"]
    assert set(drain["runs"]) == {"off", "sdk"} and set(drain["ratios"]) == {"sdk"}
    assert set(res["lock"]) == {"pair", "computed", "preflight"}
    assert all(set(p["ratios"]) == {"sdk"} for p in res["lock"].values())
    # The sdk side's workers and lock process exported what they traced: the stage runs, the
    # computed cells. A drain of 20 ends well within the batch processor's 5 s schedule, so
    # the workers' spans arrive only if their pool children flush as they shut down. The
    # receiver decoded every body it was sent.
    assert drain["spans_per_request"][0] > 0, drain
    assert res["spans_received"] > 0 and res["bad_bodies"] == 0
