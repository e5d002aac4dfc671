# Over ~400 lines on purpose: one benchmark (drains, pickup, breakdown, profile) read top to
# bottom, sharing its process helpers with bench/runtime_bench.py; not on the runtime path.
"""A fair stage-drain benchmark: onceflow's stage beside a bare Celery task, matched flags.

    PYTHONPATH=. .venv/bin/python bench/drain_bench.py [--quick] [--json] [--no-peers]
        [--no-floor] [--breakdown] [--profile] [--pickup-parts]
        [--only drain|pickup|breakdown|profile]

Results and their reading: docs/benchmarks.md, "Celery stage runtime".

Why a new file beside ``bench/runtime_bench.py``: that one starts onceflow through
``onceflow worker``, which cannot pass ``--without-gossip/--without-mingle/--without-heartbeat``
and always adds ``-E``; it pools rounds, polls the two sides differently (the
onceflow table vs a Redis counter) and includes worker start-up skew. Here both
sides start the same way and are measured the same way:

* both workers: ``python -m celery -A <app> worker -Q <queues> --loglevel WARNING
  --pool prefork -c <c> --prefetch-multiplier 1 --without-gossip --without-mingle
  --without-heartbeat``, with ``<app>`` ``bench.bench_stages:app`` (the Flow's
  Celery app; queues ``onceflow.wc.<class>`` and the maintenance queue, as
  ``onceflow worker`` consumes) or ``bench.bench_stages:bare`` (queue ``<q>-bare``).
  Task events off on both (``ONCEFLOW_BENCH_EVENTS=0``: the shipped config turns
  them on, the workers get no ``-E``). Same shipped settings otherwise: acks_late,
  prefetch 1, JSON, Redis broker (``ONCEFLOW_BENCH_REDIS_URL``, default DB 15).
* a drain: N requests enqueued with no worker (``flow.enqueue`` / ``send_task``),
  the broker list then RENAMEd aside; the worker processes are started and the
  bench waits until each one's ``worker_ready`` handler has counted (one Redis
  INCR each), then RENAMEs the list back: every process starts at once, start-up
  is outside the measurement.
* completion, on both sides: a ``task_postrun`` handler INCRs a Redis counter and
  stores ``time.time()`` of the first and the N-th finish; the bench polls that
  counter every 10 ms. The rate is (N - 1) / (last - first). Afterwards (outside
  the timing) the onceflow table must show all N succeeded.
* rounds interleaved (onceflow, Celery, onceflow, Celery…); the ratio is taken per
  round, the headline is the median of the per-round ratios, with their spread.
* configurations: one process at concurrency 2 and 4; 1, 2 and 4 processes at
  concurrency 2 (throughput and growth factor per side). During the multi-process
  drains the CPU time (utime + stime from ``/proc/<pid>/stat``) of the worker
  parents, their pool children, the Postgres backends of the bench database and
  the Redis server is read before and after: who used the two cores.
* peers (``--peers``, the default; ``--no-peers`` skips them): in the one-process
  configurations each round also drains the same N no-op jobs through Procrastinate and
  PgQueuer, after the two Celery sides (onceflow, Celery, Procrastinate, PgQueuer). Their
  consumers are ``bench/consumer_side.py``'s (``consume``; one process, concurrency c =
  Procrastinate's ``concurrency``, PgQueuer's ``max_concurrent_tasks`` with ``batch_size``
  c / 2, as PgQueuer requires ``max_concurrent_tasks >= 2 x batch_size``; stall/heartbeat
  timeout 30 s), run from the peers' virtualenv that ``bench/consumer_bench.py`` creates
  (``ONCEFLOW_BENCH_PEERS_VENV``). Each peer has a database of its own beside the bench's
  (``<bench db>_procrastinate``, ``<bench db>_pgqueuer``), its tables emptied before each
  drain; no peer process runs during the Celery sides' drains. The N jobs are queued with
  the peer's batch API before its consumer starts; each job appends its finish
  ``time.time()`` to a file, and the rate is again (N - 1) / (N-th finish - first finish),
  so start-up stays outside it. CPU seconds of the consumer process and of the backends on
  the peer's database are read when the bench sees the first and the N-th finish. Reported:
  each side's median rate and its median of per-round ratios against bare Celery and
  against onceflow.
* the design's floor (``--floor``, the default; ``--no-floor`` skips it): a third side in
  every round, bare Celery's worker running ``bench.floor`` (``bench_stages.floor_noop``),
  whose body is the no-op between the two round trips "each stage runs once" needs, by
  hand: the claim of its row by key (lazy commit, as onceflow's) and the durable
  completion fenced by its token, on one psycopg connection per process. Its N rows are
  inserted by one statement before the drain; it is started and timed as the Celery sides
  are. Reported: onceflow / floor and floor / bare Celery, medians of per-round ratios:
  what the guarantee's round trips cost, apart from what onceflow's code costs.
* pickup: one onceflow, one bare and (``--floor``) one floor worker (concurrency 2) up and
  idle; requests rotate between them, each timed from just before ``flow.enqueue`` /
  ``send_task`` (the floor: its row's INSERT, committed, then ``send_task``) to the first
  line of the body (``time.time()`` pushed to Redis), after the previous one finished and
  50 ms of idle. ``--only pickup`` runs this alone.

``--pickup-parts``: the pickup's workers run ``bench.pickup_probe`` (the same stages with
timestamp probes) and the enqueuing side is probed too: the p50 of each part (enqueue's
INSERT and commit, the publish, broker → worker, worker → pool child, Celery's tracing,
the claim, claim → body) per side, beside the totals. The probes cost a few µs each.

``--breakdown``: on a private PostgreSQL 18 and Valkey 8 (``onceflow.embedded``:
``fsync=off``, ``synchronous_commit=off``), with ``log_statement = 'all'`` set by
``ALTER SYSTEM`` (the embedded wheel may lack ``pg_stat_statements``), drain M
requests per side and count, per stage execution: the statements the server logged
(each a client round trip), ``xact_commit`` of ``pg_stat_database``, and Valkey's
``INFO commandstats`` calls, all diffed over the drain window only.

``--profile``: drain 2N requests once more per side (one process, concurrency 2) with
``py-spy record --idle --nonblocking`` on both pool children and the parent for 4 s
(py-spy from ``ONCEFLOW_BENCH_PYSPY``, the venv or ``PATH``; it is not a dependency),
and split a child's main-thread wall time per task into claim, completion, heartbeat
registration, input validation, body, the rest of the runtime, Celery tracing and
waiting for the pool's parent; the parent's samples are given as inclusive shares per
function. ``ONCEFLOW_BENCH_ONCPU=1`` samples on-CPU time only (no ``--idle``).
The breakdown and the profile run best as separate ``--only`` invocations: the
breakdown points the bench's apps at its private servers.

Progress goes to stderr; Markdown (or ``--json``) to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.consumer_bench import PEERS_VENV, Consumers, Side, ensure_peers, read_done
from bench.harness import (
    Proc,
    admin_url,
    bench_redis_url,
    command_line,
    cpu_seconds,
    latency_ms,
    libpq,
    loadavg,
    log,
    per_round_ratios,
    raw_connect,
    stack_samples,
    table,
)
from bench.runtime_bench import (
    REDIS_DEFAULT,
    Bench,
    bench_databases,
    runtime_machine,
)

POLL = 0.01
#: ``ONCEFLOW_BENCH_ONCPU=1``: profile on-CPU samples only (py-spy without ``--idle``).
IDLE = "" if os.environ.get("ONCEFLOW_BENCH_ONCPU") == "1" else "--idle"
IDLE_GAP = 0.05
#: py-spy's sampling rate for --profile (``ONCEFLOW_BENCH_PYSPY_RATE``, per second).
SPY_RATE = os.environ.get("ONCEFLOW_BENCH_PYSPY_RATE", "200")


#: The floor side's rows (bench_stages.floor_noop claims and completes them by key).
_FLOOR_ROW = """INSERT INTO workspace_process_requests (request_id, workspace_id, job_id,
    branch_path, stage, dedupe, input, input_hash, worker_class, max_attempts,
    max_crash_attempts, dispatched_at)"""
FLOOR_INSERT_MANY = f"""{_FLOOR_ROW}
SELECT %(tag)s || '-' || (i - 1), %(ws)s, %(tag)s || '-' || (i - 1), '', 'bench_noop', true,
       jsonb_build_object('n', i - 1), 'h', %(wc)s, 5, 3, now()
