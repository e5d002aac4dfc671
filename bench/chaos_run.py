"""One chaos scenario: a fresh database, real workers and beat, paced clients, one fault.

:func:`run_scenario` drains a mixed workload (see :func:`workload`) while its scenario's fault
runs, waits (with a deadline) until every request it expects has succeeded, stops everything,
and hands what it observed to :mod:`bench.chaos_checks`.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import psycopg
import redis as redis_lib

from bench import chaos_stages
from bench.chaos_cluster import Cluster
from bench.harness import ROOT, libpq
from onceflow.demo.procs import Proc, wait_for
from onceflow.demo.standins import StandIn
from onceflow.errors import InvalidRequest, OnceflowError
from onceflow.ids import request_id_for
from onceflow.keys import queue_name
from onceflow.oplog import OpLog
from onceflow.oplog.store import new_op_id
from onceflow.settings import Settings

APP = "bench.chaos_stages:flow"
WS = chaos_stages.WORKSPACE
LLM_LATENCY = 0.1
SWEEP_INTERVAL = 1.0
REDISPATCH_AFTER = 10.0
CLIENTS = 4


@dataclass(frozen=True)
class Sizes:
    """How big and how long a run is."""

    requests: int = 3000
    enqueue_seconds: float = 40.0
    fault_at: float = 10.0
    settle: float = 90.0

    @classmethod
    def quick(cls, requests: int | None = None) -> Sizes:
        """The CI size: a few hundred requests."""
        return cls(requests=requests or 300, enqueue_seconds=10.0, fault_at=3.0, settle=45.0)


@dataclass
class Item:
    """One enqueue (or client op) a client makes at ``at`` seconds into the run."""

    at: float
    client: int
    stage: str
    job: str
    branch: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Call(NamedTuple):
    """One paid provider call, as the stand-in saw it."""

    key: str  # the cell (``job/column``)
    start: float  # monotonic, when the stand-in began answering (after the request arrived)
    end: float
    pid: int | None  # the calling worker process (``pid=`` on the prompt's first line)


class CountingLLM(StandIn):
    """The demo's counting LLM stand-in, also keeping each call's cell, time span and caller."""

    def __init__(self, **kw: Any) -> None:
        super().__init__("llm", **kw)
        self.calls: list[Call] = []

    @staticmethod
    def caller(key: str) -> tuple[str, int | None]:
        """The cell and the caller's pid of a prompt's key (``job/column pid=N``)."""
        cell, _, pid = key.partition(f" {chaos_stages.CALLER}")
        return cell, int(pid) if pid.isdigit() else None

    def count(self, key: str) -> None:
        super().count(self.caller(key)[0])

    @contextlib.contextmanager
    def in_flight(self, key: str) -> Any:
        start = time.monotonic()
        cell, pid = self.caller(key)
        with super().in_flight(cell):
            try:
                yield
            finally:
                call = Call(cell, start, time.monotonic(), pid)
                with self._lock:
                    self.calls.append(call)

    def spans(self) -> list[Call]:
        """Every call answered or abandoned so far."""
        with self._lock:
            return list(self.calls)


def workload(requests: int, seconds: float, lease: float, seed: int = 11) -> list[Item]:
    """The mixed drain: ~40 % no-ops (each asked for by two clients), 32 % compute_once cells
    (each cell asked for by 4 clients on their own branches), 15 % op writes, 10 % hand-offs
    (each adds its target), a few long heartbeating stages (2 leases long), and client ops."""
    rng = random.Random(seed)
    items: list[Item] = []

    def at() -> float:
        return rng.uniform(0, seconds)

    for i in range(max(1, round(requests * 0.40))):
        t, c = at(), rng.randrange(CLIENTS)
        for k in (c, (c + 1) % CLIENTS):  # two clients ask for the same no-op: one row
            items.append(Item(t + rng.uniform(0, 0.05), k, "noop", f"nj{i}", data={"tag": str(i)}))
    for i in range(max(1, round(requests * 0.32 / CLIENTS))):
        t = at()
        for k in range(CLIENTS):  # one cell, 4 clients, 4 rows, one paid call
            data = {"column": f"col{i % 4}"}
            items.append(Item(t + rng.uniform(0, 0.05), k, "cell", f"cj{i}", f"b{k}", data))
    for i in range(max(1, round(requests * 0.15))):
        items.append(Item(at(), rng.randrange(CLIENTS), "ops", f"oj{i}",
                          data={"group": f"g{i % 25}", "writes": 2}))  # fmt: skip
    for i in range(max(1, round(requests * 0.10))):
        items.append(Item(at(), rng.randrange(CLIENTS), "handoff", f"hj{i}", data={"origin": "c"}))
    for i in range(max(2, round(requests * 0.005))):
        items.append(Item(at() * 0.8, rng.randrange(CLIENTS), "long", f"lj{i}",
                          data={"seconds": 2 * lease}))  # fmt: skip
    for i in range(max(4, round(requests * 0.05))):
        items.append(Item(at(), i % CLIENTS, "client_op", f"client:{i % CLIENTS}", data={"n": i}))
    return sorted(items, key=lambda it: it.at)


@dataclass
class Scenario:
    """A named fault, run at ``Sizes.fault_at`` during the drain."""

    name: str
    title: str
    fault: Callable[[Run], None] | None = None
    #: Helpers running for the whole drain (a second sweeper, a foreign one).
    during: Callable[[Run], None] | None = None
    worker_env: dict[str, str] = field(default_factory=dict)
    lease: float = 3.0
    #: The fault can outlast a lease: a re-run after a lost lease is expected, not a bug.
    lease_loss_expected: bool = False


class Run:
    """Everything one scenario run shares between its threads."""

    def __init__(self, cluster: Cluster, scenario: Scenario, sizes: Sizes, work: Path) -> None:
        self.cluster = cluster
        self.scenario = scenario
        self.sizes = sizes
        self.work = work
        self.db = f"chaos_{scenario.name}"
        self.ledger = work / "ledger"
        self.ledger.mkdir(parents=True, exist_ok=True)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.fault_start: float | None = None
        self.fault_end: float | None = None
        self.fault_end_db: datetime | None = None
        #: (monotonic time, pids killed) of every kill -9 of a worker.
        self.kills: list[tuple[float, set[int]]] = []
        #: Instants (Redis loss) and windows (partition) that may explain a re-paid call; a
        #: kill explains the calls of the processes it killed (``kills``).
        self.explaining: list[tuple[float, float]] = []
        self.notes: list[str] = []
        self.expected: set[str] = set()
        self.handoff_sources: dict[str, str] = {}  # request id -> job
        self.client_ok: list[tuple[int, float]] = []
        self.client_err: list[tuple[int, float, str]] = []
        self.client_ops: dict[str, str] = {}  # counter key -> sub-doc, acknowledged
        self.client_failed: list[str] = []
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.workers: dict[str, Proc] = {}
        self.beat: Proc | None = None
        self.beat_stopped = False  # stopped on purpose: the supervisor leaves it down
        self.restarts = 0  # processes the supervisor restarted after they exited
        self.proc_lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.api_key = secrets.token_urlsafe(16)
        self.llm = CountingLLM(latency=LLM_LATENCY, api_key=self.api_key)
        self.env = {
            "ONCEFLOW_DATABASE_URL": cluster.proxied_url(self.db),
            "ONCEFLOW_REDIS_URL": cluster.redis_url,
            "ONCEFLOW_APP": APP,
            "ONCEFLOW_SWEEP_INTERVAL_SECONDS": str(SWEEP_INTERVAL),
            "ONCEFLOW_REDISPATCH_AFTER_SECONDS": str(REDISPATCH_AFTER),
            "ONCEFLOW_LOCK_TTL_SECONDS": "5",
            "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
            "ONCEFLOW_BACKOFF_MAX_SECONDS": "2",
            "ONCEFLOW_LLM_API_KEY": self.api_key,
            "ONCEFLOW_DEMO_LLM_URLS": "",  # set once the stand-in listens
            "CHAOS_LEDGER_DIR": str(self.ledger),
            "CHAOS_LEASE_SECONDS": str(scenario.lease),
            "PYTHONPATH": str(ROOT),
        }
        self.settings = Settings(
            database_url=self.env["ONCEFLOW_DATABASE_URL"],
            redis_url=cluster.redis_url,
            sweep_interval_seconds=SWEEP_INTERVAL,
            redispatch_after_seconds=REDISPATCH_AFTER,
        )
        self.flow = chaos_stages.build_flow(self.settings)

    def now(self) -> float:
        """Seconds since the drain started."""
        return time.monotonic() - self.t0

    def note(self, text: str) -> None:
        """A line for the report (and the progress log)."""
        with self.lock:
            self.notes.append(text)
        print(f"    [{self.now():6.1f}s] {text}", flush=True)

    # ------------------------------------------------------------------ processes

    def start_worker(self, wc: str, name: str, env: dict[str, str] | None = None) -> Proc:
        """A real `onceflow worker` for ``wc`` (fast: concurrency 2, llm: 4)."""
        conc = "2" if wc == chaos_stages.FAST else "4"
        args = ["worker", "--app", APP, "--worker-class", wc, "--concurrency", conc,
                "-n", f"{name}-{os.getpid()}@%h"]  # fmt: skip
        env = {**self.env, **self.scenario.worker_env, **(env or {})}
        return self.cluster.start(args, self.work / f"worker-{name}.log", env)

    def start_beat(self, name: str = "beat") -> Proc:
        """A real `onceflow beat`."""
        return self.cluster.start(["beat", "--app", APP], self.work / f"{name}.log", self.env)

    def kill_worker(self, wc: str, *, when_llm_busy: bool = True) -> None:
        """``kill -9`` the worker of ``wc`` (its whole group), mid provider call if one comes
        within 10 s; start a replacement with the same environment."""
        if when_llm_busy:
            with contextlib.suppress(AssertionError):
                wait_for(lambda: self.llm.inflight() > 0, timeout=10, interval=0.005)
        with self.proc_lock:
            self._kill_and_replace(wc)

    def _kill_and_replace(self, wc: str) -> None:
        proc = self.workers[wc]
        pids = {proc.pid}
        with contextlib.suppress(psutil.Error):
            pids |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        t = time.monotonic()
        inflight = self.llm.inflight()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.popen.wait(timeout=10)
        with self.lock:
            self.kills.append((t, pids))
        if self.fault_end is None:
            self.end_fault()  # the fault is the kill; recovery counts from here
        self.note(f"kill -9 of the {wc} worker ({len(pids)} processes), {inflight} calls in flight")
        replacement = self.start_worker(wc, f"{wc}-r{len(self.kills)}")
        replacement.wait_log(" ready.", timeout=60)
        self.workers[wc] = replacement

    def begin_fault(self) -> None:
        """Mark the fault's start."""
        self.fault_start = time.monotonic()

    def end_fault(self) -> None:
        """Mark the fault's end (monotonic, and the database's clock for the drain check)."""
        self.fault_end = time.monotonic()
        with contextlib.suppress(Exception), self.admin() as conn:
            row = conn.execute("SELECT now()").fetchone()
            self.fault_end_db = row[0] if row else None

    def admin(self) -> psycopg.Connection[Any]:
        """A direct connection to the scenario's database (never through the proxy).

        Retried for a few seconds: a backend-kill round can hit it while it is still starting
        (before its application name shows), and a crash restart refuses it for a moment.
        """
        for attempt in range(30):
            try:
                return psycopg.connect(
                    libpq(self.cluster.direct_url(self.db)),
                    autocommit=True,
                    connect_timeout=3,
                    application_name="chaos-harness",
                )
            except psycopg.OperationalError:
                if attempt == 29:
                    raise
                time.sleep(0.2)
        raise AssertionError("unreachable")

    def sleep(self, seconds: float) -> None:
        """Sleep unless the run is being stopped."""
        self.stop.wait(seconds)


