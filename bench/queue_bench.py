"""Layer-1 queue benchmark: each onceflow figure beside its floor, measured in one run.

    .venv/bin/python bench/queue_bench.py [--quick] [--json]

Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), used only as the admin
URL: the run creates its own database ``onceflow_bench_<random>``, migrates it
with ``onceflow.migrate.migrate`` and drops it at the end (``WITH (FORCE)``),
also on error or Ctrl-C.

What is measured, each onceflow figure beside a floor on the same table:

1. Enqueue rows/s. Single: ``Queue.enqueue`` one row at a time, beside the same
   number of raw-psycopg ``SELECT 1`` round trips (and, for reference, a raw
   single-row ``INSERT … ON CONFLICT DO NOTHING`` in autocommit). Batched:
   ``Queue.enqueue_many`` in batches of 1,000, beside a hand-written raw-psycopg
   ``INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING`` of the same rows in
   the same batches (unnest, not COPY: COPY cannot say ON CONFLICT). The floor's
   ids, hashes and JSON text are computed before its timer starts; onceflow's
   validation, id derivation and hashing are inside its timer, by design.
2. Claim + complete per second with 1, 2, 4 and 8 connections, one *process*
   per connection (multiprocessing spawn): the client side is Python, and with
   threads the GIL would serialise onceflow's Python work and understate it.
   onceflow: ``claim_next(limit=1)`` then ``complete``, each its own transaction; and
   the same with ``finish`` (the completion reading nothing back, as the floor's);
   and those two statements alone, through ``onceflow.db`` without the ``Queue`` API
   (what the SQL costs; the rest of the gap is the Python API's). Floor: a
   hand-written two-statement raw-psycopg loop in autocommit
   (``UPDATE … WHERE request_id = (SELECT … FOR UPDATE SKIP LOCKED) RETURNING``,
   then the fenced ``UPDATE … SET status='succeeded'``), and two ``SELECT 1``
   round trips per op. Each run starts from a truncated, freshly seeded,
   vacuumed table.
3. Claim latency (``claim_next`` alone, and claim + complete) over 2,000 queued
   rows with 10k, 100k and 1M finished rows in the table (``--quick``: 10k and
   100k), each after ANALYZE and VACUUM; each onceflow claim is followed by a
   hand-written one on the same table, as a control for the machine.
4. Claim + complete (``claim_next`` + ``finish``) while 0, 300 and 3,000 other requests
   of the class are in flight (running under live leases; ``--quick``: 0 and 3,000),
   each beside the hand-written claim + complete: a claim must not cost more with more
   work in progress (a lapsed-lease scan that read every running row once did).
5. Claim + complete (``claim_next`` + ``finish``, each followed by the hand-written pair)
   as the claims since the claim index was last vacuumed grow, over a history of finished
   rows (``--quick``: 3 windows of 5,000 over 200k rows; else 5 of 10,000 over 1M), then
   after ``VACUUM (INDEX_CLEANUP ON)``: the index pages one claim reads, and the per-op
   medians beside the first window's. Claimed rows leave their index entries at the
   front of ix_wpr_claim until a vacuum cleans the index; every claim steps over them.

onceflow and its floor are interleaved (call by call for enqueue and latency,
run by run for throughput), so a burst of outside load on a shared machine hits
both sides alike; the load average is reported.

Progress goes to stderr; the Markdown report (or ``--json``: the raw numbers)
to stdout. Timings use ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, so one
clock across the worker processes); every timed loop is warmed up first.
"""

from __future__ import annotations

import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench.harness import (
    ProcessPool,
    admin_url,
    bench_database,
    command_header,
    command_line,
    cpu_seconds,
    database_machine,
    finish,
    loadavg,
    log,
    ok,
    pct,
    per_round_ratios,
    raw_connect,
    run_until,
    table,
)

TABLE = "workspace_process_requests"
WC = "bench"  # the worker class of every benchmark row
STAGE = "evaluate"
RESULT = {"ok": True, "score": 0.5}
RESULT_TEXT = '{"ok":true,"score":0.5}'
CONCURRENCY = (1, 2, 4, 8)
#: Single enqueues per block; pooled and held blocks take turns.
BLOCK = 50
#: Claim + complete vs the floor: the ratio each level is judged against (on the median of
#: the per-round ratios), 0.8 of the hand-written statements' rate.
TARGET_RATIO = 0.8

INSERT_COLS = (
    "request_id, workspace_id, job_id, branch_path, stage, dedupe, input, input_hash, "
    "worker_class, priority, max_attempts, max_crash_attempts, "
    "run_after, dispatched_at, created_at, updated_at"
)

FLOOR_INSERT_ONE = f"""
INSERT INTO {TABLE} ({INSERT_COLS})
VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s, now(), now(), now(), now())
ON CONFLICT (workspace_id, request_id) DO NOTHING
"""

FLOOR_INSERT_MANY = f"""
INSERT INTO {TABLE} ({INSERT_COLS})
SELECT r, w, j, b, s, d, i, h, c, p, ma, mc, now(), now(), now(), now()
FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::boolean[],
            %s::jsonb[], %s::text[], %s::text[], %s::integer[], %s::integer[], %s::integer[])
     AS t(r, w, j, b, s, d, i, h, c, p, ma, mc)
ON CONFLICT (workspace_id, request_id) DO NOTHING
"""

# The hand-written claim: same row writes as onceflow's CLAIM_NEXT (status, token, worker,
# attempts, lease, heartbeat, updated_at), same partial index, but only the id comes back.
FLOOR_CLAIM = f"""
UPDATE {TABLE} SET status = 'running', claim_token = %s, claimed_by = %s,
    attempts = attempts + 1, lease_expires_at = now() + interval '30 seconds',
    heartbeat_at = now(), updated_at = now()
WHERE request_id = (
    SELECT request_id FROM {TABLE}
    WHERE status = 'queued' AND worker_class = %s AND run_after <= now()
    ORDER BY priority DESC, run_after
    LIMIT 1
    FOR UPDATE SKIP LOCKED)
RETURNING request_id
"""

FLOOR_COMPLETE = f"""
UPDATE {TABLE} SET status = 'succeeded', result = %s::jsonb, claim_token = NULL,
    lease_expires_at = NULL, finished_at = now(), updated_at = now()
WHERE request_id = %s AND claim_token = %s
"""