FROM generate_series(1, %(n)s) AS i"""
#: The floor's enqueue at pickup: the one row, committed durably before its message is sent.
FLOOR_INSERT_ONE = f"""{_FLOOR_ROW}
VALUES (%(rid)s, %(ws)s, %(rid)s, '', 'bench_noop', true, %(input)s::jsonb, 'h', %(wc)s,
        5, 3, now())"""


class Drain(Bench):
    """The runtime bench's run state, with matched worker commands and a start gate."""

    def __init__(self, *args: Any) -> None:
        os.environ["ONCEFLOW_BENCH_EVENTS"] = "0"
        super().__init__(*args)
        self.env["ONCEFLOW_BENCH_EVENTS"] = "0"
        from onceflow.keys import queue_name

        self.flow_queue = queue_name(self.queue)
        self.names = 0
        self.polls = 0
        #: The workers' app module: the bench's stages, or the same with probes (--pickup-parts).
        self.module = "bench.bench_stages"

    def queue_of(self, kind: str) -> str:
        if kind == "floor":
            return str(self.stages.FLOOR_QUEUE)
        return self.flow_queue if kind == "onceflow" else self.stages.BARE_QUEUE

    def reset(self) -> None:
        super().reset()
        self.redis.delete(self.stages.FLOOR_QUEUE)

    def worker(self, kind: str, concurrency: int, total: int = 0) -> Proc:
        if kind == "onceflow":
            app = f"{self.module}:app"
            queues = ",".join(self.stages.flow.broker_queues([self.queue]))
        else:
            app, queues = f"{self.module}:bare", self.queue_of(kind)
        self.names += 1
        argv = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-Q", queues,
            "--loglevel", "WARNING", "--pool", "prefork", "-c", str(concurrency),
            "--prefetch-multiplier", "1", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-n", f"{kind}{self.names}-{self.queue}@%h",
        ]  # fmt: skip
        return self.start(f"worker-{kind}-{self.names}", argv, total)

    def wait_ready(self, procs: list[Proc], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while int(self.redis.get(f"{self.keys}:ready") or 0) < len(procs):
            for p in procs:
                p.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("workers not ready in time")
            time.sleep(POLL)

    def enqueue(self, kind: str, n: int, tag: str) -> float:
        t0 = time.perf_counter()
        if kind == "onceflow":
            for i in range(n):
                self.stages.flow.enqueue("bench_noop", "bench", f"{tag}-{i}", input={"n": i})
        elif kind == "floor":  # the rows first (one statement), then a message per row
            with raw_connect(self.url) as conn:
                conn.execute(FLOOR_INSERT_MANY, {"tag": tag, "n": n, **self.floor_row()})
            for i in range(n):
                self.send_floor(f"{tag}-{i}")
        else:
            for i in range(n):
                self.stages.bare.send_task("bench.noop", args=[i], queue=self.stages.BARE_QUEUE)
        return time.perf_counter() - t0

    def floor_row(self) -> dict[str, str]:
        """The floor rows' workspace and worker class (bench_stages names them)."""
        return {"ws": self.stages.FLOOR_WORKSPACE, "wc": self.stages.FLOOR_CLASS}

    def send_floor(self, request_id: str, pickup: bool = False) -> None:
        self.stages.bare.send_task(
            "bench.floor", args=[request_id, pickup], queue=self.stages.FLOOR_QUEUE
        )

    def done(self, kind: str) -> int:
        self.polls += 1  # the bench's own GETs, taken out of the breakdown's Redis counts
        return int(self.redis.get(f"{self.keys}:done:{kind}") or 0)


def drain(
    b: Drain,
    kind: str,
    n: int,
    processes: int,
    concurrency: int,
    tag: str,
    probe: Any = None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """One gated drain of ``n`` requests; ``probe(phase, procs)`` runs just before the
    release and just after the last finish (both outside the rate's window)."""
    b.reset()
    enqueue_s = b.enqueue(kind, n, tag)
    q = b.queue_of(kind)
    if b.redis.llen(q) != n:
        raise RuntimeError(f"{kind}: {b.redis.llen(q)} messages queued for {n}")
    hold = f"{b.keys}:hold"
    b.redis.rename(q, hold)
    procs = [b.worker(kind, concurrency, total=n) for _ in range(processes)]
    try:
        b.wait_ready(procs)
        time.sleep(0.5)  # the pool children settle on their first receive
        before = probe("before", procs) if probe else None
        b.redis.rename(hold, q)
        released = time.time()
        deadline = time.monotonic() + timeout
        while b.done(kind) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{kind}: not drained after {timeout}s")
            time.sleep(POLL)
        seen = time.time()
        after = probe("after", procs) if probe else None
        first, last = b.redis_time("first", kind), b.redis_time("last", kind)
    finally:
        for p in procs:
            b.stop(p)
    if kind in ("onceflow", "floor"):
        counts = b.onceflow_counts()
        if counts != {"succeeded": n}:
            raise RuntimeError(f"{kind} drain ended with {counts}")
    elif b.done(kind) != n:
        raise RuntimeError(f"bare Celery ran {b.done(kind)} tasks for {n} messages")
    return {
        "per_s": (n - 1) / (last - first),
        "from_release_per_s": n / (seen - released),
        "enqueue_per_s": n / enqueue_s,
        "probe": (before, after),
    }


# ---------------------------------------------------------------------------- peers

PEERS = ("procrastinate", "pgqueuer")
#: ``consumer_side.py --stall`` for the peers' drains: Procrastinate's default
#: ``stalled_worker_timeout`` (heartbeat every STALL/4 s; PgQueuer's ``heartbeat_timeout``).
PEER_STALL = 30.0
#: The tables of a peer's schema (all in ``public`` of its own database), emptied per drain.
PEER_TABLES = {"procrastinate": "procrastinate_%", "pgqueuer": "pgqueuer%"}


class Peers:
    """Procrastinate and PgQueuer consumers of ``bench/consumer_side.py``, run from the peers'
    virtualenv (``ONCEFLOW_BENCH_PEERS_VENV``, created as ``bench/consumer_bench.py`` does),
    each on a database of its own beside the bench's: ``<bench db>_<system>``."""

    def __init__(self, admin: str, url: str, logdir: Path) -> None:
        venv = Path(os.environ.get("ONCEFLOW_BENCH_PEERS_VENV", PEERS_VENV))
        python = ensure_peers(venv, install=True)
        if python is None:
            raise RuntimeError(f"no peers' virtualenv at {venv}")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.sides = {s: Side(s, python, env) for s in PEERS}
        base = make_url(url)
        self.urls = {
            s: base.set(database=f"{base.database}_{s}").render_as_string(hide_password=False)
            for s in PEERS
        }
        self.admin, self.logdir = admin, logdir
        self.versions: dict[str, str] = {}
        self.made: list[str] = []

    def __enter__(self) -> Peers:
        try:
            for system, url in self.urls.items():
                with raw_connect(self.admin) as conn:
                    conn.execute(f'CREATE DATABASE "{make_url(url).database}"')
                self.made.append(str(make_url(url).database))
                self.sides[system].run("schema", system, libpq(url))
                log(f"{system}: schema in {make_url(url).database}")
            self.versions = json.loads(self.sides[PEERS[0]].run("versions"))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with raw_connect(self.admin) as conn:
            for db in self.made:
                conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
                log(f"dropped database {db}")
        self.made.clear()

    def reset(self, system: str) -> None:
        """Empty the peer's tables (jobs, events, logs), as ``Bench.reset`` does onceflow's."""
        with raw_connect(self.urls[system]) as conn:
            tables = [
                str(r[0])
                for r in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                    "AND tablename LIKE %s",
                    (PEER_TABLES[system],),
                ).fetchall()
            ]
            conn.execute(f"TRUNCATE {', '.join(tables)} CASCADE")
            for table in tables:
                conn.execute(f"VACUUM ANALYZE {table}")


class _Finished:
    """Lines the jobs appended to their done files so far, read incrementally (the poll
    costs about what the Celery sides' Redis GET does)."""

    def __init__(self, done: Path) -> None:
        self.done = done
        self.seen: dict[Path, tuple[int, int]] = {}

    def __call__(self) -> int:
        for path in self.done.glob("*.log"):
            offset, lines = self.seen.get(path, (0, 0))
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            self.seen[path] = (offset + len(chunk), lines + chunk.count(b"\n"))
        return sum(lines for _, lines in self.seen.values())


def drain_peer(
    peers: Peers, system: str, n: int, concurrency: int, tag: str, timeout: float = 900.0
) -> dict[str, Any]:
    """One drain of ``n`` no-op jobs queued (the peer's batch API) before its one consumer
    process starts. The rate is the Celery sides': (N - 1) / (N-th finish - first finish),
    from the ``time.time()`` each job records after its body, so the consumer's start-up is
    outside it."""
    peers.reset(system)
    side, dsn = peers.sides[system], libpq(peers.urls[system])
    out = side.run("preload", system, dsn, "--prefix", f"{tag}-", "--n", str(n))
    preload = json.loads(out.strip().splitlines()[-1])
    done = peers.logdir / f"done-{system}-{tag}"
    finished = _Finished(done)
    cons = Consumers(side, dsn, done, peers.logdir, concurrency, PEER_STALL)
    launched = time.time()
    cons.start(1)
    cpu: list[tuple[float, float, float]] = []  # (wall, consumer, backends) at first and N-th
    try:
        deadline = time.monotonic() + timeout
        while (count := finished()) < n:
            cons.supervise()
            if cons.restarts:
                raise RuntimeError(f"{system}: the consumer exited: {cons.exits}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: not drained after {timeout}s")
            if count and not cpu:
                cpu.append(peer_cpu(peers, system, cons))
            time.sleep(POLL)
        cpu.append(peer_cpu(peers, system, cons))
    finally:
        cons.stop_all()
    rows = read_done(done)
    if len(rows) != n or len({r[0] for r in rows}) != n:
        raise RuntimeError(f"{system}: {len(rows)} executions of {len({r[0] for r in rows})} jobs")
    ends = sorted(r[3] for r in rows)
    (w0, c0, b0), (w1, c1, b1) = cpu[0], cpu[-1]
    return {
        "per_s": (n - 1) / (ends[-1] - ends[0]),
        "from_launch_per_s": n / (ends[-1] - launched),
        "enqueue_per_s": n / preload["seconds"],
        # from the poll that saw the first finish to the one that saw the N-th
        "cpu": {
            "consumer_cores": (c1 - c0) / (w1 - w0),
            "backends_cores": (b1 - b0) / (w1 - w0),
            "consumer_ms_per_job": (c1 - c0) / n * 1e3,
            "backends_ms_per_job": (b1 - b0) / n * 1e3,
        },
    }


def peer_cpu(peers: Peers, system: str, cons: Consumers) -> tuple[float, float, float]:
    """Wall clock, CPU seconds of the consumer process (and any children), and CPU seconds
    of the Postgres backends on the peer's database (the bench's own connection aside)."""
    pids = [p.pid for p in cons.procs if p is not None]
    consumer = sum(cpu_seconds([pid]) for pid in pids + [c for pid in pids for c in _children(pid)])
    with raw_connect(peers.urls[system]) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        ).fetchall()
    return time.time(), consumer, cpu_seconds(int(r[0]) for r in rows)


