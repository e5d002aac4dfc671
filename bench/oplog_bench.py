"""Layer-3 op-log benchmark: each onceflow figure beside its floor, measured in one run.

    .venv/bin/python bench/oplog_bench.py [--quick] [--json]

Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), used only as the admin
URL: the run creates its own database ``onceflow_bench_<random>``, migrates it
with ``onceflow.migrate.migrate`` and drops it at the end (``WITH (FORCE)``),
also on error or Ctrl-C. ``OpLog.apply_op`` publishes each commit on the
workspace's Redis channel after the commit; that PUBLISH is part of onceflow's
cost here and goes to ``ONCEFLOW_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``;
pub/sub is not scoped to a database number, and nobody subscribes).

What is measured, each onceflow figure beside a floor on the same tables:

1. Applied ops/s across distinct sub-docs, 1 and 4 processes, each process writing
   ``cell.set`` ops round-robin to 8 sub-docs of its own. onceflow:
   ``OpLog.apply_op(workspace_id, sub_doc, op, new_op_id())``. Reference:
   the same call with the Redis broadcast switched off on that instance (the
   bench replaces the instance's ``_broadcast``; onceflow's code is unchanged),
   to show what the PUBLISH costs. Floor: a hand-written single transaction in
   raw psycopg on the same tables (autocommit connection, ``conn.transaction()``):
   ``BEGIN``; ``SELECT clock, state FROM workspace_sub_docs … FOR UPDATE``;
   ``INSERT INTO workspace_sub_doc_ops …``; ``UPDATE workspace_sub_docs SET
   clock = clock + 1, state = …``; ``COMMIT`` (the new state is computed in
   Python from the locked row, as onceflow does; op id, canonical JSON and
   SHA-256 of the payload are computed inside the floor's timer too).
2. The same on one hot sub-doc with 1 and 4 concurrent writer processes: every
   writer queues on the one row lock, on both sides.
3. Duplicate retries/s: each process first applies 200 ops (100 with
   ``--quick``), then re-sends those committed op ids (same payloads) in a loop.
   Floors: the hand-written apply transaction of 1. (run again here, interleaved)
   and a raw one-statement primary-key lookup of the op row (the least a retry
   can cost: one round trip).
4. Round trips per op, counted client-side with libpq's protocol trace
   (``PGconn.trace``) on the pooled connection: every client ``Query`` or
   ``Sync`` gets exactly one ``ReadyForQuery`` back, so the number of
   ``ReadyForQuery`` messages is the number of round trips. Redis commands are
   counted by wrapping the OpLog's client's ``execute_command``.
5. Where one op's time goes, one process, no concurrency, the three sides
   interleaved op by op: the same trace with libpq's timestamps gives each
   round trip's time (first message sent to ``ReadyForQuery``), per statement;
   onceflow's ``PUBLISH`` is timed around the Redis client's ``execute_command``;
   the rest of the wall time per op is the client's own work (Python).

One process per connection (multiprocessing spawn), as in bench/queue_bench.py:
the client side is Python and threads would serialise it on the GIL. onceflow,
its reference and its floor are interleaved run by run (5 x 1.5 s each, pooled; the
range of the per-round ratios is shown), so outside load on a shared machine hits all
alike; the load average is reported.
Each scenario starts from truncated, vacuumed tables. Timings use
``time.perf_counter``; every timed loop is warmed up first.

Progress goes to stderr; the Markdown report (or ``--json``: the raw numbers)
to stdout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
import redis

from bench.harness import (
    ProcessPool,
    admin_url,
    bench_database,
    command_header,
    command_line,
    database_machine,
    finish,
    loadavg,
    log,
    ok,
    per_round_ratios,
    raw_connect,
    redis_version,
    run_until,
    table,
)

REDIS_DEFAULT = "redis://127.0.0.1:6379/0"
CONCURRENCY = (1, 4)
SUB_DOCS_PER_PROCESS = 8
TARGET_RATIO = 0.7
# One workspace per side, so onceflow's and the floor's clocks never share a row.
WORKSPACES = {
    "onceflow": "bench-once",
    "onceflow_nobc": "bench-nobc",
    "floor": "bench-floor",
    "dup": "bench-dup",
}

FLOOR_LOCK = """
SELECT clock, state FROM workspace_sub_docs
WHERE workspace_id = %s AND sub_doc = %s
FOR UPDATE
"""
FLOOR_CREATE = """
INSERT INTO workspace_sub_docs (workspace_id, sub_doc) VALUES (%s, %s)
ON CONFLICT (workspace_id, sub_doc) DO NOTHING
"""
FLOOR_INSERT_OP = """
INSERT INTO workspace_sub_doc_ops
    (workspace_id, sub_doc, op_id, clock, op_type, payload, payload_hash, result)
VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s, 'null'::jsonb)
"""
FLOOR_UPDATE = """
UPDATE workspace_sub_docs SET clock = clock + 1, state = %s::jsonb, updated_at = now()
WHERE workspace_id = %s AND sub_doc = %s
"""
# The least a duplicate can cost: the op row by primary key, the columns onceflow reads.
FLOOR_FIND = """
SELECT clock, op_type, payload_hash, result, error, fence, committed_at
FROM workspace_sub_doc_ops
WHERE workspace_id = %s AND sub_doc = %s AND op_id = %s
"""


# ---------------------------------------------------------------------------- the database


def reset_tables(url: str) -> None:
    with raw_connect(url) as conn:
        conn.execute("TRUNCATE workspace_sub_doc_ops, workspace_sub_docs")
        conn.execute("VACUUM ANALYZE workspace_sub_docs")
        conn.execute("VACUUM ANALYZE workspace_sub_doc_ops")


def make_oplog(url: str, redis_url: str, *, broadcast: bool = True) -> Any:
    """An OpLog as a server process would build one: shipped engine defaults, pool of 1."""
    from onceflow.db import make_engine
    from onceflow.oplog import OpLog
    from onceflow.settings import Settings

    settings = Settings(database_url=url, redis_url=redis_url)
    oplog = OpLog(make_engine(url, pool_size=1), settings)
    if not broadcast:
        oplog._broadcast = lambda *_a, **_k: None  # reference run only: no PUBLISH
    return oplog


def cell_op(i: int) -> dict[str, Any]:
    return {"type": "cell.set", "column": f"c{i % 8}", "value": i}


def floor_apply(raw: psycopg.Connection[Any], ws: str, sub_doc: str, op: dict[str, Any]) -> int:
    """The hand-written single transaction; returns the new clock."""
    from onceflow.oplog import new_op_id

    op_id = new_op_id()
    payload = json.dumps(op, separators=(",", ":"), sort_keys=True)
    digest = hashlib.sha256(payload.encode()).hexdigest()
    with raw.transaction():
        row = raw.execute(FLOOR_LOCK, (ws, sub_doc)).fetchone()
        if row is None:  # first write to this sub-doc (warm-up only)
            raw.execute(FLOOR_CREATE, (ws, sub_doc))
            row = raw.execute(FLOOR_LOCK, (ws, sub_doc)).fetchone()
        assert row is not None
        clock, state = row
        state.setdefault("cells", {})[op["column"]] = op["value"]
        raw.execute(FLOOR_INSERT_OP, (ws, sub_doc, op_id, clock + 1, op["type"], payload, digest))
        raw.execute(FLOOR_UPDATE, (json.dumps(state), ws, sub_doc))
    return int(clock) + 1


# ---------------------------------------------------------------------------- worker processes


def _worker(url: str, redis_url: str, idx: int, pipe: Pipe) -> None:
    """One benchmark process (one OpLog pool of 1, one raw connection); obeys ``pipe``."""
    from onceflow.oplog import new_op_id

    oplog = make_oplog(url, redis_url)
    nobc = make_oplog(url, redis_url, broadcast=False)
    raw = raw_connect(url)
    counter = [0]
    dups: list[tuple[str, str, dict[str, Any]]] = []  # (sub_doc, op_id, op) committed

    def target(scenario: str) -> str:
        counter[0] += 1
        if scenario == "hot":
            return "hot"
        return f"p{idx}-d{counter[0] % SUB_DOCS_PER_PROCESS}"

    def once(scenario: str) -> None:
        sub_doc = target(scenario)
        oplog.apply_op(WORKSPACES["onceflow"], sub_doc, cell_op(counter[0]), new_op_id())

    def once_nobc(scenario: str) -> None:
        sub_doc = target(scenario)
        nobc.apply_op(WORKSPACES["onceflow_nobc"], sub_doc, cell_op(counter[0]), new_op_id())

    def floor(scenario: str) -> None:
        sub_doc = target(scenario)
        floor_apply(raw, WORKSPACES["floor"], sub_doc, cell_op(counter[0]))

    def once_dup(_: str) -> None:
        counter[0] += 1
        sub_doc, op_id, op = dups[counter[0] % len(dups)]
        res = oplog.apply_op(WORKSPACES["dup"], sub_doc, op, op_id)
        if not res.duplicate:
            raise RuntimeError("a re-sent op id was applied again")

    def floor_lookup(_: str) -> None:
        counter[0] += 1
        sub_doc, op_id, _op = dups[counter[0] % len(dups)]
        if raw.execute(FLOOR_FIND, (WORKSPACES["dup"], sub_doc, op_id)).fetchone() is None:
            raise RuntimeError("the committed op row is missing")

    ops: dict[str, Callable[[str], None]] = {
        "onceflow": once,
        "onceflow_nobc": once_nobc,
        "floor": floor,
        "onceflow_dup": once_dup,
        "floor_lookup": floor_lookup,
    }
    pipe.send("ready")
    try:
        while True:
            msg = pipe.recv()
            if msg is None:
                return
            if msg[0] == "prep_dup":
                dups.clear()
                for i in range(msg[1]):
                    sub_doc = f"p{idx}-d{i % SUB_DOCS_PER_PROCESS}"
                    op_id, op = new_op_id(), cell_op(i)
                    oplog.apply_op(WORKSPACES["dup"], sub_doc, op, op_id)
                    dups.append((sub_doc, op_id, op))
                pipe.send("prepped")
            elif msg[0] == "warm":
                _, kind, scenario, n = msg
                for _ in range(n):
                    ops[kind](scenario)
                pipe.send("warm")
            elif msg[0] == "go":
                _, kind, scenario, start_at, duration = msg
                op = functools.partial(ops[kind], scenario)
                count, elapsed, _ = run_until(op, start_at, duration)
                pipe.send((count, elapsed))
    finally:
        raw.close()
        oplog.engine.dispose()
        nobc.engine.dispose()


class Workers(ProcessPool):
    """A standing pool of spawned benchmark processes."""

    def __init__(self, url: str, redis_url: str, n: int):
        super().__init__(_worker, lambda idx: (url, redis_url, idx), n)

    def prep_dup(self, n_procs: int, per_proc: int) -> None:
        if any(a != "prepped" for a in self.ask(n_procs, ("prep_dup", per_proc))):
            raise RuntimeError("a benchmark process failed to prepare duplicates")

    def run(self, kind: str, scenario: str, n: int, duration: float, warmup: int) -> dict[str, Any]:
        _, results = self.together(
            n,
            ("warm", kind, scenario, warmup),
            lambda start_at: ("go", kind, scenario, start_at, duration),
        )
        ops = sum(r[0] for r in results)
        elapsed = max(r[1] for r in results)
        return {"ops": ops, "seconds": elapsed, "ops_per_s": ops / elapsed}


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ops, secs = sum(r["ops"] for r in runs), sum(r["seconds"] for r in runs)
    return {
        "ops": ops,
        "seconds": secs,
        "ops_per_s": ops / secs,
        "per_round": [r["ops_per_s"] for r in runs],
    }


def bench_throughput(
    url: str, redis_url: str, cfg: dict[str, Any], warmup: int = 30
) -> dict[str, Any]:
    """Scenarios distinct / hot / dup at each concurrency, kinds interleaved run by run."""
    scenarios: dict[str, tuple[str, ...]] = {
        "distinct": ("onceflow", "onceflow_nobc", "floor"),
        "hot": ("onceflow", "floor"),
        "dup": ("onceflow_dup", "floor_lookup", "floor"),
    }
    workers = Workers(url, redis_url, max(CONCURRENCY))
    out: dict[str, Any] = {"duration_s": cfg["duration"], "rounds": cfg["rounds"]}
    try:
        for scenario, kinds in scenarios.items():
            out[scenario] = {}
            for n in CONCURRENCY:
                reset_tables(url)
                if scenario == "dup":
                    workers.prep_dup(n, cfg["dup_prep"])
                runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
                for _ in range(cfg["rounds"]):
                    for kind in kinds:
                        # "dup" floor applies to distinct sub-docs, like scenario 1.
                        where = "distinct" if scenario == "dup" else scenario
                        runs[kind].append(workers.run(kind, where, n, cfg["duration"], warmup))
                level = {kind: _pool(rs) for kind, rs in runs.items()}
                out[scenario][n] = level
                log(
                    f"{scenario} x{n}: "
                    + ", ".join(f"{k} {v['ops_per_s']:,.0f}/s" for k, v in level.items())
                )
    finally:
        workers.close()
    return out


# ---------------------------------------------------------------------------- round trips


_TS = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+")


class Trace:
    """libpq's protocol trace of one psycopg connection, into a temporary file, in segments.

    libpq writes the trace through a buffered stream that is flushed when tracing stops,
    so the file is read only between segments. Statement names seen in earlier segments
    are remembered, so a prepared statement is labelled with its SQL. With
    ``timestamps=True`` each round trip also gets its start (the first message sent)
    and end (the ``ReadyForQuery`` received), as libpq logged them.
    """

    def __init__(self, conn: psycopg.Connection[Any]):
        self.conn = conn
        self.file = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.names: dict[str, str] = {}
        self.offset = 0

    @contextmanager
    def segment(self, *, timestamps: bool = False) -> Iterator[dict[str, Any]]:
        """Trace the block; the yielded dict gets ``round_trips`` (a count) and
        ``trips``: one (label, start, end) per round trip (times None without timestamps)."""
        self.file.seek(0, os.SEEK_END)
        self.offset = self.file.tell()
        self.conn.pgconn.trace(self.file.fileno())
        flags = psycopg.pq.Trace.REGRESS_MODE
        if not timestamps:
            flags |= psycopg.pq.Trace.SUPPRESS_TIMESTAMPS
        self.conn.pgconn.set_trace_flags(flags)
        seg: dict[str, Any] = {}
        try:
            yield seg
        finally:
            self.conn.pgconn.untrace()  # flushes
            seg["trips"] = self._trips(self._messages())
            seg["round_trips"] = len(seg["trips"])
            seg["statements"] = [t[0] for t in seg["trips"]]

    def _messages(self) -> list[tuple[float | None, str, str, str]]:
        """This segment's protocol messages: (time, F or B, kind, body); SQL text may span
        lines, so a line that starts no message continues the one before."""
        self.file.seek(self.offset)
        out: list[tuple[float | None, str, str, str]] = []
        for ln in self.file.read().decode(errors="replace").splitlines():
            parts = ln.split("\t")
            ts: float | None = None
            if parts and _TS.fullmatch(parts[0]):
                ts = datetime.strptime(parts[0], "%Y-%m-%d %H:%M:%S.%f").timestamp()
                parts = parts[1:]
            if len(parts) >= 3 and parts[0] in ("F", "B"):
                out.append((ts, parts[0], parts[2].strip(), "\t".join(parts[3:])))
            elif out:
                t, d, kind, body = out[-1]
                out[-1] = (t, d, kind, body + " " + ln)
        return out

    def _trips(
        self, msgs: list[tuple[float | None, str, str, str]]
    ) -> list[tuple[str, float | None, float | None]]:
        """One (label, start, end) per round trip: the query, or the statement bound; a
        Parse-only round trip (psycopg preparing a statement on its 6th use) says so."""
        out: list[tuple[str, float | None, float | None]] = []
        label: str | None = None
        parsed: str | None = None
        start: float | None = None
        first = True
        for ts, direction, kind, body in msgs:
            if direction == "F" and first:
                start, first = ts, False
            if direction == "F" and kind == "Query":
                label = _label(body)
            elif direction == "F" and kind == "Parse":
                m = re.match(r'\s*"([^"]*)" "(.*)" \d+', body, re.S)
                if m:
                    parsed = _label(m.group(2))
                    if m.group(1):
                        self.names[m.group(1)] = parsed
            elif direction == "F" and kind == "Bind":
                m = re.match(r'\s*"[^"]*" "([^"]*)"', body)
                name = m.group(1) if m else ""
                label = parsed if not name else self.names.get(name, f"prepared {name}")
            elif direction == "B" and kind == "ReadyForQuery":
                out.append((label or f"prepare: {parsed}", start, ts))
                label = parsed = start = None
                first = True
        return out

    def close(self) -> None:
        self.file.close()


def _label(sql: str) -> str:
    """A short name for a statement: its verb and the tables it touches."""
    text = " ".join(sql.strip().strip('"').split())
    head = text.split(" ")[0].upper() if text else "?"
    if head in ("BEGIN", "COMMIT", "ROLLBACK"):
        return head
    touched = [
        f"{verb.upper()} {table}"
        for verb, table in re.findall(r"\b(UPDATE|INSERT INTO|FROM)\s+(\w+)", text, re.I)
    ]
    if not touched:
        return " ".join(text.split(" ")[:3])
    label = f"{head} … " + ", ".join(touched)
    if head in ("INSERT", "UPDATE") and len(touched) == 1:
        label = touched[0]
    if text.upper().endswith("FOR UPDATE"):
        label += " … FOR UPDATE"
    if "ON CONFLICT" in text.upper():
        label += " … ON CONFLICT"
    return label


def _pooled_raw(oplog: Any) -> psycopg.Connection[Any]:
    """The one connection of the OpLog's pool of 1 (checked out and returned)."""
    with oplog.engine.connect() as sa_conn:
        raw = sa_conn.connection.driver_connection
    assert raw is not None
    return raw