# The floor of a batched worker loop (``--batch B``): B rows claimed by one statement, each
# with a token of its own (the batch's random prefix + the id), and completed by one.
FLOOR_CLAIM_MANY = f"""
UPDATE {TABLE} SET status = 'running', claim_token = %(prefix)s || request_id,
    claimed_by = %(worker)s, attempts = attempts + 1,
    lease_expires_at = now() + interval '30 seconds', heartbeat_at = now(), updated_at = now()
WHERE request_id IN (
    SELECT request_id FROM {TABLE}
    WHERE status = 'queued' AND worker_class = %(wc)s AND run_after <= now()
    ORDER BY priority DESC, run_after
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)
RETURNING request_id, claim_token
"""

FLOOR_COMPLETE_MANY = f"""
UPDATE {TABLE} w SET status = 'succeeded', result = %(result)s::jsonb, claim_token = NULL,
    lease_expires_at = NULL, finished_at = now(), updated_at = now()
FROM unnest(%(ids)s::text[], %(tokens)s::text[]) AS k(request_id, token)
WHERE w.request_id = k.request_id AND w.claim_token = k.token
"""

SEED_QUEUED = f"""
INSERT INTO {TABLE} (request_id, workspace_id, job_id, branch_path, stage, dedupe, input,
                     input_hash, worker_class, max_attempts, max_crash_attempts, dispatched_at)
SELECT %(prefix)s || i, 'w' || (i %% 50), %(prefix)s || i, '', '{STAGE}', true,
       '{{"doc": 1}}', 'h', %(wc)s, 5, 3, now()
FROM generate_series(1, %(n)s::int) AS i
"""

# Requests in flight: running under live leases (an hour), as a worker's claims in progress.
SEED_RUNNING = f"""
INSERT INTO {TABLE} (request_id, workspace_id, job_id, branch_path, stage, dedupe, input,
                     input_hash, worker_class, status, claim_token, claimed_by, attempts,
                     max_attempts, max_crash_attempts, lease_expires_at, heartbeat_at,
                     claimed_at, dispatched_at)
SELECT 'run-' || i, 'w' || (i %% 50), 'run-' || i, '', '{STAGE}', true, '{{"doc": 1}}', 'h',
       %(wc)s, 'running', 'tok-' || i, 'holder', 1, 5, 3, now() + interval '1 hour', now(),
       now(), now()
FROM generate_series(1, %(n)s::int) AS i
"""

# Finished rows, as tests/integration/test_migrations.py builds them.
SEED_FINISHED = f"""
INSERT INTO {TABLE} (request_id, workspace_id, job_id, branch_path, stage, dedupe, input,
                     input_hash, worker_class, status, max_attempts, max_crash_attempts,
                     finished_at, result)
SELECT 'done-' || i, 'w' || (i %% 50), 'j' || i, '', '{STAGE}', true, '{{}}', 'h',
       CASE WHEN i %% 3 = 0 THEN %(wc)s ELSE 'other' END, 'succeeded', 5, 3, now(), '{{}}'
FROM generate_series(%(lo)s::int, %(hi)s::int) AS i
"""


# ---------------------------------------------------------------------------- the database


def reset_table(url: str, *, queued: int = 0, prefix: str = "q-") -> None:
    """Empty the table, seed ``queued`` due rows of the bench class, VACUUM ANALYZE."""
    with raw_connect(url) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
        if queued:
            conn.execute(SEED_QUEUED, {"prefix": prefix, "wc": WC, "n": queued})
        conn.execute(f"VACUUM ANALYZE {TABLE}")


def make_queue(url: str) -> Any:
    """A Queue as a worker process would build one: the shipped engine defaults, pool of 1."""
    from onceflow.db import make_engine
    from onceflow.queue.store import Queue
    from onceflow.settings import Settings

    return Queue(make_engine(url, pool_size=1), settings=Settings(database_url=url))


# ---------------------------------------------------------------------------- 1. enqueue


def _items(tag: str, n: int) -> list[Any]:
    from onceflow.models.requests import NewRequest

    return [
        NewRequest(
            workspace_id=f"w{i % 50}",
            job_id=f"job-{tag}-{i}",
            stage=STAGE,
            input={"doc": i, "lang": "en", "text": "some text to evaluate"},
            worker_class=WC,
        )
        for i in range(n)
    ]


def _floor_row(item: Any) -> tuple[Any, ...]:
    """The row onceflow would write for ``item``, built ahead of the floor's timer."""
    from onceflow.ids import request_id_for
    from onceflow.payloads import encode_payload

    text, digest = encode_payload(item.input, 256 * 1024)
    rid = request_id_for(item.workspace_id, item.job_id, item.branch_path, item.stage)
    return (
        rid,
        item.workspace_id,
        item.job_id,
        item.branch_path,
        item.stage,
        True,
        text,
        digest,
        item.worker_class,
        0,
        5,
        3,
    )


def _floor_columns(items: list[Any]) -> list[list[Any]]:
    return [list(col) for col in zip(*(_floor_row(it) for it in items), strict=True)]


