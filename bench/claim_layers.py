"""Where a claim + completion's client CPU goes, layer by layer.

    PYTHONPATH=. .venv/bin/python bench/claim_layers.py [--n 3000] [--json]

One process, one database (``onceflow_bench_<random>`` on the server of
``ONCEFLOW_BENCH_DATABASE_URL``, made and dropped as ``bench/queue_bench.py`` does).
Each side claims one queued request by its key and completes it, as a Celery worker's
stage does; the sides differ only in how much of onceflow runs around the two round trips:

1. ``floor``: the two hand-written statements of the drain benchmark's floor
   (``bench.bench_stages.FLOOR_CLAIM`` / ``FLOOR_COMPLETE``: the same row writes,
   only the input read back), tuple rows, one held connection;
2. ``statements``: onceflow's own claim and completion statements (``CLAIM``: the
   claimed row returned; ``COMPLETE_CHANGED``: what a run changes), dict rows, the same
   held connection;
3. ``pooled``: the same, each statement on a pool checkout (``onceflow.db.raw_connection``);
4. ``queue``: ``Queue.claim`` + ``Queue.hand_off`` (validation, the steps runner,
   ``Request``/``Claim``, metrics), each statement on a pool checkout;
5. ``queue_held``: the same inside ``onceflow.db.holding_connections()``: the thread keeps
   its connection between statements (what a Celery prefork child does);
6. ``runtime``: ``onceflow.tasks.runtime.run_request`` with a no-op stage, holding its
   connection — what a Celery worker child's task body runs: the above plus the heartbeat
   registration, the stage context, the input model, the in-progress gauge and the outcome
   (Celery's own tracing is not in it).

The sides are interleaved in blocks of ``BLOCK`` ops (each on rows of its own; a block is
the span a side holds its connection for) and the CPU time of this process
(``time.process_time``) and the wall time are summed per side after a warm-up. CPU is the
client's only: the server's share shows in the wall time.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_stages as stages
from bench.harness import (
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
    make_queue,
)

WARM = 50
#: Ops a side runs in a row before the next side's turn.
BLOCK = 10


def run(url: str, n: int) -> dict[str, Any]:
    from psycopg.rows import dict_row
    from pydantic import BaseModel

    from onceflow.db import fetch_one, holding_connections, raw_connection
    from onceflow.queue import sql as queue_sql
    from onceflow.tasks.flow import StageSpec
    from onceflow.tasks.runtime import run_request

    class Doc(BaseModel):
        doc: int = 0

    spec = StageSpec(
        name=STAGE, func=lambda ctx, data: None, input_model=Doc, worker_class=WC,
        dedupe=True, lease_seconds=30.0, max_attempts=None, max_crash_attempts=None,
        priority=0, retry_on=None,
    )  # fmt: skip

    queue, raw = make_queue(url), raw_connect(url)
    try:
        raw.execute(SEED_QUEUED, {"prefix": "q-", "wc": WC, "n": 8 * (n + WARM)})
        raw.execute("VACUUM ANALYZE workspace_process_requests")
        keys = raw.execute(
            "SELECT workspace_id, request_id FROM workspace_process_requests ORDER BY request_id"
        ).fetchall()

        def claim_params(ws: str, rid: str, token: str) -> dict[str, Any]:
            return {
                "request_id": rid, "workspace_id": ws, "worker_id": "bench", "token": token,
                "lease_seconds": 30.0, "max_runtime": None, "stage": STAGE, "now": None,
                "lazy": True, "terms": None,
            }  # fmt: skip

        def done_params(ws: str, rid: str, token: str) -> dict[str, Any]:
            return {
                "request_id": rid, "workspace_id": ws, "token": token, "result": "null",
                "now": None, "worker_classes": None, "ws_exact": None, "ws_prefixes": None,
                "handed_to": None, "locks": None,
            }  # fmt: skip

        def floor(ws: str, rid: str) -> None:
            key = {"ws": ws, "rid": rid, "token": secrets.token_hex(16)}
            if raw.execute(stages.FLOOR_CLAIM, {**key, "worker": "bench"}).fetchone() is None:
                raise RuntimeError(f"floor: {rid} not claimed")
            if raw.execute(stages.FLOOR_COMPLETE, key).rowcount != 1:
                raise RuntimeError(f"floor: {rid} not completed")

        def statements(ws: str, rid: str) -> None:
            token = secrets.token_hex(16)
            with raw.cursor(row_factory=dict_row) as cur:
                if (
                    cur.execute(queue_sql.CLAIM.sql, claim_params(ws, rid, token)).fetchone()
                    is None
                ):
                    raise RuntimeError(f"statements: {rid} not claimed")
            with raw.cursor(row_factory=dict_row) as cur:
                if (
                    cur.execute(
                        queue_sql.COMPLETE_CHANGED.sql, done_params(ws, rid, token)
                    ).fetchone()
                    is None
                ):
                    raise RuntimeError(f"statements: {rid} not completed")

        def pooled(ws: str, rid: str) -> None:
            token = secrets.token_hex(16)
            with raw_connection(queue.engine) as conn:
                if fetch_one(conn, queue_sql.CLAIM.sql, claim_params(ws, rid, token)) is None:
                    raise RuntimeError(f"pooled: {rid} not claimed")
            with raw_connection(queue.engine) as conn:
                if (
                    fetch_one(conn, queue_sql.COMPLETE_CHANGED.sql, done_params(ws, rid, token))
                    is None
                ):
                    raise RuntimeError(f"pooled: {rid} not completed")

        def through_queue(ws: str, rid: str) -> None:
            claim = queue.claim(rid, "bench", lease_seconds=30.0, stage=STAGE, workspace_id=ws)
            if claim is None:
                raise RuntimeError(f"queue: {rid} not claimed")
            queue.hand_off(claim, None)

        def runtime(ws: str, rid: str) -> None:
            out = run_request(queue, spec, rid, "bench", lambda exc: True, workspace_id=ws)
            if out.get("outcome") != "succeeded":
                raise RuntimeError(f"runtime: {rid}: {out}")

        sides: dict[str, Callable[[str, str], None]] = {
            "floor": floor,
            "statements": statements,
            "pooled": pooled,
            "queue": through_queue,
            "queue_held": through_queue,
            "runtime": runtime,
        }
        held = {"queue_held", "runtime"}
        rows = {side: keys[i :: len(sides)] for i, side in enumerate(sides)}
        cpu = dict.fromkeys(sides, 0.0)
        wall = dict.fromkeys(sides, 0.0)
        for start in range(0, n + WARM, BLOCK):
            for side, op in sides.items():
                with holding_connections() if side in held else nullcontext():
                    for i in range(start, min(start + BLOCK, n + WARM)):
                        ws, rid = rows[side][i]
                        c0, w0 = time.process_time(), time.perf_counter()
                        op(ws, rid)
                        c1, w1 = time.process_time(), time.perf_counter()
                        if i >= WARM:
                            cpu[side] += c1 - c0
                            wall[side] += w1 - w0
        left = raw.execute(
            "SELECT count(*) FROM workspace_process_requests WHERE status = 'succeeded'"
        ).fetchone()
        if left is None or left[0] != len(sides) * (n + WARM):
            raise RuntimeError(f"{left} succeeded rows for {len(sides) * (n + WARM)} ops")
    finally:
        raw.close()
        queue.engine.dispose()
    return {
        side: {"cpu_us": cpu[side] / n * 1e6, "wall_us": wall[side] / n * 1e6} for side in sides
    }


def main(argv: list[str] | None = None) -> int:
    p = command_line(__doc__)
    p.add_argument("--n", type=int, default=3000, help="ops per side after the warm-up")
    args = p.parse_args(argv)
    with bench_database(admin_url()) as url:
        info = database_machine(url)
        res = run(url, args.n)
    if args.json:
        print(json.dumps({"machine": info, "sides": res}, indent=2))
        return 0
    base = res["floor"]
    print(header(info, f"psycopg {info['psycopg']}", f"{args.n:,} claim + completion per side"))
    print()
    rows = [
        [
            side,
            f"{v['cpu_us']:,.0f}",
            f"{v['cpu_us'] / base['cpu_us']:.2f}",
            f"{v['wall_us']:,.0f}",
            f"{v['wall_us'] / base['wall_us']:.2f}",
        ]
        for side, v in res.items()
    ]
    cols = ["side", "client CPU µs per op", "x floor", "wall µs per op", "x floor"]
    print("\n".join(table(cols, rows)))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