# --------------------------------------------------------------------------- threads


def _client(run: Run, index: int, items: list[Item], deadline: float) -> None:
    oplog = OpLog(run.flow.queue.engine, run.settings)
    for item in items:
        delay = run.t0 + item.at - time.monotonic()
        if delay > 0 and run.stop.wait(delay):
            return
        op_id = new_op_id()
        while not run.stop.is_set():
            try:
                if item.stage == "client_op":
                    key = f"c{index}-{item.data['n']}"
                    op = {"type": "chaos.count", "key": key}
                    oplog.apply_op(WS, item.job, op, op_id)
                    with run.lock:
                        run.client_ops[key] = item.job
                else:
                    res = run.flow.enqueue(item.stage, WS, item.job, item.branch, item.data)
                    with run.lock:
                        run.expected.add(res.request_id)
                        if item.stage == "handoff":
                            run.handoff_sources[res.request_id] = item.job
                with run.lock:
                    run.client_ok.append((index, time.monotonic()))
                break
            except InvalidRequest as exc:  # a refusal, not a blip: report it, go on
                run.note(f"client {index}: {item.stage}/{item.job} refused: {exc}")
                with run.lock:
                    run.client_failed.append(f"{item.stage}/{item.job}")
                break
            except (OnceflowError, OSError) as exc:
                with run.lock:
                    run.client_err.append((index, time.monotonic(), type(exc).__name__))
                if time.monotonic() > deadline:
                    with run.lock:
                        run.client_failed.append(f"{item.stage}/{item.job}")
                    break
                run.sleep(0.1)