def bench_enqueue(url: str, single_n: int, batches: int, batch: int) -> dict[str, Any]:
    """Interleaved: each onceflow call is followed by its floor call, so both see the same
    machine load and the same table size; distinct rows (ids) for each side.

    Each phase gets fresh connections (as a new worker process would): psycopg prepares a
    statement on its 6th execution, and a plan cached while the table was empty would
    otherwise carry over from the single-row phase into the batched one.
    """
    queue = make_queue(url)
    raw = raw_connect(url)
    warm = 50
    out: dict[str, Any] = {
        "single_rows": single_n,
        "batched_rows": batches * batch,
        "batch_size": batch,
    }
    try:
        # --- single: onceflow enqueue | SELECT 1 round trip | raw one-row INSERT, in blocks
        # of BLOCK calls that take turns: a pooled block (a checkout and check-in per call,
        # as a web thread enqueues) and a held one (holding_connections: a Celery child's
        # hand-off, a worker loop). The raw INSERT's connection is held by the bench.
        from onceflow.db import holding_connections

        reset_table(url)
        items = _items("once-single", single_n + warm)
        rows = [_floor_row(it) for it in _items("floor-single", single_n + warm)]
        spent = {
            mode: {"onceflow": 0.0, "select1": 0.0, "raw_insert": 0.0, "n": 0}
            for mode in ("pooled", "held")
        }
        block_ratios: dict[str, list[float]] = {"pooled": [], "held": []}
        for start in range(0, len(items), BLOCK):
            mode = "held" if (start // BLOCK) % 2 else "pooled"
            block = {"onceflow": 0.0, "raw_insert": 0.0}
            with holding_connections() if mode == "held" else nullcontext():
                for i in range(start, min(start + BLOCK, len(items))):
                    it, row = items[i], rows[i]
                    t0 = time.perf_counter()
                    queue.enqueue(
                        it.stage, it.workspace_id, it.job_id, input=it.input, worker_class=WC
                    )
                    t1 = time.perf_counter()
                    raw.execute("SELECT 1").fetchone()
                    t2 = time.perf_counter()
                    raw.execute(FLOOR_INSERT_ONE, row)
                    t3 = time.perf_counter()
                    if i >= warm:
                        side = spent[mode]
                        side["onceflow"] += t1 - t0
                        side["select1"] += t2 - t1
                        side["raw_insert"] += t3 - t2
                        side["n"] += 1
                        block["onceflow"] += t1 - t0
                        block["raw_insert"] += t3 - t2
            if block["onceflow"]:
                block_ratios[mode].append(block["raw_insert"] / block["onceflow"])
        for mode, key in (("pooled", "single"), ("held", "single_held")):
            side = spent[mode]
            out[key] = {k: side["n"] / side[k] for k in ("onceflow", "select1", "raw_insert")}
            out[key]["rows"] = side["n"]
            out[key]["block_ratio_median"] = statistics.median(block_ratios[mode])
            log(
                f"enqueue single ({mode}): "
                + ", ".join(f"{k} {v:,.0f}/s" for k, v in out[key].items() if k != "rows")
            )

        # --- batched: enqueue_many | hand-written unnest INSERT of the same shape of rows
        raw.close()
        queue.engine.dispose()
        queue, raw = make_queue(url), raw_connect(url)
        reset_table(url)
        once_items = _items("once-batch", (batches + 1) * batch)
        floor_items = _items("floor-batch", (batches + 1) * batch)
        once_chunks = [once_items[i : i + batch] for i in range(0, len(once_items), batch)]
        floor_params = [
            _floor_columns(floor_items[i : i + batch]) for i in range(0, len(floor_items), batch)
        ]
        spent = {"onceflow": 0.0, "raw_unnest": 0.0}
        for i, (chunk, params) in enumerate(zip(once_chunks, floor_params, strict=True)):
            t0 = time.perf_counter()
            queue.enqueue_many(chunk)
            t1 = time.perf_counter()
            raw.execute(FLOOR_INSERT_MANY, params)
            t2 = time.perf_counter()
            if i >= 1:  # the first batch of each side is the warm-up
                spent["onceflow"] += t1 - t0
                spent["raw_unnest"] += t2 - t1
        out["batched"] = {k: batches * batch / v for k, v in spent.items()}
        log("enqueue batched: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in out["batched"].items()))
    finally:
        raw.close()
        queue.engine.dispose()
    return out


# ---------------------------------------------------------------------------- 2. claim + complete


def _worker(url: str, batch: int, pipe: Pipe) -> None:
    """One benchmark connection in its own process; obeys (command, …) messages on ``pipe``.

    The onceflow side holds its connection, as a worker loop should (and as onceflow's
    Celery children do): ``onceflow.db.holding_connections``.
    """
    queue = make_queue(url)
    raw = raw_connect(url)
    worker_id = f"bench-{os.getpid()}"

    def onceflow_op() -> bool:
        claims = queue.claim_next(WC, worker_id, 1)
        if not claims:
            return False
        queue.complete(claims[0], RESULT)
        return True

    def onceflow_finish_op() -> bool:  # the completion reading nothing back, as the floor's
        claims = queue.claim_next(WC, worker_id, 1)
        if not claims:
            return False
        queue.finish(claims[0], RESULT)
        return True

    from onceflow.db import all_as_dicts, one_as_dict, run_statement
    from onceflow.ids import new_claim_token
    from onceflow.queue import sql as queue_sql
    from onceflow.queue.sql import claim_next_sql

    claim_sql = claim_next_sql(1)

    def statements_op() -> bool:
        """onceflow's own two statements (``claim_next``'s and ``finish``'s, as the queue
        sends them: lazy claim, fenced completion) through ``onceflow.db`` on the held
        connection, with none of the ``Queue`` API around them (no validation, steps,
        ``Request``/``Claim``, metrics): what the SQL costs beside the floor's."""
        token = new_claim_token()
        claim = {
            "worker_class": WC, "worker_id": worker_id, "tokens": token, "lease_seconds": 30.0,
            "max_runtime": None, "now": None, "lazy": True, "terms": None,
        }  # fmt: skip
        rows = run_statement(queue.engine, claim_sql, claim, all_as_dicts)
        if not rows:
            return False
        key = {"workspace_id": rows[0]["workspace_id"], "request_id": rows[0]["request_id"]}
        unscoped = {"worker_classes": None, "ws_exact": None, "ws_prefixes": None}
        done = {
            **key,
            "token": token,
            "result": RESULT_TEXT,
            "now": None,
            **unscoped,
            "handed_to": None,
            "locks": None,
        }
        if run_statement(queue.engine, queue_sql.FINISH.sql, done, one_as_dict) is None:
            raise RuntimeError(f"statements: {key} not completed")
        return True

    def floor_op() -> bool:
        token = secrets.token_hex(16)
        row = raw.execute(FLOOR_CLAIM, (token, worker_id, WC)).fetchone()
        if row is None:
            return False
        raw.execute(FLOOR_COMPLETE, (RESULT_TEXT, row[0], token))
        return True

    def select1_op() -> bool:  # the hand-written floor's two round trips, doing nothing
        raw.execute("SELECT 1").fetchone()
        raw.execute("SELECT 1").fetchone()
        return True

    def onceflow_batched_op() -> int:  # what onceflow's Worker does: claims and completions
        claims = queue.claim_next(WC, worker_id, batch)  # in batches
        if claims:
            queue.complete_many([(c, RESULT) for c in claims])
        return len(claims)

    def floor_batched_op() -> int:
        prefix = secrets.token_hex(8)
        rows = raw.execute(
            FLOOR_CLAIM_MANY, {"prefix": prefix, "worker": worker_id, "wc": WC, "limit": batch}
        ).fetchall()
        if rows:
            ids, tokens = [r[0] for r in rows], [r[1] for r in rows]
            done = raw.execute(
                FLOOR_COMPLETE_MANY, {"result": RESULT_TEXT, "ids": ids, "tokens": tokens}
            ).rowcount
            if done != len(rows):
                raise RuntimeError(f"floor_batched: {done} of {len(rows)} completed")
        return len(rows)

    ops: dict[str, Callable[[], int]] = {
        "onceflow": onceflow_op,
        "onceflow_finish": onceflow_finish_op,
        "statements": statements_op,
        "floor": floor_op,
        "select1": select1_op,
        "onceflow_batched": onceflow_batched_op,
        "floor_batched": floor_batched_op,
    }
    pipe.send("ready")
    try:
        _commands(pipe, ops)
    finally:
        raw.close()
        queue.engine.dispose()


def _commands(pipe: Pipe, ops: dict[str, Callable[[], int]]) -> None:
    """Run the parent's commands until it sends None (the onceflow side holds its connection)."""
    from onceflow.db import holding_connections

    with holding_connections():
        while True:
            msg = pipe.recv()
            if msg is None:
                return
            if msg[0] == "warm":
                _, kind, n = msg
                pipe.send(("warm", sum(ops[kind]() for _ in range(n))))
            elif msg[0] == "go":
                # an op returns the rows it claimed and completed: True (1) or a batch's count
                _, kind, start_at, duration = msg
                pipe.send(run_until(ops[kind], start_at, duration))


class Workers(ProcessPool):
    """A standing pool of spawned worker processes, one database connection pair each."""

    def __init__(self, url: str, n: int, batch: int = 1):
        super().__init__(_worker, lambda _: (url, batch), n)

    def run(self, kind: str, n: int, duration: float, warmup: int) -> dict[str, Any]:
        warmed, results = self.together(
            n, ("warm", kind, warmup), lambda start_at: ("go", kind, start_at, duration)
        )
        ops = sum(r[0] for r in results)
        elapsed = max(r[1] for r in results)
        return {
            "ops": ops,
            "seconds": elapsed,
            "ops_per_s": ops / elapsed,
            "exhausted": any(r[2] for r in results),
            "warm_ops": sum(w[1] for w in warmed),
        }


def _backends(url: str) -> list[int]:
    """The pids of the client backends on the bench database (the workers' connections)."""
    with raw_connect(url) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchall()
    return [r[0] for r in rows]


def bench_claims(
    url: str, duration: float, rounds: int, seed: int, warmup: int, batch: int = 0
) -> dict[str, Any]:
    """Per level: ``rounds`` x (onceflow run, floor run, SELECT 1 run), interleaved so that a
    burst of outside load hits both sides. Each side's rate pools its rounds; ``ratio_median``
    is the median of the per-round ratios. CPU per op: the worker processes' (client) and
    their backends' (server), from ``/proc`` over each run (warm-up included).

    ``batch`` > 0 adds two sides that claim and complete ``batch`` rows per call, as a
    worker loop does (onceflow: ``claim_next(limit=batch)`` + ``complete_many``, as its
    ``Worker``; the floor: the same two statements by hand, one token per row); an op is
    a row there too."""
    workers = Workers(url, max(CONCURRENCY), max(1, batch))
    clients = [p.pid for p in workers.procs]
    out: dict[str, Any] = {
        "duration_s": duration,
        "rounds": rounds,
        "seeded_rows": seed,
        "batch": batch,
        "levels": {},
    }
    kinds = ["onceflow", "onceflow_finish", "statements", "floor", "select1"]
    if batch:
        kinds += ["onceflow_batched", "floor_batched"]
    try:
        for n in CONCURRENCY:
            runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
            for _ in range(rounds):
                for kind in runs:
                    if kind != "select1":
                        # A batched side drains several times faster: rows for its whole run.
                        rows = max(seed, int(duration * 25_000)) if "batched" in kind else seed
                        reset_table(url, queued=rows)
                    servers = _backends(url)
                    c0, s0 = cpu_seconds(clients), cpu_seconds(servers)
                    run = workers.run(kind, n, duration, warmup)
                    ops = max(1, run["ops"] + run["warm_ops"])
                    run["client_us"] = (cpu_seconds(clients) - c0) / ops * 1e6
                    run["server_us"] = (cpu_seconds(servers) - s0) / ops * 1e6
                    runs[kind].append(run)
            level: dict[str, Any] = {}
            for kind, rs in runs.items():
                ops, secs = sum(r["ops"] for r in rs), sum(r["seconds"] for r in rs)
                level[kind] = {
                    "ops": ops,
                    "seconds": secs,
                    "ops_per_s": ops / secs,
                    "per_round": [r["ops_per_s"] for r in rs],
                    "client_us": statistics.median(r["client_us"] for r in rs),
                    "server_us": statistics.median(r["server_us"] for r in rs),
                    "exhausted": any(r["exhausted"] for r in rs),
                }
            level["ratio"] = level["onceflow"]["ops_per_s"] / level["floor"]["ops_per_s"]
            # Medians of per-round ratios: "ratio" is onceflow (complete) / the floor.
            pairs = {
                "ratio": ("onceflow", "floor"),
                "finish_ratio": ("onceflow_finish", "floor"),
                "statements_ratio": ("statements", "floor"),
            }
            if batch:
                pairs["batched_ratio"] = ("onceflow_batched", "floor_batched")
                pairs["batched_vs_floor"] = ("onceflow_batched", "floor")
            for name, (a, b) in pairs.items():
                rs = per_round_ratios(level[a]["per_round"], level[b]["per_round"])
                level[f"{name}_per_round"] = rs["ratios"]
                level[f"{name}_median"] = rs["median"]
            out["levels"][n] = level
            log(
                f"claim+complete x{n}: onceflow {level['onceflow']['ops_per_s']:,.0f}/s, "
                f"floor {level['floor']['ops_per_s']:,.0f}/s, "
                f"2xSELECT 1 {level['select1']['ops_per_s']:,.0f}/s, "
                f"ratio {level['ratio']:.2f} (median of rounds {level['ratio_median']:.2f}); "
                f"claim_next + finish {level['onceflow_finish']['ops_per_s']:,.0f}/s, "
                f"median ratio {level['finish_ratio_median']:.2f}; its statements alone "
                f"{level['statements']['ops_per_s']:,.0f}/s, "
                f"median ratio {level['statements_ratio_median']:.2f}"
            )
    finally:
        workers.close()
    return out


# ---------------------------------------------------------------------------- 3. latency vs size


def _stats(samples: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(samples) * 1e3, "p99_ms": pct(samples, 99) * 1e3}


def _floor_claim_complete(raw: psycopg.Connection[Any], worker_id: str) -> float:
    """The hand-written claim + complete of one row; answers when its claim returned."""
    token = secrets.token_hex(16)
    row = raw.execute(FLOOR_CLAIM, (token, worker_id, WC)).fetchone()
    claimed = time.perf_counter()
    assert row is not None
    raw.execute(FLOOR_COMPLETE, (RESULT_TEXT, row[0], token))
    return claimed


def bench_latency(url: str, sizes: list[int], ops: int, warmup: int) -> dict[str, Any]:
    """onceflow's claim_next + complete at growing numbers of finished rows, each op followed
    by a hand-written claim + complete on the same table (a control for the machine)."""
    queue = make_queue(url)
    raw = raw_connect(url)
    worker_id = "bench-latency"
    out: dict[str, Any] = {"ops": ops, "sizes": {}}
    try:
        reset_table(url)
        have = 0
        for size in sizes:
            t0 = time.perf_counter()
            raw.execute(SEED_FINISHED, {"wc": WC, "lo": have + 1, "hi": size})
            raw.execute(SEED_QUEUED, {"prefix": f"lat{size}-", "wc": WC, "n": 2 * (ops + warmup)})
            raw.execute(f"ANALYZE {TABLE}")
            raw.execute(f"VACUUM {TABLE}")
            have = size
            log(f"latency: {size:,} finished rows ready in {time.perf_counter() - t0:.1f}s")
            samples: dict[str, list[float]] = {
                "claim": [],
                "total": [],
                "floor_claim": [],
                "floor_total": [],
            }
            for i in range(ops + warmup):
                t0 = time.perf_counter()
                claims = queue.claim_next(WC, worker_id, 1)
                t1 = time.perf_counter()
                queue.complete(claims[0], RESULT)
                t2 = time.perf_counter()
                t3 = _floor_claim_complete(raw, worker_id)
                t4 = time.perf_counter()
                if i >= warmup:
                    samples["claim"].append(t1 - t0)
                    samples["total"].append(t2 - t0)
                    samples["floor_claim"].append(t3 - t2)
                    samples["floor_total"].append(t4 - t2)
            stats = {k: _stats(v) for k, v in samples.items()}
            out["sizes"][size] = stats
            log(
                f"latency @ {size:,}: claim_next median {stats['claim']['median_ms']:.2f} ms, "
                f"p99 {stats['claim']['p99_ms']:.2f} ms (floor claim median "
                f"{stats['floor_claim']['median_ms']:.2f} ms)"
            )
        small, big = out["sizes"][sizes[0]], out["sizes"][sizes[-1]]
        out["ratios"] = {
            f"{kind}_{q}": big[kind][f"{q}_ms"] / small[kind][f"{q}_ms"]
            for kind in samples
            for q in ("median", "p99")
        }
    finally:
        raw.close()
        queue.engine.dispose()
    return out


# ---------------------------------------------------------------------------- 4. in flight


def _paired_ops(
    queue: Any, raw: psycopg.Connection[Any], worker_id: str, ops: int, warmup: int = 0
) -> dict[str, list[float]]:
    """``ops`` (after ``warmup`` untimed) onceflow ``claim_next`` + ``finish``, each followed
    by the hand-written claim + complete on ``raw``: the seconds of each, per side."""
    samples: dict[str, list[float]] = {"onceflow": [], "floor": []}
    for i in range(ops + warmup):
        t0 = time.perf_counter()
        claims = queue.claim_next(WC, worker_id, 1)
        queue.finish(claims[0], RESULT)
        t1 = time.perf_counter()
        _floor_claim_complete(raw, worker_id)
        t2 = time.perf_counter()
        if i >= warmup:
            samples["onceflow"].append(t1 - t0)
            samples["floor"].append(t2 - t1)
    return samples


def bench_in_flight(url: str, levels: list[int], ops: int, warmup: int) -> dict[str, Any]:
    """onceflow's claim_next + finish beside the hand-written claim + complete while K other
    requests of the same class are in flight (running under live leases, as a worker with
    many slow calls has them), one connection each; the in-flight rows must stay as they
    are (a claim that took one would be a bug of the bench, and raises)."""
    queue = make_queue(url)
    raw = raw_connect(url)
    worker_id = "bench-in-flight"
    out: dict[str, Any] = {"ops": ops, "levels": {}}
    try:
        for level in levels:
            reset_table(url)
            raw.execute(SEED_RUNNING, {"wc": WC, "n": level})
            raw.execute(SEED_QUEUED, {"prefix": f"fl{level}-", "wc": WC, "n": 2 * (ops + warmup)})
            raw.execute(f"VACUUM ANALYZE {TABLE}")
            samples = _paired_ops(queue, raw, worker_id, ops, warmup)
            still = raw.execute(
                f"SELECT count(*) FROM {TABLE} WHERE claimed_by = 'holder' AND status = 'running'"
            ).fetchone()
            if still is None or still[0] != level:
                raise RuntimeError(f"in-flight rows touched: {still} of {level} left running")
            stats = {k: _stats(v) for k, v in samples.items()}
            out["levels"][level] = stats
            log(
                f"in flight {level:,}: claim_next + finish median "
                f"{stats['onceflow']['median_ms']:.2f} ms (floor {stats['floor']['median_ms']:.2f})"
            )
        first, last = out["levels"][levels[0]], out["levels"][levels[-1]]
        out["growth"] = {
            k: last[k]["median_ms"] / first[k]["median_ms"] for k in ("onceflow", "floor")
        }
    finally:
        raw.close()
        queue.engine.dispose()
    return out


# ---------------------------------------------------------------------------- 5. the claim front


def _front_pages(raw: psycopg.Connection[Any]) -> dict[str, int]:
    """Pages one claim's scan of each of ix_wpr_claim and ix_wpr_lease reads (EXPLAIN
    ANALYZE BUFFERS of the scan node, rolled back; an index scan's count includes the heap
    pages it visits, one or two here)."""
    from onceflow.queue.sql import claim_next_sql

    params = {
        "worker_class": WC, "worker_id": "probe", "tokens": "t", "lease_seconds": 30.0,
        "max_runtime": None, "now": None, "lazy": False, "terms": None,
    }  # fmt: skip
    with raw.transaction(force_rollback=True):
        row = raw.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim_next_sql(1), params
        ).fetchone()
    assert row is not None

    def pages(node: dict[str, Any], index: str) -> int:
        here = 0
        if node.get("Index Name") == index:
            here = int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))
        return here + sum(pages(child, index) for child in node.get("Plans", ()))

    plan = row[0][0]["Plan"]
    return {index: pages(plan, index) for index in ("ix_wpr_claim", "ix_wpr_lease")}


