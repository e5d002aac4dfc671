"""onceflow's chaos suite: real servers, real workers and beat, one fault per scenario.

    .venv/bin/python bench/chaos.py [SCENARIO ...] [--quick] [--requests N] [--json PATH]

Starts PRIVATE servers it may break — the embedded PostgreSQL 18 and Valkey 8
(``onceflow.embedded``) on free loopback ports — and the fault proxy
(``bench/faultproxy.py``) in front of PostgreSQL. Per scenario: a fresh migrated database with
audit triggers, an empty Valkey, real ``onceflow worker`` processes for two worker classes
(``fast``: concurrency 2, ``llm``: 4) and ``onceflow beat`` (sweep every 1 s), all connecting to
PostgreSQL through the proxy, a counting stand-in LLM, and four clients enqueueing a paced
mixed workload (``bench.chaos_run.workload``) through the proxy too. The scenario's fault runs
``fault_at`` seconds in; then the run waits — with a deadline — until every expected request
has succeeded, stops everything and checks the invariants (``bench.chaos_checks``).

Scenarios (default: all): baseline, pg_restart, backend_kills, redis_restart, partition,
latency, conn_exhaustion, idle_in_tx, beat_stopped_kill, clock_ahead, two_sweepers,
foreign_sweeper. ``--explicit-handoff``: hand-offs name their worker class (for runs against
older commits, where a bare ``ctx.then`` went to class ``default``).
``--quick``: 300 requests enqueued over 10 s, fault at 3 s (the CI size);
the full run: 3,000 over 40 s, fault at 10 s.

Prints one Markdown row per scenario as it finishes, then the table; exits 1 if any row breaks
an invariant. Every process it started is stopped at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos_checks import check, passes
from bench.chaos_cluster import Cluster
from bench.chaos_run import Sizes, run_scenario
from bench.chaos_scenarios import SCENARIOS

HEADER = (
    "| scenario | enqueued | succeeded | lost | dup bodies (explained) | dup paid calls "
    "(≤ in flight at kills) | zombie writes accepted | ops applied twice | "
    "throughput back (s) | backlog drained (s) | clients back (s) | ok |"
)
RULE = "|" + "---|" * 12


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def row_markdown(r: dict[str, Any]) -> str:
    """One table row."""
    return (
        f"| {r['scenario']} | {r['enqueued']} | {r['succeeded']} | {r['lost']} "
        f"| {r['dup_bodies']} ({r['dup_bodies_explained']}) "
        f"| {r['dup_paid']} (≤ {r['dup_paid_explained']}) | {r['zombie_accepted']} "
        f"| {r['ops_twice']} | {_s(r['throughput_back_s'])} | {_s(r['drained_s'])} "
        f"| {_s(r['clients_back_s'])} | {'yes' if passes(r) else '**NO**'} |"
    )


def run_suite(
    names: list[str], sizes: Sizes, work: Path | None = None, out: Any = sys.stdout
) -> list[dict[str, Any]]:
    """Run ``names`` in order on one private cluster; the rows (dicts) in the same order."""
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with Cluster(work) as cluster:
        # The harness's own warnings (wake-ups not sent while Redis is down, …) go to a file.
        handler = logging.FileHandler(cluster.work / "harness.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        print(f"chaos: servers up in {cluster.work} (PostgreSQL via proxy port "
              f"{cluster.proxy.port})", file=out, flush=True)  # fmt: skip
        for name in names:
            scenario = SCENARIOS[name]
            print(f"== {name}: {scenario.title}", file=out, flush=True)
            t = time.monotonic()
            run = run_scenario(cluster, scenario, sizes, cluster.work / name)
            row = check(run)
            row["seconds"] = round(time.monotonic() - t, 1)
            rows.append(row)
            print(row_markdown(row), file=out, flush=True)
            if not passes(row):
                print(f"   details: {json.dumps(row['details'], default=str)}", file=out,
                      flush=True)  # fmt: skip
            cluster.drop_database(run.db)
    print(f"chaos: {len(rows)} scenarios in {time.monotonic() - started:.0f}s", file=out)
    return rows


def main(argv: list[str] | None = None) -> int:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="default: all")
    parser.add_argument("--quick", action="store_true", help="CI size: 300 requests")
    parser.add_argument("--requests", type=int, default=None, help="requests per scenario")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--work", type=Path, default=None, help="keep logs/ledgers here")
    parser.add_argument(
        "--explicit-handoff",
        action="store_true",
        help="hand off naming the worker class (for older commits, where a bare hand-off "
        "went to class default)",
    )
    args = parser.parse_args(argv)
    names = args.scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    if args.quick:
        sizes = Sizes.quick(args.requests)
    else:
        sizes = Sizes(requests=args.requests) if args.requests else Sizes()

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds through every cleanup

    if args.explicit_handoff:
        os.environ["CHAOS_EXPLICIT_HANDOFF"] = "1"  # inherited by every worker
    signal.signal(signal.SIGTERM, on_term)
    rows = run_suite(names, sizes, args.work)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nchaos table, {when}: python bench/chaos.py {' '.join(argv or sys.argv[1:])}")
    print(HEADER)
    print(RULE)
    for row in rows:
        print(row_markdown(row))
    if args.json is not None:
        args.json.write_text(json.dumps({"when": when, "rows": rows}, indent=2, default=str))
    return 0 if all(passes(r) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