# ---------------------------------------------------------------------------- CPU per process


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(x) for x in out.stdout.split()]


def cpu_probe(b: Drain) -> Any:
    """A probe reading CPU seconds of the drain's processes, by role."""
    redis_pid = int(b.redis.info("server")["process_id"])

    def probe(phase: str, procs: list[Proc]) -> dict[str, dict[int, float]]:
        parents = [p.popen.pid for p in procs]
        children = [c for p in parents for c in _children(p)]
        with raw_connect(b.url) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        backends = [int(r[0]) for r in rows]
        roles = {"parents": parents, "children": children, "backends": backends}
        out = {role: {pid: cpu_seconds([pid]) for pid in pids} for role, pids in roles.items()}
        out["redis"] = {redis_pid: cpu_seconds([redis_pid])}
        out["wall"] = {0: time.time()}
        return out

    return probe


def cpu_use(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], n: int
) -> dict[str, float]:
    wall = after["wall"][0] - before["wall"][0]
    out: dict[str, float] = {"wall_s": wall}
    for role in ("parents", "children", "backends", "redis"):
        used = sum(after[role].get(pid, 0.0) - before[role].get(pid, 0.0) for pid in after[role])
        out[f"{role}_cores"] = used / wall
        out[f"{role}_ms_per_stage"] = used / n * 1e3
    return out