def _vacuum_stats(raw: psycopg.Connection[Any]) -> tuple[int, int]:
    row = raw.execute(
        "SELECT autovacuum_count, vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
        (TABLE,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def bench_front(url: str, windows: int, step: int, history: int) -> dict[str, Any]:
    """Claim + complete as the claims since the claim index was last vacuumed grow.

    A claim moves its row out of ix_wpr_claim (status 'queued'), but the row's old index
    entry stays until a VACUUM removes it; the entries of claimed rows gather at the front
    of the index, where every claim's scan starts, and each claim steps over them. Each
    window runs ``step`` onceflow ``claim_next`` + ``finish`` ops, each followed by the
    hand-written claim + complete (a control on the same table and index), and is preceded
    by one claim's EXPLAIN (ANALYZE, BUFFERS): the index pages it read. The first window
    starts right after ``VACUUM (INDEX_CLEANUP ON)``; after the last, the same VACUUM and one
    more window. Autovacuum runs or not as the server is configured (the count of its
    runs over the section is reported): on a server where it is on, the growth is cut back
    at each autovacuum that cleans the indexes.
    """
    from onceflow.db import holding_connections

    queue = make_queue(url)
    raw = raw_connect(url)
    worker_id = "bench-front"
    out: dict[str, Any] = {"step": step, "history": history, "windows": []}
    try:
        reset_table(url)
        raw.execute(SEED_QUEUED, {"prefix": "fr-", "wc": WC, "n": 2 * step * (windows + 1) + 100})
        if history:
            raw.execute(SEED_FINISHED, {"wc": "history", "lo": 1, "hi": history})
        raw.execute(f"VACUUM (INDEX_CLEANUP ON, ANALYZE) {TABLE}")
        shown = raw.execute(
            "SELECT current_setting('autovacuum'), current_setting('autovacuum_naptime')"
        ).fetchone()
        assert shown is not None
        out["autovacuum"] = f"{shown[0]} (naptime {shown[1]})"
        runs0 = _vacuum_stats(raw)[0]
        since = 0
        with holding_connections():
            _paired_ops(queue, raw, worker_id, 0, warmup=20)  # prepared statements, caches
            raw.execute(f"VACUUM (INDEX_CLEANUP ON) {TABLE}")
            for w in range(windows + 1):
                if w == windows:
                    raw.execute(f"VACUUM (INDEX_CLEANUP ON) {TABLE}")
                    since = 0
                start = _front_pages(raw)
                samples = _paired_ops(queue, raw, worker_id, step)
                end = _front_pages(raw)
                stats = {k: _stats(v) for k, v in samples.items()}
                # The medians cover claims since..until; the pages are read at both ends.
                out["windows"].append(
                    {
                        "since": since, "until": since + 2 * step, "after_vacuum": w == windows,
                        "pages": start["ix_wpr_claim"], "pages_end": end["ix_wpr_claim"],
                        "lease_pages": start["ix_wpr_lease"],
                        "lease_pages_end": end["ix_wpr_lease"], **stats,
                    }
                )  # fmt: skip
                log(
                    f"front: claims {since:,}-{since + 2 * step:,} since the VACUUM: "
                    f"{start['ix_wpr_claim']} -> {end['ix_wpr_claim']} pages per claim "
                    f"(ix_wpr_lease {start['ix_wpr_lease']} -> {end['ix_wpr_lease']}), "
                    f"claim_next + finish {stats['onceflow']['median_ms']:.2f} ms "
                    f"(floor {stats['floor']['median_ms']:.2f})"
                )
                since += 2 * step
        out["autovacuum_runs"] = _vacuum_stats(raw)[0] - runs0
        left = raw.execute(
            f"SELECT count(*) FROM {TABLE} WHERE claimed_by = %s AND status <> 'succeeded'",
            (worker_id,),
        ).fetchone()
        if left is None or left[0]:
            raise RuntimeError(f"front: {left} of onceflow's claimed rows did not succeed")
    finally:
        raw.close()
        queue.engine.dispose()
    return out


# ---------------------------------------------------------------------------- report


def _n(size: int) -> str:
    return f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}k"


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    ps = m["postgres_settings"]
    lines = [
        command_header(res),
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['os']}; PostgreSQL {m['postgres']} "
        f"(fsync={ps['fsync']}, synchronous_commit={ps['synchronous_commit']}, "
        f"shared_buffers={ps['shared_buffers']}); Python {m['python']}; "
        f"psycopg {m['psycopg']}; SQLAlchemy {m['sqlalchemy']}; "
        f"load average {m['loadavg_start']} at start, {res['loadavg_end']} at end",
        "",
    ]
    if "enqueue" in res:
        lines += _render_enqueue(res["enqueue"])
    if "claims" in res:
        lines += _render_claims(res["claims"])
    if "latency" in res:
        lines += _render_latency(res["latency"])
    if "in_flight" in res:
        lines += _render_in_flight(res["in_flight"])
    if "front" in res:
        lines += _render_front(res["front"])
    return "\n".join(lines)