def _count_redis(oplog: Any) -> list[str]:
    calls: list[str] = []
    client = oplog.redis()
    original = client.execute_command

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[0]))
        return original(*args, **kwargs)

    client.execute_command = counted
    return calls


def bench_round_trips(url: str, redis_url: str, n: int = 50, warm: int = 20) -> dict[str, Any]:
    """Round trips per op on each path, after a warm-up (so psycopg has prepared every
    statement): averaged over ``n`` ops, and the statements of one more op, labelled."""
    from onceflow.oplog import new_op_id

    reset_tables(url)
    ws, floor_ws = "bench-rt", "bench-rt-floor"
    oplog = make_oplog(url, redis_url)
    raw_floor = raw_connect(url)
    once_tr, floor_tr = Trace(_pooled_raw(oplog)), Trace(raw_floor)
    redis_calls = _count_redis(oplog)
    committed: list[tuple[str, str, dict[str, Any]]] = []
    fresh = [0]

    def apply(i: int) -> Any:
        op_id, op = new_op_id(), cell_op(i)
        committed.append((f"d{i % 8}", op_id, op))
        return oplog.apply_op(ws, f"d{i % 8}", op, op_id)

    def duplicate(i: int) -> Any:
        sub_doc, op_id, op = committed[i]
        res = oplog.apply_op(ws, sub_doc, op, op_id)
        assert res.duplicate
        return res

    def first_write(i: int) -> Any:
        fresh[0] += 1
        return oplog.apply_op(ws, f"new-{fresh[0]}", cell_op(i), new_op_id())

    def floor(i: int) -> Any:
        return floor_apply(raw_floor, floor_ws, f"d{i % 8}", cell_op(i))

    def lookup(i: int) -> Any:
        sub_doc, op_id, _ = committed[i]
        return raw_floor.execute(FLOOR_FIND, (ws, sub_doc, op_id)).fetchone()

    paths: dict[str, tuple[Trace, Callable[[int], Any]]] = {
        "apply": (once_tr, apply),
        "duplicate": (once_tr, duplicate),
        "first_write": (once_tr, first_write),
        "floor": (floor_tr, floor),
        "floor_lookup": (floor_tr, lookup),
    }
    out: dict[str, Any] = {"ops": n, "warmup": warm, "counts": {}, "labels": {}}
    try:
        for name, (tr, fn) in paths.items():
            with tr.segment():
                for i in range(warm):
                    fn(i)
            redis_calls.clear()
            with tr.segment() as seg:
                for i in range(warm, warm + n):
                    fn(i)
            out["counts"][name] = {"pg": seg["round_trips"] / n, "redis": len(redis_calls) / n}
            redis_calls.clear()
            with tr.segment() as seg:
                fn(warm + n)
            out["labels"][name] = {"statements": seg["statements"], "redis": list(redis_calls)}
        log(
            "round trips per op: "
            + ", ".join(
                f"{k} {v['pg']:g} pg + {v['redis']:g} redis" for k, v in out["counts"].items()
            )
        )
    finally:
        once_tr.close()
        floor_tr.close()
        raw_floor.close()
        oplog.engine.dispose()
    return out