def _supervisor(run: Run) -> None:
    """Restart a worker (or beat) that exited on its own, as systemd or Kubernetes would."""
    while not run.stop.wait(0.5):
        with run.proc_lock:
            for wc, proc in list(run.workers.items()):
                code = proc.popen.poll()
                if code is not None and not run.stop.is_set():
                    run.restarts += 1
                    run.note(f"the {wc} worker exited on its own (code {code}): restarted")
                    run.workers[wc] = run.start_worker(wc, f"{wc}-s{run.restarts}")
            beat = run.beat
            if beat is not None and not run.beat_stopped and beat.popen.poll() is not None:
                run.restarts += 1
                run.note(f"beat exited on its own (code {beat.popen.returncode}): restarted")
                run.beat = run.start_beat(f"beat-s{run.restarts}")


def _sampler(run: Run) -> None:
    conn: psycopg.Connection[Any] | None = None
    query = """
        SELECT count(*) FILTER (WHERE status = 'succeeded'),
               count(*) FILTER (WHERE status IN ('queued', 'running')),
               count(*) FILTER (WHERE status = 'dead'),
               CASE WHEN CAST(%s AS timestamptz) IS NULL THEN -1
                    ELSE count(*) FILTER (WHERE status <> 'succeeded'
                                          AND created_at <= CAST(%s AS timestamptz)) END
        FROM workspace_process_requests"""
    while not run.stop.wait(0.25):
        try:
            if conn is None or conn.closed:
                conn = run.admin()
            row = conn.execute(query, (run.fault_end_db,) * 2).fetchone()
        except psycopg.Error:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            conn = None
            continue
        if row is not None:
            with run.lock:
                run.samples.append((time.monotonic(), row[0], row[1], row[2], row[3]))
    if conn is not None:
        conn.close()


