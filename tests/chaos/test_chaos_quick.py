"""The chaos suite's CI subset: a few scenarios at the quick size, their invariants asserted.

Runs ``bench/chaos.py --quick`` once (a subprocess: it starts its own private PostgreSQL and
Valkey, the fault proxy, real workers and beat, and stops them all), then checks each
scenario's row: nothing lost, no body run to its end twice without a kill to explain it, no
zombie write accepted, no op applied twice, and every provider call paid twice explained by a
call in flight at a kill. Deadlines are generous and nothing here asserts a duration.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Scenarios that hold their invariants once issue 11's fixes are in (docs/reliability.md has
#: the full table): no fault; backend kills every 2 s (stale pools, blips at completion);
#: beat stopped + kill -9 (rescue without beat); a foreign Flow's sweeper + lost wake-ups.
CI_SCENARIOS = ["baseline", "backend_kills", "beat_stopped_kill", "foreign_sweeper"]


@pytest.fixture(scope="module")
def chaos_rows() -> Iterator[dict[str, dict[str, Any]]]:
    """One quick chaos run of every CI scenario; its rows by scenario name.

    Not pytest's tmp_path: the private servers' data directories live here, and another
    pytest session on the machine may prune old basetemp directories while this one runs.
    """
    work = Path(tempfile.mkdtemp(prefix="onceflow-chaos-"))
    try:
        yield _run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(work: Path) -> dict[str, dict[str, Any]]:
    out = work / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick",
         "--json", str(out),
         "--work", str(work / "run"), *CI_SCENARIOS],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if not out.exists():
        pytest.fail(f"the chaos run wrote no rows (exit {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    return {row["scenario"]: row for row in rows}


@pytest.mark.slow
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("scenario", CI_SCENARIOS)
def test_invariants_hold_under_fault(chaos_rows: dict[str, dict[str, Any]], scenario: str) -> None:
    row = chaos_rows[scenario]
    why = json.dumps(row["details"], default=str)
    assert row["enqueued"] > 100, why  # the workload really ran
    assert row["lost"] == 0, why
    assert row["succeeded"] == row["enqueued"], why
    assert row["dup_bodies"] == 0, why
    assert row["zombie_accepted"] == 0, why
    assert row["ops_twice"] == 0, why
    assert row["dup_paid"] <= row["dup_paid_explained"], why
    assert row["cells"] > 0, why  # compute_once cells were asked for and paid