def bench_time_split(
    url: str, redis_url: str, ops: int, rounds: int, warm: int = 30
) -> dict[str, Any]:
    """One process, no concurrency: per op, the time in Postgres round trips (libpq trace
    timestamps: first message sent -> ReadyForQuery), in Redis (onceflow's PUBLISH, timed
    around the client's ``execute_command``), and the rest on the client (Python)."""
    from onceflow.oplog import new_op_id

    reset_tables(url)
    once = make_oplog(url, redis_url)
    nobc = make_oplog(url, redis_url, broadcast=False)
    raw = raw_connect(url)
    traces = {
        "onceflow": Trace(_pooled_raw(once)),
        "onceflow_nobc": Trace(_pooled_raw(nobc)),
        "floor": Trace(raw),
    }
    in_redis = [0.0]
    client = once.redis()
    original = client.execute_command

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            in_redis[0] += time.perf_counter() - t0

    client.execute_command = timed
    fns: dict[str, Callable[[int], Any]] = {
        "onceflow": lambda i: once.apply_op(
            WORKSPACES["onceflow"], f"d{i % 8}", cell_op(i), new_op_id()
        ),
        "onceflow_nobc": lambda i: nobc.apply_op(
            WORKSPACES["onceflow_nobc"], f"d{i % 8}", cell_op(i), new_op_id()
        ),
        "floor": lambda i: floor_apply(raw, WORKSPACES["floor"], f"d{i % 8}", cell_op(i)),
    }
    acc: dict[str, dict[str, Any]] = {
        k: {"ops": 0, "wall": 0.0, "pg": 0.0, "trips": 0, "redis": 0.0, "by": {}} for k in fns
    }
    try:
        for name, fn in fns.items():  # warm-up, traced so that statement names are learnt
            with traces[name].segment():
                for i in range(warm):
                    fn(i)
        for _ in range(rounds):
            # All three traces on at once, ops interleaved one by one: a burst of outside
            # load hits every side alike.
            with contextlib.ExitStack() as stack:
                segs = {
                    name: stack.enter_context(traces[name].segment(timestamps=True)) for name in fns
                }
                for i in range(ops):
                    for name, fn in fns.items():
                        before = in_redis[0]
                        t0 = time.perf_counter()
                        fn(i)
                        acc[name]["wall"] += time.perf_counter() - t0
                        acc[name]["redis"] += in_redis[0] - before
            for name, seg in segs.items():
                a = acc[name]
                a["ops"] += ops
                for label, start, end in seg["trips"]:
                    a["pg"] += end - start
                    a["trips"] += 1
                    a["by"].setdefault(label, []).append(end - start)
    finally:
        for tr in traces.values():
            tr.close()
        raw.close()
        once.engine.dispose()
        nobc.engine.dispose()
    out: dict[str, Any] = {"ops": ops, "rounds": rounds, "sides": {}}
    for name, a in acc.items():
        n = a["ops"]
        out["sides"][name] = {
            "ms_per_op": a["wall"] / n * 1e3,
            "trips_per_op": a["trips"] / n,
            "pg_ms": a["pg"] / n * 1e3,
            "commit_ms": sum(a["by"].get("COMMIT", [])) / n * 1e3,
            "redis_ms": a["redis"] / n * 1e3,
            "client_ms": (a["wall"] - a["pg"] - a["redis"]) / n * 1e3,
            "statements": {
                k: {"per_op": len(v) / n, "ms_per_op": sum(v) / n * 1e3} for k, v in a["by"].items()
            },
        }
    log(
        "time per op: "
        + ", ".join(
            f"{k} {v['ms_per_op']:.2f} ms ({v['pg_ms']:.2f} in Postgres round trips)"
            for k, v in out["sides"].items()
        )
    )
    return out