# ---------------------------------------------------------------------------- 1. drains


def bench_drains(
    b: Drain,
    n: int,
    rounds: int,
    configs: list[tuple[int, int]],
    peers: Peers | None = None,
    floor: bool = True,
) -> list[dict[str, Any]]:
    """Per configuration, rounds of onceflow, bare Celery, (``floor``) the design's floor and
    (one process only, when ``peers``) Procrastinate and PgQueuer, interleaved in that order
    within each round."""
    results = []
    kinds = [("onceflow", "onceflow"), ("bare", "celery")] + [("floor", "floor")] * floor
    for processes, concurrency in configs:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for _, side in kinds}
        multi = processes > 1
        for rnd in range(rounds):
            tag = f"p{processes}c{concurrency}r{rnd}"
            for kind, side in kinds:
                probe = cpu_probe(b) if multi or processes == 1 else None
                res = drain(b, kind, n, processes, concurrency, tag, probe)
                before, after = res.pop("probe")
                if before is not None:
                    res["cpu"] = cpu_use(before, after, n)
                runs[side].append(res)
                log(
                    f"{processes}x c={concurrency} round {rnd + 1} {side}: {res['per_s']:,.0f}/s "
                    f"({res['from_release_per_s']:,.0f}/s from release)"
                )
            for system in PEERS if peers is not None and processes == 1 else ():
                assert peers is not None
                res = drain_peer(peers, system, n, concurrency, tag)
                runs.setdefault(system, []).append(res)
                log(
                    f"{processes}x c={concurrency} round {rnd + 1} {system}: "
                    f"{res['per_s']:,.0f}/s ({res['from_launch_per_s']:,.0f}/s from launch)"
                )
        vs_celery = per_round(runs["onceflow"], runs["celery"])
        ratios = vs_celery["ratios"]
        results.append(
            {
                "processes": processes,
                "concurrency": concurrency,
                "ratios": ratios,
                "ratio_median": vs_celery["median"],
                # onceflow beside the design's floor, and the floor beside bare Celery
                "vs_floor": per_round(runs["onceflow"], runs["floor"]) if floor else None,
                "floor_vs_celery": per_round(runs["floor"], runs["celery"]) if floor else None,
                "sides": {
                    side: {
                        "per_s_median": statistics.median(r["per_s"] for r in rs),
                        "runs": rs,
                    }
                    for side, rs in runs.items()
                },
                "peers": {
                    system: {
                        f"vs_{base}": per_round(runs[system], runs[base])
                        for base in ("celery", "onceflow")
                    }
                    for system in PEERS
                    if system in runs
                },
            }
        )
        log(f"{processes}x c={concurrency}: median ratio {vs_celery['median']:.2f} {ratios}")
    return results


