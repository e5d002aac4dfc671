"""What each part of onceflow's claim and completion costs the Postgres backend.

    PYTHONPATH=. .venv/bin/python bench/server_cpu.py [--n 3000] [--json]

One process, one database (``onceflow_bench_<random>`` on the server of
``ONCEFLOW_BENCH_DATABASE_URL``, made and dropped as ``bench/queue_bench.py`` does). Each
variant has a connection (a backend) of its own and claims one queued request by its key,
then completes it, as a Celery worker's stage does; the server CPU of each backend is read
from ``/proc/<pid>/stat`` (so the server must run on this machine) around blocks of
``BLOCK`` pairs, the variants taking turns, after a warm-up that prepares the statements.

The variants are a ladder from onceflow's own statements (``sql.CLAIM`` and ``sql.FINISH``,
the completion a Celery stage runs, keyed form) down to the drain benchmark's floor
(``bench.bench_stages.FLOOR_CLAIM`` / ``FLOOR_COMPLETE``), each rung taking one more part
of onceflow's statements away:

0. ``-history``: the completion writes no history row (``workspace_request_attempts``,
   the run's end as the request page shows it);
1. ``-took_over``: the claim's subselect telling a takeover of a lapsed lease (metrics);
2. ``-claim columns``: the claim returns 4 columns instead of the request's 27;
3. ``-completion columns``: the completion returns 1 column instead of 5;
4. ``-lapsed, stage``: the claim takes only a queued row (no takeover of a lapsed lease,
   no stage check);
5. ``-completion fence``: the completion checks neither the lease nor the worker classes
   and records no ``ended_run`` (the token's sha256 a lost answer is recognised by).

Rungs 0 to 5 drop guarantees; they exist only to show what each costs. The floor also writes
fewer columns (no ``claimed_at``, ``lease_seconds``, ``run_deadline``, ``crash_attempts``)
and reads ``now()`` directly. Both sides commit the claim lazily (``synchronous_commit =
off`` for that transaction) and the completion durably, as the drain does. A variant that
stops matching the statement it is cut from fails loudly (``ValueError``), never measures
something else.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_stages as stages
from bench.harness import (
    CLK_TCK,
    admin_url,
    bench_database,
    command_line,
    database_machine,
    header,
    log,
    raw_connect,
    table,
)
from bench.queue_bench import (
    SEED_QUEUED,
    STAGE,
    WC,
)

WARM = 200
#: Pairs a variant runs in a row before the next variant's turn.
BLOCK = 100


def _cut(sql: str, start: str, end: str, what: str) -> tuple[str, str]:
    """``sql`` split around the part from ``start`` up to (not including) ``end`` ("": to
    the end of the statement, its last line break kept)."""
    i = sql.find(start)
    if end == "" and i >= 0:
        return sql[:i], "\n"
    j = sql.find(end, i + len(start)) if i >= 0 else -1
    if i < 0 or j < 0:
        raise ValueError(f"{what}: the statement no longer has {start!r} … {end!r}")
    return sql[:i], sql[j:]


def _without(sql: str, start: str, end: str, what: str, instead: str = "") -> str:
    head, tail = _cut(sql, start, end, what)
    return head + instead + tail


def variants() -> dict[str, tuple[str, str]]:
    """The ladder: name → (claim, completion) SQL for psycopg, onceflow's first, floor last."""
    from onceflow.queue import sql as queue_sql

    claim, with_history = queue_sql.CLAIM.sql, queue_sql.FINISH.sql
    done = _without(with_history, ",\nupd AS (\n", "UPDATE", "history", "\n")
    done = _without(done, ", w.workspace_id AS h_workspace_id", "", "history")
    c1 = _without(claim, ",\n    (SELECT o.status = 'running'", "AS took_over", "took_over")
    c1 = c1.replace("AS took_over", "", 1)
    c2 = _returning(c1, "w.request_id, w.input, w.attempts, w.lease_expires_at")
    d3 = _returning(done, "w.workspace_id")
    c4 = _without(
        c2, "  AND (CAST(%(stage)s", "RETURNING", "lapsed, stage",
        "  AND w.status = 'queued' AND w.run_after <= n.now\n",
    )  # fmt: skip
    d5 = _without(d3, "    ended_run = ", "    claim_token = NULL", "ended_run")
    d5 = _without(d5, "  AND w.lease_expires_at > n.now", "RETURNING", "completion fence")
    return {
        "onceflow": (claim, with_history),
        "-history": (claim, done),
        "-took_over": (c1, done),
        "-claim columns": (c2, done),
        "-completion columns": (c2, d3),
        "-lapsed, stage": (c4, d3),
        "-completion fence": (c4, d5),
        "floor": (stages.FLOOR_CLAIM, stages.FLOOR_COMPLETE),
    }