# ---------------------------------------------------------------------------- report


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    ps = m["postgres_settings"]
    t = res["throughput"]
    lines = [
        command_header(res),
        "",
        f"Machine: nproc {m['nproc']} ({m['cpu']}), {m['os']}; PostgreSQL {m['postgres']} "
        f"(fsync={ps['fsync']}, synchronous_commit={ps['synchronous_commit']}, "
        f"shared_buffers={ps['shared_buffers']}); Redis {m['redis_server']} (broadcasts); "
        f"Python {m['python']}; psycopg {m['psycopg']}; SQLAlchemy {m['sqlalchemy']}; "
        f"redis-py {m['redis_py']}; load average {m['loadavg_start']} at start, "
        f"{res['loadavg_end']} at end",
        "",
        f"Each figure pools {t['rounds']} x {t['duration_s']:g} s runs per side; sides "
        'interleaved run by run; one process per connection. "Rounds" gives the lowest and '
        "highest of the per-round ratios (round i of one side against round i of the other).",
        "",
        "#### 1. Applied ops/s, distinct sub-docs (each process writes to 8 sub-docs of its own)",
        "",
    ]
    rows: list[list[Any]] = []
    for n, lv in t["distinct"].items():
        once, nobc, floor = (lv[k]["ops_per_s"] for k in ("onceflow", "onceflow_nobc", "floor"))
        rows.append([
            n, f"{once:,.0f} ops/s", f"{nobc:,.0f} ops/s", f"{floor:,.0f} ops/s",
            f"{once / floor:.2f} {ok(once / floor >= TARGET_RATIO)}",
            _spread(lv, "onceflow", "floor"), f"{nobc / floor:.2f}",
        ])  # fmt: skip
    header = [
        "Processes", "onceflow `apply_op`", "onceflow, broadcast off (reference)",
        "hand-written floor", "onceflow / floor (target ≥ 0.7)", "rounds",
        "broadcast off / floor",
    ]  # fmt: skip
    lines += table(header, rows, "r" * len(header))
    lines += [
        "",
        "#### 2. Applied ops/s, one hot sub-doc (every writer on the same row)",
        "",
    ]
    rows = []
    for n, lv in t["hot"].items():
        once, floor = lv["onceflow"]["ops_per_s"], lv["floor"]["ops_per_s"]
        rows.append([
            n, f"{once:,.0f} ops/s", f"{floor:,.0f} ops/s",
            f"{once / floor:.2f} {ok(once / floor >= TARGET_RATIO)}",
            _spread(lv, "onceflow", "floor"),
        ])  # fmt: skip
    header = ["Writers", "onceflow `apply_op`", "hand-written floor",
              "onceflow / floor (target ≥ 0.7)", "rounds"]  # fmt: skip
    lines += table(header, rows, "r" * len(header))
    lines += [
        "",
        "#### 3. Duplicate retries/s (re-sending committed op ids with the same payload)",
        "",
    ]
    rows = []
    for n, lv in t["dup"].items():
        dup, floor, look = (lv[k]["ops_per_s"] for k in ("onceflow_dup", "floor", "floor_lookup"))
        rows.append([
            n, f"{dup:,.0f} /s", f"{floor:,.0f} /s", f"{dup / floor:.2f}",
            _spread(lv, "onceflow_dup", "floor"), f"{look:,.0f} /s", f"{dup / look:.2f}",
            _spread(lv, "onceflow_dup", "floor_lookup"),
        ])  # fmt: skip
    header = [
        "Processes", "onceflow duplicates", "floor apply transaction", "duplicate / floor apply",
        "rounds", "raw PK lookup of the op row", "duplicate / PK lookup", "rounds",
    ]  # fmt: skip
    lines += table(header, rows, "r" * len(header))
    rt = res["round_trips"]
    c, lab = rt["counts"], rt["labels"]
    dup_ok = c["duplicate"]["pg"] == 1 and c["duplicate"]["redis"] == 0

    def seq(name: str) -> str:
        return "; ".join(f"`{s}`" for s in lab[name]["statements"])

    lines += [
        "",
        f"#### 4. Round trips per op (libpq protocol trace; {rt['warmup']} ops of warm-up, "
        f"then averaged over {rt['ops']} ops; statements of one more op)",
        "",
        "| Path | Postgres round trips | Redis commands | Postgres statements, in order |",
        "| --- | ---: | ---: | --- |",
        f"| onceflow `apply_op`, existing sub-doc, client op id | {c['apply']['pg']:g} "
        f"| {c['apply']['redis']:g} ({', '.join(lab['apply']['redis']) or 'none'}) "
        f"| {seq('apply')} |",
        f"| onceflow duplicate retry (target: 1 round trip) | {c['duplicate']['pg']:g} "
        f"{ok(dup_ok)} | {c['duplicate']['redis']:g} | {seq('duplicate')} |",
        f"| onceflow first write to a new sub-doc | {c['first_write']['pg']:g} "
        f"| {c['first_write']['redis']:g} | {seq('first_write')} |",
        f"| hand-written floor apply | {c['floor']['pg']:g} | 0 | {seq('floor')} |",
        f"| raw PK lookup of the op row | {c['floor_lookup']['pg']:g} | 0 "
        f"| {seq('floor_lookup')} |",
        "",
    ]
    ts = res["time_split"]
    side_names = {
        "onceflow": "onceflow `apply_op`",
        "onceflow_nobc": "onceflow, broadcast off",
        "floor": "hand-written floor",
    }
    lines += [
        f"#### 5. Where one op's time goes (one process, distinct sub-docs; {ts['rounds']} x "
        f"{ts['ops']} ops per side, the three sides interleaved op by op; Postgres time from "
        "libpq trace timestamps, first message sent to `ReadyForQuery`)",
        "",
    ]
    rows = [
        [
            side_names[name], f"{sd['ms_per_op']:.2f} ms", f"{sd['trips_per_op']:g}",
            f"{sd['pg_ms']:.2f} ms", f"{sd['commit_ms']:.2f} ms", f"{sd['redis_ms']:.2f} ms",
            f"{sd['client_ms']:.2f} ms",
        ]
        for name, sd in ts["sides"].items()
    ]  # fmt: skip
    header = ["Side", "per op", "Postgres round trips", "time in them", "of which `COMMIT`",
              "Redis `PUBLISH`", "rest of the client (Python)"]  # fmt: skip
    lines += [*table(header, rows), ""]
    for name in ("onceflow", "floor"):
        stmts = ts["sides"][name]["statements"]
        lines.append(
            f"- {side_names[name]}, Postgres time per op by statement: "
            + "; ".join(_stmt_share(k, v) for k, v in stmts.items())
        )
    lines.append("")
    return "\n".join(lines)