def expected_ids(run: Run) -> set[str]:
    """Every request the run must see succeed: what clients enqueued, and hand-off targets."""
    with run.lock:
        expected = set(run.expected)
        jobs = list(run.handoff_sources.values())
    return expected | {request_id_for(WS, job, "", "handoff_target") for job in jobs}


def _expected_done(run: Run) -> bool:
    want = expected_ids(run)
    try:
        with run.admin() as conn:
            rows = conn.execute(
                "SELECT count(*) FROM workspace_process_requests "
                "WHERE status = 'succeeded' AND request_id = ANY(%s)",
                (list(want),),
            ).fetchone()
    except psycopg.Error:
        return False
    return rows is not None and rows[0] == len(want)


def lose_wakeups(run: Run, backlog_seconds: float = 2.0) -> None:
    """Pause the fast worker (SIGSTOP) so wake-ups pile up in the broker, delete the broker's
    queues, resume it: those requests are queued in the table with no message to wake them."""
    proc = run.workers[chaos_stages.FAST]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGSTOP)
    try:
        run.sleep(backlog_seconds)
        client = redis_lib.Redis.from_url(run.cluster.redis_url, socket_timeout=5)
        try:
            n = client.llen(queue_name(chaos_stages.FAST)) + client.llen(
                queue_name(chaos_stages.LLM)
            )
            client.delete(chaos_stages.FAST, chaos_stages.LLM)
        finally:
            client.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
    run.note(f"broker queues purged after a {backlog_seconds:.0f}s pause: {n} wake-ups lost")