def _returning(sql: str, columns: str) -> str:
    i = sql.find("RETURNING ")
    if i < 0:
        raise ValueError("the statement no longer ends in RETURNING")
    return f"{sql[:i]}RETURNING {columns}\n"


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError as exc:
        raise SystemExit(
            f"server_cpu: cannot read the backend's /proc/{pid}/stat ({exc}): "
            "the database server must run on this machine"
        ) from exc
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def run(url: str, n: int) -> dict[str, float]:
    ladder = variants()
    raw = raw_connect(url)
    conns = {name: raw_connect(url) for name in ladder}
    try:
        raw.execute(SEED_QUEUED, {"prefix": "q-", "wc": WC, "n": len(ladder) * (n + WARM)})
        raw.execute("VACUUM ANALYZE workspace_process_requests")
        keys = raw.execute(
            "SELECT workspace_id, request_id FROM workspace_process_requests ORDER BY request_id"
        ).fetchall()
        pids = {
            name: conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            for name, conn in conns.items()
        }

        def pair(name: str) -> Callable[[str, str], None]:
            conn, (claim, done) = conns[name], ladder[name]
            floor = name == "floor"

            def op(ws: str, rid: str) -> None:
                token = secrets.token_hex(16)
                if floor:
                    key = {"ws": ws, "rid": rid, "token": token}
                    claimed = conn.execute(claim, {**key, "worker": "bench"}).fetchone()
                    finished = conn.execute(done, key).rowcount == 1
                else:
                    claimed = conn.execute(claim, {
                        "request_id": rid, "workspace_id": ws, "worker_id": "bench",
                        "token": token, "lease_seconds": 30.0, "max_runtime": None,
                        "stage": STAGE, "now": None, "lazy": True, "terms": None,
                    }).fetchone()  # fmt: skip
                    finished = conn.execute(done, {
                        "request_id": rid, "workspace_id": ws, "token": token,
                        "result": "null", "now": None, "worker_classes": None,
                        "ws_exact": None, "ws_prefixes": None, "handed_to": None,
                        "locks": None,
                    }).fetchone() is not None  # fmt: skip
                if claimed is None or not finished:
                    raise RuntimeError(f"{name}: {rid} not claimed and completed")

            return op

        ops = {name: pair(name) for name in ladder}
        rows = {name: keys[i :: len(ladder)] for i, name in enumerate(ladder)}
        for name, op in ops.items():  # psycopg prepares a statement at its 5th run
            for ws, rid in rows[name][:WARM]:
                op(ws, rid)
        used = dict.fromkeys(ladder, 0.0)
        for start in range(WARM, WARM + n, BLOCK):
            for name, op in ops.items():
                before = _cpu(pids[name])
                for ws, rid in rows[name][start : min(start + BLOCK, WARM + n)]:
                    op(ws, rid)
                used[name] += _cpu(pids[name]) - before
        left = raw.execute(
            "SELECT count(*) FROM workspace_process_requests WHERE status <> 'succeeded'"
        ).fetchone()
        if left is None or left[0] != 0:
            raise RuntimeError(f"{left} rows not succeeded after the run")
    finally:
        for conn in conns.values():
            conn.close()
        raw.close()
    return {name: used[name] / n * 1e6 for name in ladder}


def main(argv: list[str] | None = None) -> int:
    p = command_line(__doc__)
    p.add_argument("--n", type=int, default=3000, help="pairs per variant after warm-up")
    args = p.parse_args(argv)
    with bench_database(admin_url()) as url:
        info = database_machine(url)
        res = run(url, args.n)
    if args.json:
        print(json.dumps({"machine": info, "server_cpu_us": res}, indent=2))
        return 0
    print(header(info, f"{args.n:,} claim + completion pairs per variant; /proc ticks of "
                       f"{1000 / CLK_TCK:.0f} ms"))  # fmt: skip
    print()
    rows = [[name, f"{us:,.0f}", f"{us / res['floor']:.2f}"] for name, us in res.items()]
    print("\n".join(table(["variant", "server CPU µs per pair", "x floor"], rows)))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