def _render_enqueue(e: dict[str, Any]) -> list[str]:
    s, h, b = e["single"], e["single_held"], e["batched"]
    rows = [
        [
            f"`enqueue`, {s['rows']:,} rows one at a time (pooled: a checkout per call)",
            f"{s['onceflow']:,.0f} rows/s",
            f"{s['select1']:,.0f} `SELECT 1`/s",
            f"{s['onceflow'] / s['select1']:.2f}",
        ],
        [
            "`enqueue`, same rows, vs raw one-row `INSERT … ON CONFLICT DO NOTHING` (autocommit)",
            f"{s['onceflow']:,.0f} rows/s",
            f"{s['raw_insert']:,.0f} rows/s",
            f"{s['onceflow'] / s['raw_insert']:.2f} (median of blocks "
            f"{s['block_ratio_median']:.2f})",
        ],
        [
            f"`enqueue` holding its connection ({h['rows']:,} rows, the blocks between), "
            "vs the same `INSERT`",
            f"{h['onceflow']:,.0f} rows/s",
            f"{h['raw_insert']:,.0f} rows/s",
            f"{h['onceflow'] / h['raw_insert']:.2f} (median of blocks "
            f"{h['block_ratio_median']:.2f})",
        ],
        [
            f"`enqueue_many`, {e['batched_rows']:,} rows in batches of {e['batch_size']:,} "
            "vs raw `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING` (not COPY)",
            f"{b['onceflow']:,.0f} rows/s",
            f"{b['raw_unnest']:,.0f} rows/s",
            f"{b['onceflow'] / b['raw_unnest']:.2f}",
        ],
    ]
    return [
        "#### 1. Enqueue (each onceflow call interleaved with its floor call)",
        "",
        *table(["Figure", "onceflow", "Floor", "onceflow / floor"], rows),
        "",
    ]