# --------------------------------------------------------------------------- the run


def run_scenario(cluster: Cluster, scenario: Scenario, sizes: Sizes, work: Path) -> Run:
    """Run ``scenario`` end to end; returns the :class:`Run` with everything it observed."""
    work.mkdir(parents=True, exist_ok=True)
    run = Run(cluster, scenario, sizes, work)
    cluster.fresh_database(run.db)
    cluster.flush_redis()
    cluster.proxy.heal()
    run.llm.start()
    run.env["ONCEFLOW_DEMO_LLM_URLS"] = run.llm.url
    os.environ["ONCEFLOW_DEMO_LLM_URLS"] = run.llm.url  # nothing in the harness calls it
    try:
        run.workers = {
            chaos_stages.FAST: run.start_worker(chaos_stages.FAST, "fast"),
            chaos_stages.LLM: run.start_worker(chaos_stages.LLM, "llm"),
        }
        run.beat = run.start_beat()
        for proc in run.workers.values():
            proc.wait_log(" ready.", timeout=90)
        run.beat.wait_log("beat: Starting", timeout=60)
        _drain(run)
    finally:
        run.stop.set()
        for t in run.threads:
            t.join(timeout=30)
        cluster.proxy.heal()
        cluster.stop_procs()
        run.llm.stop()
        run.flow.app.close()
        with contextlib.suppress(Exception):
            run.flow.queue.engine.dispose()
    return run


def _drain(run: Run) -> None:
    sizes = run.sizes
    items = workload(sizes.requests, sizes.enqueue_seconds, run.scenario.lease)
    per_client: dict[int, list[Item]] = defaultdict(list)
    for item in items:
        per_client[item.client].append(item)
    client_deadline = time.monotonic() + sizes.enqueue_seconds + sizes.settle
    run.t0 = time.monotonic()

    def spawn(target: Callable[..., None], *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        run.threads.append(t)
        return t

    spawn(_sampler, run)
    spawn(_supervisor, run)
    clients = [spawn(_client, run, i, per_client[i], client_deadline) for i in range(CLIENTS)]
    if run.scenario.during is not None:
        spawn(run.scenario.during, run)
    fault: threading.Thread | None = None
    if run.scenario.fault is not None:

        def fault_main() -> None:
            if run.stop.wait(sizes.fault_at):
                return
            try:
                run.scenario.fault(run)  # type: ignore[misc]
            except Exception as exc:  # the fault failing is a finding, not a crash
                run.note(f"fault raised {type(exc).__name__}: {exc}")
                if run.fault_end is None:
                    run.end_fault()

        fault = spawn(fault_main)
    for t in clients:
        t.join(timeout=sizes.enqueue_seconds + sizes.settle + 60)
    if fault is not None:
        fault.join(timeout=sizes.settle + 120)
    run.note(f"clients done: {len(run.expected)} requests enqueued")
    end = max(run.fault_end or 0.0, time.monotonic())
    try:
        wait_for(
            lambda: _expected_done(run), timeout=end + sizes.settle - time.monotonic(),
            interval=0.5, what="every expected request succeeded",
        )  # fmt: skip
        run.note("every expected request succeeded")
    except AssertionError:
        run.note(f"deadline: not every request succeeded {sizes.settle:.0f}s after the fault")
    # Let in-flight Celery messages for finished rows settle before stopping (no waiting on
    # a condition here: this only lets the sampler record the tail).
    run.stop.wait(0.5)
