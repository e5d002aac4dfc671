"""Smoke run of bench/claim_layers.py: its six sides (the drain benchmark's hand-written
floor statements, onceflow's statements, on pool checkouts, through ``Queue``, through
``Queue`` holding its connection, through the stage runtime) each claim and complete
their own rows once; the script checks every row ended succeeded and exits non-zero
otherwise. Nothing here asserts a duration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_claim_layers_runs_every_side_on_its_own_rows(services: tuple[str, str]) -> None:
    admin_url, _ = services
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "claim_layers.py"), "--n", "20", "--json"],
        cwd=ROOT,
        env={**os.environ, "ONCEFLOW_BENCH_DATABASE_URL": admin_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sides = json.loads(proc.stdout)["sides"]
    assert set(sides) == {"floor", "statements", "pooled", "queue", "queue_held", "runtime"}
    assert all(v["cpu_us"] > 0 and v["wall_us"] > 0 for v in sides.values()), sides