def _render_claims(c: dict[str, Any]) -> list[str]:
    lines = [
        f"#### 2. Claim + complete per second (one process per connection; {c['rounds']} x "
        f"{c['duration_s']:g} s per side and level, interleaved, pooled)",
        "",
    ]
    rows = []
    for n, lv in c["levels"].items():
        once, floor, sel = (lv[k]["ops_per_s"] for k in ("onceflow", "floor", "select1"))
        dry = lv["onceflow"]["exhausted"] or lv["floor"]["exhausted"]
        median = lv.get("ratio_median", lv["ratio"])
        cpu = [
            f"{lv[k].get('client_us', 0):,.0f} · {lv[k].get('server_us', 0):,.0f}"
            for k in ("onceflow", "floor")
        ]
        rows.append([
            n, f"{once:,.0f} ops/s", f"{floor:,.0f} ops/s",
            f"{lv['ratio']:.2f}{' (queue ran dry)' if dry else ''}",
            f"{median:.2f} {ok(median >= TARGET_RATIO)}", cpu[0], cpu[1], f"{sel:,.0f} ops/s",
            f"{once / sel:.2f}",
        ])  # fmt: skip
    header = [
        "Connections", "onceflow", "hand-written floor", "onceflow / floor, pooled rounds",
        f"median of per-round ratios (goal ≥ {TARGET_RATIO:g})",
        "CPU µs per op, client · server: onceflow", "floor", "2 x `SELECT 1`",
        "onceflow / 2 x `SELECT 1`",
    ]  # fmt: skip
    lines += [*table(header, rows, "r" * len(header)), ""]
    if any("onceflow_finish" in lv for lv in c["levels"].values()):
        lines += [
            "The same with `Queue.finish` for `complete` (the completion reading nothing "
            "back, as the floor's does), and its two statements alone: the same SQL through "
            "`onceflow.db` on the held connection without the `Queue` API around it "
            "(validation, steps, `Request`/`Claim`, metrics). The statements' column is "
            "what the SQL costs beside the floor's; the gap between it and `finish` is the "
            "Python API's:",
            "",
        ]
        rows = []
        for n, lv in c["levels"].items():
            fin, sql_only = lv["onceflow_finish"], lv.get("statements")
            cells = [
                n, f"{fin['ops_per_s']:,.0f} ops/s", f"{lv['finish_ratio_median']:.2f}",
                f"{fin['client_us']:,.0f} · {fin['server_us']:,.0f}",
            ]  # fmt: skip
            if sql_only is not None:
                cells += [
                    f"{sql_only['ops_per_s']:,.0f} ops/s",
                    f"{lv['statements_ratio_median']:.2f}",
                    f"{sql_only['client_us']:,.0f} · {sql_only['server_us']:,.0f}",
                ]
            else:
                cells += [None, None, None]
            rows.append(cells)
        header = [
            "Connections", "onceflow `claim_next` + `finish`",
            "median of per-round ratios to the floor", "CPU µs per op, client · server",
            "its statements alone", "median of per-round ratios to the floor",
            "CPU µs per op, client · server",
        ]  # fmt: skip
        lines += [*table(header, rows, "r" * len(header)), ""]
    if c.get("batch"):
        lines += [
            f"Batched (`--batch {c['batch']}`: {c['batch']} rows claimed by one call and completed "
            "by one, as a worker loop does; rows per second; medians of per-round ratios):",
            "",
        ]
        rows = []
        for n, lv in c["levels"].items():
            ob, fb = lv["onceflow_batched"], lv["floor_batched"]
            dry = ob["exhausted"] or fb["exhausted"]
            rows.append([
                n, f"{ob['ops_per_s']:,.0f} rows/s", f"{fb['ops_per_s']:,.0f} rows/s",
                f"{lv['batched_ratio_median']:.2f}{' (queue ran dry)' if dry else ''}",
                f"{lv['batched_vs_floor_median']:.2f}",
                f"{ob['client_us']:,.0f} · {ob['server_us']:,.0f}",
                f"{fb['client_us']:,.0f} · {fb['server_us']:,.0f}",
            ])  # fmt: skip
        header = [
            "Connections", "onceflow `claim_next` + `complete_many`", "floor, batched",
            "onceflow / batched floor", "onceflow batched / the one-row floor above",
            "CPU µs per row, client · server: onceflow", "batched floor",
        ]  # fmt: skip
        lines += [*table(header, rows, "r" * len(header)), ""]
    return lines