def per_round(side: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    return per_round_ratios([s["per_s"] for s in side], [b["per_s"] for b in base])


# ---------------------------------------------------------------------------- 2. pickup


def bench_pickup(
    b: Drain, count: int, warm: int, parts: bool = False, floor: bool = True
) -> dict[str, Any]:
    """Pickup latency; ``parts``: also where it goes (bench/pickup_probe.py); ``floor``: the
    design's floor too (its row INSERT committed, then its message; the claim in the body)."""
    floor = floor and not parts
    b.reset()
    probe: Any = None
    if parts:
        log_path = b.logdir / "pickup-probes.log"
        os.environ["ONCEFLOW_BENCH_PROBE_LOG"] = b.env["ONCEFLOW_BENCH_PROBE_LOG"] = str(log_path)
        from bench import pickup_probe as probe

        probe.instrument_caller()
        b.module = "bench.pickup_probe"
    tags = ["onceflow", "bare"] + ["floor"] * floor
    workers = [b.worker(tag, 2) for tag in tags]
    writer = raw_connect(b.url)  # the floor's enqueuing connection (autocommit, durable)
    try:
        b.wait_ready(workers)
        time.sleep(1.0)
        samples: dict[str, list[float]] = {tag: [] for tag in tags}
        done = dict.fromkeys(tags, 0)
        for i in range(len(tags) * (count + warm)):
            tag = tags[i % len(tags)]
            if probe is not None:
                probe.begin(tag, i // len(tags) >= warm)
                probe.mark("c0")
            t0 = time.time()
            if tag == "onceflow":
                b.stages.flow.enqueue(
                    "bench_noop", "bench", f"pick-{i}", input={"n": i, "pickup": True}
                )
            elif tag == "floor":
                rid = f"pick-floor-{i}"
                row = {"rid": rid, "input": json.dumps({"n": i}), **b.floor_row()}
                writer.execute(FLOOR_INSERT_ONE, row)
                b.send_floor(rid, pickup=True)
            else:
                b.stages.bare.send_task("bench.noop", args=[i, True], queue=b.stages.BARE_QUEUE)
            got = b.redis.blpop([f"{b.keys}:pickup:{tag}"], timeout=30)
            if got is None:
                raise RuntimeError(f"{tag}: the stage did not start within 30 s")
            started = float(got[1])
            done[tag] += 1
            deadline = time.monotonic() + 30
            while b.done(tag) < done[tag]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{tag}: the task did not finish within 30 s")
                time.sleep(0.002)
            if i // len(tags) >= warm:
                samples[tag].append(started - t0)
            time.sleep(IDLE_GAP)
    finally:
        writer.close()
        for w in workers:
            b.stop(w)
    out = {tag: latency_ms(xs) for tag, xs in samples.items()}
    out["ratio_p50"] = {"x": out["onceflow"]["p50_ms"] / out["bare"]["p50_ms"]}
    if floor:
        out["vs_floor_p50"] = {"x": out["onceflow"]["p50_ms"] / out["floor"]["p50_ms"]}
    if probe is not None:
        out["parts_p50_ms"] = probe.parts(os.environ["ONCEFLOW_BENCH_PROBE_LOG"])
        for side, steps in out["parts_p50_ms"].items():
            log(f"pickup parts, {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in steps.items()))
    log("pickup p50 " + ", ".join(f"{tag} {out[tag]['p50_ms']:.2f} ms" for tag in tags))
    return out


# ---------------------------------------------------------------------------- 3. breakdown

STATEMENT = re.compile(r"LOG:\s+(?:statement|execute [^:]*):\s+(\w+)")


def bench_breakdown(m: int) -> dict[str, Any]:
    """Statements, commits and Redis commands per stage on a private Postgres and Valkey."""
    from onceflow.embedded import embedded_services

    with (
        tempfile.TemporaryDirectory(prefix="onceflow-drain-breakdown-") as tmp,
        embedded_services() as svc,
    ):
        with raw_connect(svc.database_url) as conn:
            conn.execute("ALTER SYSTEM SET log_statement = 'all'")
            conn.execute("SELECT pg_reload_conf()")
        logs = [
            p
            for p in svc.data_dir.rglob("*.log")
            if "postgres" in p.name.lower() or "pg" in p.name.lower()
        ]
        if not logs:
            logs = list(svc.data_dir.rglob("*.log"))
        out: dict[str, Any] = {"m": m, "log": str(logs)}
        with bench_databases(svc.database_url, False) as (url, _):
            b = Drain(url, None, svc.redis_url, Path("/nonexistent"), Path(tmp))
            dbname = url.rsplit("/", 1)[1]
            try:
                for kind in ("onceflow", "bare"):

                    def probe(phase: str, procs: list[Proc]) -> dict[str, Any]:
                        # Backends flush pg_stat_database when idle, within ~10 s (PG 15+);
                        # the postrun INCRs and log lines land meanwhile too.
                        time.sleep(11.0)
                        polls = b.polls
                        with raw_connect(svc.database_url) as conn:
                            xact = conn.execute(
                                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                                (dbname,),
                            ).fetchone()
                        stats = b.redis.info("commandstats")
                        sizes = {str(p): p.stat().st_size for p in logs}
                        return {
                            "xact": int(xact[0]) if xact else 0,
                            "cmd": stats,
                            "sizes": sizes,
                            "polls": polls,
                        }

                    res = drain(b, kind, m, 1, 2, f"bd-{kind}", probe)
                    before, after = res["probe"]
                    statements: dict[str, int] = {}
                    for p in logs:
                        with open(p, "rb") as f:
                            f.seek(before["sizes"][str(p)])
                            text = f.read(after["sizes"][str(p)] - before["sizes"][str(p)]).decode(
                                errors="replace"
                            )
                        for word in STATEMENT.findall(text):
                            statements[word.upper()] = statements.get(word.upper(), 0) + 1
                    cmds = {
                        k.removeprefix("cmdstat_"): int(v["calls"])
                        - int(before["cmd"].get(k, {}).get("calls", 0))
                        for k, v in after["cmd"].items()
                    }
                    # The bench's own commands between the two probes: its polling GETs,
                    # the RENAME that releases the queue and the first probe's INFO.
                    cmds["get"] = cmds.get("get", 0) - (after["polls"] - before["polls"])
                    cmds["rename"] = cmds.get("rename", 0) - 1
                    cmds["info"] = cmds.get("info", 0) - 1
                    cmds = {k: v for k, v in cmds.items() if v}
                    out[kind] = {
                        "statements": statements,
                        "commits": after["xact"] - before["xact"],
                        "redis": cmds,
                    }
                    log(f"breakdown {kind}: {out[kind]}")
            finally:
                b.stop_all()
                b.cleanup()
    return out


# ---------------------------------------------------------------------------- 4. profile

BUCKETS = (
    ("Queue.claim (", "claim (UPDATE … RETURNING, commit)"),
    ("ClaimOps.claim (", "claim (UPDATE … RETURNING, commit)"),  # after the store's split
    ("Queue.hand_off (", "completion (hand_off: UPDATE, commit)"),
    ("ClaimOps.hand_off (", "completion (hand_off: UPDATE, commit)"),
    # An operation runs as a generator driven by its connector, suspended while the
    # connector waits: the frames on the stack are runtime.py's _claim/_complete.
    ("_claim (", "claim (UPDATE … RETURNING, commit)"),
    ("_complete (", "completion (hand_off: UPDATE, commit)"),
    ("_Heartbeats.add (", "heartbeat registration (add/remove)"),
    ("_Heartbeats.remove (", "heartbeat registration (add/remove)"),
    ("model_validate (", "input validation (pydantic)"),
    ("bench_noop (", "the stage body"),
    ("run_request (", "the rest of run_request (context, metrics, outcome)"),
    ("bare_noop (", "the stage body"),
    ("trace_task (", "Celery's task tracing (signals incl. the bench's INCR, ack)"),
    ("_make_protected_receive", "waiting for the next message from the pool's parent"),
)


def pyspy_path() -> str | None:
    env = os.environ.get("ONCEFLOW_BENCH_PYSPY")
    if env:
        return env
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def profile(b: Drain, kind: str, n: int, seconds: float, pyspy: str) -> dict[str, Any]:
    spies: list[tuple[Path, subprocess.Popen[bytes]]] = []
    parent: list[tuple[Path, subprocess.Popen[bytes]]] = []
    counted: dict[str, int] = {}

    def probe(phase: str, procs: list[Proc]) -> None:
        if phase == "before":
            for pid in _children(procs[0].popen.pid):
                out = b.logdir / f"pyspy-{kind}-{pid}.txt"
                argv = [
                    pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                    "--rate", SPY_RATE, IDLE, "--nonblocking", "--format", "raw", "-o", str(out),
                ]  # fmt: skip
                argv = [a for a in argv if a]
                spies.append(
                    (
                        out,
                        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
                    )
                )
            parent_out = b.logdir / f"pyspy-{kind}-parent.txt"
            argv = [
                pyspy, "record", "--pid", str(procs[0].popen.pid),
                "--duration", str(int(seconds)), "--rate", SPY_RATE, IDLE, "--nonblocking",
                "--format", "raw", "-o", str(parent_out),
            ]  # fmt: skip
            argv = [a for a in argv if a]
            spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            parent.append((parent_out, spy))
            time.sleep(0.5)  # py-spy attaches
            counted["before"] = b.done(kind)
        return None

    # The drain is released right after the probe: py-spy samples from the start.
    res = drain(b, kind, n, 1, 2, f"prof-{kind}", probe)
    for _, spy in spies:
        spy.wait(timeout=seconds + 60)
    buckets, db_wait, total = stack_samples([out for out, _ in spies], "workloop", BUCKETS)
    for _, spy in parent:
        spy.wait(timeout=seconds + 60)
    rate = res["per_s"]
    # child wall time per task = children / throughput (both children busy or waiting)
    child_ms = len(spies) / rate * 1e3
    shares = {k: v / max(total, 1) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])}
    waits = {k: v / max(total, 1) for k, v in db_wait.items()}
    log(f"profile {kind}: {rate:,.0f}/s; " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    return {
        "kind": kind,
        "per_s": rate,
        "child_ms_per_task": child_ms,
        "shares": shares,
        "db_wait": waits,
        "parent_top": parent_top(parent[0][0]) if parent else {},
    }


def parent_top(path: Path, top: int = 25) -> dict[str, float]:
    """The pool parent's main thread: inclusive share of its samples per function."""
    seen: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if "__main__" not in stack or not count.isdigit():
            continue  # not the main thread
        total += int(count)
        for name in {
            f.split(" (")[0] + " " + f.split("/")[-1].split(":")[0] for f in stack.split(";")
        }:
            seen[name] = seen.get(name, 0) + int(count)
    ranked = sorted(seen.items(), key=lambda kv: -kv[1])[:top]
    return {k: v / max(total, 1) for k, v in ranked}


# ---------------------------------------------------------------------------- report


def grow(d: dict[str, Any], base: dict[str, Any], side: str) -> float:
    return float(d["sides"][side]["per_s_median"] / base[side]["per_s_median"])


def render_floor(res: dict[str, Any]) -> list[str]:
    """The drains beside the design's floor (bare Celery + the two hand-written statements)."""
    drains = [d for d in res["drains"] if d.get("vs_floor")]
    if not drains:
        return []
    rows = [
        [
            f"{d['processes']} x {d['concurrency']}",
            f"{d['sides']['floor']['per_s_median']:,.0f}",
            f"**{d['vs_floor']['median']:.2f}**",
            ", ".join(f"{r:.2f}" for r in d["vs_floor"]["ratios"]),
            f"{d['floor_vs_celery']['median']:.2f}",
        ]
        for d in drains
    ]
    header = [
        "processes x concurrency", "floor/s (median)",
        "onceflow / floor, median of per-round ratios", "per-round ratios",
        "floor / bare Celery, median of per-round ratios",
    ]  # fmt: skip
    return ["", *table(header, rows, "lrrlr")]


def render_peers(res: dict[str, Any]) -> list[str]:
    """The one-process drains with Procrastinate and PgQueuer beside the Celery sides."""
    drains = [d for d in res["drains"] if d.get("peers")]
    if not drains:
        return []
    v = res["machine"].get("peers", {})
    lines = [
        "",
        f"Peers, one consumer process each (Procrastinate {v.get('procrastinate', '?')}, "
        f"PgQueuer {v.get('pgqueuer', '?')}, psycopg {v.get('psycopg', '?')} in their venv): "
        f"concurrency c = Procrastinate's `concurrency`, PgQueuer's `max_concurrent_tasks` "
        f"with `batch_size` = c / 2; stall/heartbeat timeout {PEER_STALL:g} s.",
        "",
    ]
    cells: list[list[str]] = []
    for d in drains:
        s = d["sides"]
        rows = [
            ("onceflow", d["ratio_median"], None, d["ratios"]),
            ("bare Celery", None, None, []),
        ] + [
            (name, p["vs_celery"]["median"], p["vs_onceflow"]["median"], p["vs_celery"]["ratios"])
            for name, p in d["peers"].items()
        ]
        for name, vs_c, vs_o, ratios in rows:
            key = "celery" if name == "bare Celery" else name
            cpus = [r["cpu"] for r in s[key]["runs"] if "cpu" in r]
            if key in PEERS:
                worker = statistics.median(c["consumer_ms_per_job"] for c in cpus)
            else:
                worker = statistics.median(
                    c["parents_ms_per_stage"] + c["children_ms_per_stage"] for c in cpus
                )
            pg = statistics.median(
                c.get("backends_ms_per_job", c.get("backends_ms_per_stage", 0.0)) for c in cpus
            )
            cells.append([
                str(d["concurrency"]), name, f"{s[key]['per_s_median']:,.0f}",
                "—" if vs_c is None else f"**{vs_c:.2f}**",
                "—" if vs_o is None else f"**{vs_o:.2f}**",
                ", ".join(f"{r:.2f}" for r in ratios), f"{worker:.2f} / {pg:.2f}",
            ])  # fmt: skip
    header = [
        "1 process, c", "side", "jobs/s (median)", "/ bare Celery, median of per-round ratios",
        "/ onceflow, median of per-round ratios", "per-round ratios / bare Celery",
        "CPU ms per job: worker processes / PG backends",
    ]  # fmt: skip
    return lines + table(header, cells, "llrrrlr")


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"Command: `{res['command']}` · {m['date']} · wall {res['wall_seconds']:.0f} s · "
        f"nproc {m['nproc']} ({m['cpu']}); PostgreSQL {m['postgres']}; Redis "
        f"{m['redis_server']}; Python {m['python']}; Celery {m['celery']}; psycopg {m['psycopg']}; "
        f"load {m['loadavg_start']} → {res['loadavg_end']}",
        "",
        f"Drain: {res['config']['n']:,} no-op requests, "
        f"{res['config']['rounds']} interleaved rounds.",
        "",
    ]
    header = [
        "processes x concurrency", "onceflow/s (median)", "bare Celery/s (median)",
        "onceflow / Celery, median of per-round ratios", "per-round ratios",
    ]  # fmt: skip
    lines += table(header, [
        [
            f"{d['processes']} x {d['concurrency']}",
            f"{d['sides']['onceflow']['per_s_median']:,.0f}",
            f"{d['sides']['celery']['per_s_median']:,.0f}", f"**{d['ratio_median']:.2f}**",
            ", ".join(f"{r:.2f}" for r in d["ratios"]),
        ]
        for d in res["drains"]
    ], "lrrrl")  # fmt: skip
    lines += render_floor(res)
    lines += render_peers(res)
    scale = [d for d in res["drains"] if d["concurrency"] == 2]
    if len(scale) > 1:
        base = scale[0]["sides"]
        lines += ["", *table(["processes (c=2)", "onceflow growth", "bare Celery growth"], [
            [
                d["processes"], f"{grow(d, base, 'onceflow'):.2f}x",
                f"{d['sides']['celery']['per_s_median'] / base['celery']['per_s_median']:.2f}x",
            ]
            for d in scale
        ])]  # fmt: skip
        rows: list[list[str]] = []
        for d in scale:
            for side, sd in d["sides"].items():
                cpus = [r["cpu"] for r in sd["runs"] if "cpu" in r]
                if not cpus or side in PEERS:
                    continue
                med = {k: statistics.median(c[k] for c in cpus) for k in cpus[0]}
                roles = ("parents", "children", "backends", "redis")
                rows.append([
                    f"{d['processes']}, {side}", *(f"{med[f'{r}_cores']:.2f}" for r in roles),
                    *(f"{med[f'{r}_ms_per_stage']:.3f}" for r in roles),
                ])  # fmt: skip
        header = [
            "processes (c=2), side", "cores: worker parents", "pool children", "PG backends",
            "Redis", "CPU ms per stage: parents", "children", "backends", "Redis",
        ]  # fmt: skip
        lines += ["", *table(header, rows)]
    p = res.get("pickup")
    if p:
        rows = [
            [tag, *(f"{p[tag][k]:.2f} ms" for k in ("p50_ms", "p99_ms", "mean_ms"))]
            for tag in ("onceflow", "bare", "floor")
            if tag in p
        ]
        rows.append(["**onceflow / bare p50**", f"**{p['ratio_p50']['x']:.2f}x**", None, None])
        if "vs_floor_p50" in p:
            rows.append(
                ["**onceflow / floor p50**", f"**{p['vs_floor_p50']['x']:.2f}x**", None, None]
            )
        lines += ["", *table(["pickup, enqueue → body start (idle)", "p50", "p99", "mean"], rows)]
    return "\n".join(lines)


def _config(text: str) -> tuple[int, int]:
    """``"2x4"`` → 2 processes of concurrency 4."""
    processes, _, concurrency = text.strip().partition("x")
    return int(processes), int(concurrency)


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="300 requests, 2 rounds, fewer pickups"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="statements/commits/Redis per stage"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the pool children")
    parser.add_argument("--only", choices=("drain", "pickup", "breakdown", "profile"), default=None)
    parser.add_argument(
        "--pickup-parts",
        action="store_true",
        help="time the pickup's parts (probes: bench/pickup_probe.py)",
    )
    parser.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Procrastinate and PgQueuer beside the one-process drains (peers' venv)",
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the design's floor beside them: bare Celery running the claim and completion "
        "statements by hand (bench_stages.floor_noop)",
    )
    parser.add_argument(
        "--body-ms",
        type=float,
        default=0.0,
        help="each body waits this long (both Celery sides): an I/O-bound stand-in for "
        "scaling runs; the peers are left out",
    )
    parser.add_argument(
        "--configs",
        default="1x2,1x4,2x2,4x2",
        help="the drain configurations, processes x concurrency (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.body_ms:
        os.environ["ONCEFLOW_BENCH_BODY_MS"] = repr(args.body_ms)  # inherited by the workers
        args.peers = False
    if args.quick:
        cfg = {"n": 300, "rounds": 2, "pickups": 40, "warm": 5, "m": 200}
    else:
        cfg = {"n": 2_000, "rounds": 5, "pickups": 200, "warm": 10, "m": 1_000}
    configs = [_config(c) for c in args.configs.split(",")]
    admin = admin_url()
    redis_url = bench_redis_url(REDIS_DEFAULT)
    started = time.perf_counter()

    res: dict[str, Any] = {
        "command": "bench/drain_bench.py " + " ".join(argv or sys.argv[1:]),
        "config": cfg,
    }
    if args.only != "breakdown":
        with (
            tempfile.TemporaryDirectory(prefix="onceflow-drain-bench-") as tmp,
            bench_databases(admin, False) as (url, _),
        ):
            b = Drain(url, None, redis_url, Path("/nonexistent"), Path(tmp))
            try:
                res["machine"] = runtime_machine(b)
                res["machine"]["loadavg_start"] = loadavg()
                if args.only in (None, "drain"):
                    with (
                        Peers(admin, url, Path(tmp)) if args.peers else contextlib.nullcontext()
                    ) as peers:
                        if peers is not None:
                            res["machine"]["peers"] = peers.versions
                        res["drains"] = bench_drains(
                            b, cfg["n"], cfg["rounds"], configs, peers, args.floor
                        )
                if args.only in (None, "drain", "pickup"):
                    res["pickup"] = bench_pickup(
                        b, cfg["pickups"], cfg["warm"], parts=args.pickup_parts, floor=args.floor
                    )
                if args.profile or args.only == "profile":
                    spy = pyspy_path()
                    if spy is None:
                        log("no py-spy: profile skipped")
                    else:
                        res["profile"] = [
                            profile(b, k, cfg["n"] * 2, 4.0, spy)
                            for k in ("onceflow", "floor", "bare")
                            if k != "floor" or args.floor
                        ]
            finally:
                b.stop_all()
                b.cleanup()
    if args.breakdown or args.only == "breakdown":
        res["breakdown"] = bench_breakdown(cfg["m"])
    res["loadavg_end"] = loadavg()
    res["wall_seconds"] = time.perf_counter() - started
    if args.json or "drains" not in res:
        print(json.dumps(res, indent=2, default=str))
    else:
        print(render(res))
        print(
            "\n<!-- raw -->\n"
            + json.dumps({k: v for k, v in res.items() if k != "machine"}, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
