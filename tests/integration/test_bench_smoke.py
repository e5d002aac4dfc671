"""Smoke runs of the per-layer benchmarks; each script checks that every row it claimed ended
succeeded and exits non-zero otherwise. Nothing here asserts a duration.

* ``bench/claim_layers.py``: its six sides (the drain benchmark's hand-written floor
  statements, onceflow's statements, on pool checkouts, through ``Queue``, through ``Queue``
  holding its connection, through the stage runtime) each claim and complete their own rows;
* ``bench/server_cpu.py``: each rung of its ladder (onceflow's claim and completion, parts of
  them taken away one at a time, the floor's) does the same on a backend of its own. A rung
  cut from onceflow's SQL that no longer finds the part it removes raises instead of
  measuring something else;
* ``bench/stage_parts.py``: a drain of onceflow's stage and of the floor in real Celery
  workers, each pool child reporting its CPU per part of a stage; the onceflow worker's
  children start with their parent's objects frozen, the floor's (bare Celery) do not;
* ``bench/queue_bench.py --only in_flight``: claims beside requests in flight, which stay
  running;
* ``bench/queue_bench.py --only front``: claims as the claim index's front of claimed
  rows' entries grows, and after a vacuum of it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.server_cpu import variants

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, admin_url: str, *args: str, **env: str) -> Any:
    """``bench/<script> --json …`` against a database of ``admin_url``'s server: its JSON."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--json"],
        cwd=ROOT,
        env={**os.environ, "ONCEFLOW_BENCH_DATABASE_URL": admin_url, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_claim_layers_runs_every_side_on_its_own_rows(services: tuple[str, str]) -> None:
    sides = run_bench("claim_layers.py", services[0], "--n", "20")["sides"]
    assert set(sides) == {"floor", "statements", "pooled", "queue", "queue_held", "runtime"}
    assert all(v["cpu_us"] > 0 and v["wall_us"] > 0 for v in sides.values()), sides


def test_each_rung_takes_one_more_part_of_the_statements_away() -> None:
    from onceflow.queue import sql

    ladder = variants()
    names = list(ladder)
    assert names[0] == "onceflow" and names[-1] == "floor"
    assert ladder["onceflow"] == (sql.CLAIM.sql, sql.FINISH.sql)  # what a Celery stage runs
    rungs = [ladder[n] for n in names[:-1]]
    for before, after in itertools.pairwise(rungs):
        assert after != before
        # each rung only removes: its statements are no longer than the rung above's
        assert len(after[0]) <= len(before[0]) and len(after[1]) <= len(before[1])
    assert "took_over" not in ladder["-took_over"][0]
    assert "ended_run" not in ladder["-completion fence"][1]


def test_server_cpu_runs_every_rung_on_its_own_rows(services: tuple[str, str]) -> None:
    res = run_bench("server_cpu.py", services[0], "--n", "20")["server_cpu_us"]
    assert list(res) == list(variants())
    assert all(v >= 0 for v in res.values()), res


def test_stage_parts_splits_each_sides_child_cpu(services: tuple[str, str]) -> None:
    redis_url = services[1].rsplit("/", 1)[0] + "/14"  # the drains' queues and counters
    res = run_bench(
        "stage_parts.py", services[0], "--n", "200", "--rounds", "1",
        ONCEFLOW_BENCH_REDIS_URL=redis_url,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )  # fmt: skip
    once, floor = res["onceflow"], res["floor"]
    for part in ("stage", "run_request", "claim", "complete", "statements", "request"):
        assert once[part] > 0, (part, once)
    assert once["stage"] > once["run_request"] > once["claim"]  # parts nest
    assert floor["stage"] > floor["statements"] > 0 and "claim" not in floor
    assert once["gc_frozen"] > 10_000 and floor["gc_frozen"] == 0


def test_queue_bench_claims_beside_requests_in_flight(services: tuple[str, str]) -> None:
    """``bench/queue_bench.py``'s in-flight section: every level measured on both sides, and
    its requests in flight left running (the script raises if a claim took one)."""
    res = run_bench("queue_bench.py", services[0], "--quick", "--only", "in_flight")["in_flight"]
    assert list(res["levels"]) == ["0", "3000"]
    for level in res["levels"].values():
        assert level["onceflow"]["median_ms"] > 0 and level["floor"]["median_ms"] > 0, level
    assert set(res["growth"]) == {"onceflow", "floor"}


def test_queue_bench_claims_as_the_claim_index_front_grows(services: tuple[str, str]) -> None:
    """``bench/queue_bench.py``'s front section: a window right after the index vacuum, one
    more after ``VACUUM (INDEX_CLEANUP ON)``, both sides measured in each, and every row the
    onceflow side claimed succeeded (the script raises otherwise)."""
    res = run_bench(
        "queue_bench.py", services[0], "--quick", "--only", "front", "--front", "1,200,1000"
    )["front"]
    assert [(w["since"], w["after_vacuum"]) for w in res["windows"]] == [(0, False), (0, True)]
    for w in res["windows"]:
        assert w["pages"] >= 1, w
        assert w["onceflow"]["median_ms"] > 0 and w["floor"]["median_ms"] > 0, w