def _render_latency(lat: dict[str, Any]) -> list[str]:
    sizes = list(lat["sizes"])
    r = lat["ratios"]
    rows: list[list[str]] = []
    for size in sizes:
        st = lat["sizes"][size]
        rows.append([_n(int(size))] + [
            f"{st[k][q]:.2f} ms" for k in ("claim", "total", "floor_claim")
            for q in ("median_ms", "p99_ms")
        ])  # fmt: skip
    big, small = _n(int(sizes[-1])), _n(int(sizes[0]))
    rows.append([
        f"**{big} / {small}** (target ≤ 1.5x)",
        f"**{r['claim_median']:.2f}x** {ok(r['claim_median'] <= 1.5)}",
        f"**{r['claim_p99']:.2f}x** {ok(r['claim_p99'] <= 1.5)}",
        f"{r['total_median']:.2f}x", f"{r['total_p99']:.2f}x",
        f"{r['floor_claim_median']:.2f}x", f"{r['floor_claim_p99']:.2f}x",
    ])  # fmt: skip
    header = [
        "Finished rows", "`claim_next` median", "`claim_next` p99", "claim + complete median",
        "claim + complete p99", "floor claim median", "floor claim p99",
    ]  # fmt: skip
    return [
        f"#### 3. Claim latency vs finished rows ({lat['ops']:,} claims per size, one "
        "connection; each onceflow op followed by a hand-written one as a control)",
        "",
        *table(header, rows, "r" * len(header)),
        "",
    ]


