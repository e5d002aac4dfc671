"""The chaos suite's CI subset: a few scenarios at the quick size, their invariants asserted.

Runs ``bench/chaos.py --quick`` twice at once, each run on half of the scenarios (subprocesses:
each starts its own private PostgreSQL and Valkey, the fault proxy, real workers and beat, and
stops them all; the two share no server or process, so side by side they change no scenario,
only the wall time). Then it checks each scenario's row: nothing lost, no body run to its end
twice without a kill to explain it, no zombie write accepted, no op applied twice, and every
provider call paid twice explained by a call in flight at a kill. Deadlines are generous and
nothing here asserts a duration.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The scenarios CI runs at the quick size (docs/reliability.md has
#: the full table): no fault; backend kills every 2 s (stale pools, blips at completion);
#: beat stopped + kill -9 (rescue without beat); a foreign Flow's sweeper + lost wake-ups.
CI_SCENARIOS = ["baseline", "backend_kills", "beat_stopped_kill", "foreign_sweeper"]


#: The scenarios split over two chaos runs that go side by side (each has its own servers).
HALVES = [CI_SCENARIOS[0::2], CI_SCENARIOS[1::2]]


@pytest.fixture(scope="module")
def chaos_rows() -> Iterator[dict[str, dict[str, Any]]]:
    """Quick chaos runs of every CI scenario (two at once, half of the scenarios each); their
    rows by scenario name.

    Not pytest's tmp_path: the private servers' data directories live here, and another
    pytest session on the machine may prune old basetemp directories while this one runs.
    """
    work = Path(tempfile.mkdtemp(prefix="onceflow-chaos-"))
    try:
        with ThreadPoolExecutor(len(HALVES)) as pool:
            runs = list(pool.map(lambda i: _run(work / f"half{i}", HALVES[i]), range(len(HALVES))))
        yield {name: row for rows in runs for name, row in rows.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(work: Path, scenarios: list[str]) -> dict[str, dict[str, Any]]:
    work.mkdir(parents=True)
    out = work / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick",
         "--json", str(out),
         "--work", str(work / "run"), *scenarios],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if not out.exists():
        pytest.fail(f"the chaos run of {scenarios} wrote no rows (exit {proc.returncode}):\n"
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