def _spread(level: dict[str, Any], a: str, b: str) -> str:
    ratios = per_round_ratios(level[a]["per_round"], level[b]["per_round"])["ratios"]
    return f"{min(ratios):.2f} to {max(ratios):.2f}"


def _stmt_share(label: str, v: dict[str, float]) -> str:
    times = f" (x{v['per_op']:g})" if v["per_op"] != 1 else ""
    return f"`{label}`{times} {v['ms_per_op']:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run: 2 x 1 s per side")
    args = parser.parse_args(argv)

    admin = admin_url()
    redis_url = os.environ.setdefault("ONCEFLOW_REDIS_URL", REDIS_DEFAULT)
    if args.quick:
        cfg = {"duration": 1.0, "rounds": 2, "dup_prep": 100, "split_ops": 100, "split_rounds": 1}
    else:
        cfg = {"duration": 1.5, "rounds": 5, "dup_prep": 200, "split_ops": 100, "split_rounds": 4}
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": "bench/oplog_bench.py" + " --quick" * args.quick,
        "config": cfg,
        "redis_url": redis_url,
    }
    with bench_database(admin) as url:
        results["machine"] = database_machine(
            url,
            redis_server=redis_version(redis_url),
            redis_py=redis.__version__,
        )
        results["machine"]["loadavg_start"] = loadavg()
        results["round_trips"] = bench_round_trips(url, redis_url)
        results["time_split"] = bench_time_split(
            url, redis_url, cfg["split_ops"], cfg["split_rounds"]
        )
        results["throughput"] = bench_throughput(url, redis_url, cfg)
    return finish(results, started, args.json, render)


if __name__ == "__main__":
    sys.exit(main())