def _render_in_flight(fl: dict[str, Any]) -> list[str]:
    levels = list(fl["levels"])
    g = fl["growth"]
    rows: list[list[str]] = []
    for level in levels:
        o, f = fl["levels"][level]["onceflow"], fl["levels"][level]["floor"]
        rows.append([
            f"{int(level):,}", f"{o['median_ms']:.2f} ms", f"{o['p99_ms']:.2f} ms",
            f"{f['median_ms']:.2f} ms", f"{f['p99_ms']:.2f} ms",
            f"{f['median_ms'] / o['median_ms']:.2f}",
        ])  # fmt: skip
    rows.append([
        f"**{int(levels[-1]):,} / {int(levels[0]):,}** (target ≤ 1.5x)",
        f"**{g['onceflow']:.2f}x** {ok(g['onceflow'] <= 1.5)}", None, f"{g['floor']:.2f}x",
        None, None,
    ])  # fmt: skip
    header = [
        "Requests in flight", "`claim_next` + `finish` median", "p99", "floor median", "p99",
        "onceflow / floor (medians)",
    ]  # fmt: skip
    return [
        f"#### 4. Claim + complete vs requests in flight ({fl['ops']:,} ops per level, one "
        "connection; each onceflow op followed by a hand-written one as a control)",
        "",
        *table(header, rows, "r" * len(header)),
        "",
    ]


def _render_front(fr: dict[str, Any]) -> list[str]:
    first = fr["windows"][0]
    rows: list[list[str]] = []
    for w in fr["windows"]:
        o, f = w["onceflow"], w["floor"]
        label = f"{w['since']:,} to {w['until']:,}"
        if w["after_vacuum"]:
            label += " (after `VACUUM (INDEX_CLEANUP ON)`)"
        rows.append([
            label, f"{w['pages']} → {w['pages_end']}",
            f"{w['lease_pages']} → {w['lease_pages_end']}", f"{o['median_ms']:.2f} ms",
            f"{o['median_ms'] / first['onceflow']['median_ms']:.2f}x", f"{f['median_ms']:.2f} ms",
            f"{f['median_ms'] / first['floor']['median_ms']:.2f}x",
        ])  # fmt: skip
    header = [
        "Claims since the section's `VACUUM (INDEX_CLEANUP ON)` (the window's medians cover "
        "them)", "ix_wpr_claim pages per claim, at the window's start → end", "ix_wpr_lease",
        "`claim_next` + `finish` median", "vs the first window", "floor median",
        "vs the first window",
    ]  # fmt: skip
    return [
        f"#### 5. Claim + complete as claims gather at the claim index's front ({fr['step']:,} "
        f"ops per window, one connection, {fr['history']:,} finished rows of history; "
        f"autovacuum {fr['autovacuum']}, {fr['autovacuum_runs']} run(s) during the section)",
        "",
        *table(header, rows, "r" * len(header)),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run; sizes 10k and 100k")
    parser.add_argument(
        "--only",
        choices=("enqueue", "claims", "latency", "in_flight", "front"),
        help="run one section only",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="claim + complete rounds per level"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="also claim + complete B rows per call, onceflow and floor (a worker loop's way)",
    )
    parser.add_argument(
        "--front",
        default=None,
        help="section 5's WINDOWS,STEP,HISTORY (default 3,5000,200000 with --quick, else "
        "5,10000,1000000)",
    )
    args = parser.parse_args(argv)

    admin = admin_url()
    if args.quick:
        cfg = {
            "single": 500,
            "batches": 10,
            "rounds": 1,
            "duration": 2.0,
            "seed": 20_000,
            "sizes": [10_000, 100_000],
            "lat_ops": 500,
            "in_flight": [0, 3_000],
            "in_flight_ops": 300,
            "front": (3, 5_000, 200_000),
        }
    else:
        cfg = {
            "single": 2_000,
            "batches": 50,
            "rounds": 2,
            "duration": 3.0,
            "seed": 30_000,
            "sizes": [10_000, 100_000, 1_000_000],
            "lat_ops": 2_000,
            "in_flight": [0, 300, 3_000],
            "in_flight_ops": 1_000,
            "front": (5, 10_000, 1_000_000),
        }
    started = time.perf_counter()
    given = sys.argv[1:] if argv is None else argv
    results: dict[str, Any] = {"command": " ".join(["bench/queue_bench.py", *given]), "config": cfg}
    with bench_database(admin) as url:
        results["machine"] = database_machine(url)
        results["machine"]["loadavg_start"] = loadavg()
        if args.only in (None, "enqueue"):
            results["enqueue"] = bench_enqueue(url, cfg["single"], cfg["batches"], 1000)
        if args.only in (None, "claims"):
            rounds = args.rounds or cfg["rounds"]
            results["claims"] = bench_claims(
                url, cfg["duration"], rounds, cfg["seed"], warmup=30, batch=args.batch
            )
        if args.only in (None, "latency"):
            results["latency"] = bench_latency(url, cfg["sizes"], cfg["lat_ops"], warmup=100)
        if args.only in (None, "in_flight"):
            results["in_flight"] = bench_in_flight(
                url, cfg["in_flight"], cfg["in_flight_ops"], warmup=50
            )
        if args.only in (None, "front"):
            windows, step, history = (
                tuple(int(x) for x in args.front.split(",")) if args.front else cfg["front"]
            )
            results["front"] = bench_front(url, windows, step, history)
    return finish(results, started, args.json, render)


if __name__ == "__main__":
    sys.exit(main())
