"""The cost headline as a benchmark: LLM calls per cell when K clients enqueue the same work.

    .venv/bin/python bench/cost_bench.py [--quick] [--plot docs/cost_bench.png] [--json]

J jobs x C columns, one LLM call per cell, measured at a counting stand-in LLM provider
(:class:`onceflow.demo.standins.StandIn`, a local HTTP server that counts every request per
cell, latency ``--latency``). K = 1, 4, 16, 64 clients (threads, released together by a
barrier) each enqueue every cell (each client in its own shuffled order). Sides:

* ``naive``: a plain Celery task per cell per client (K clients -> K tasks per cell);
* ``celery-once``: the same task with ``base=celery_once.QueueOnce`` (its Redis backend);
  a duplicate enqueue raises ``AlreadyQueued`` while the first is queued or running;
* ``celery-singleton``: the same task with ``base=celery_singleton.Singleton``; a
  duplicate enqueue returns the running task's id;
* ``onceflow``: the demo's Flow (``onceflow.demo.stages``), stage ``evaluate`` (one LLM
  call per column under ``ctx.compute_once``); each client calls ``flow.enqueue("evaluate",
  ws, job, "main", {columns})`` per job: same deterministic request id for every client;
* ``onceflow-branches``: the same, but each client on its own branch path (K requests per
  job): only the compute lock and the stored cell keep a cell to one call.

Every side runs on real Celery worker processes (two, prefork, ``--concurrency 4``) on the
Redis broker, all started the same way: ``celery -A <app> worker -Q <queues> -c 4 -P prefork
-l WARNING --without-gossip --without-mingle --without-heartbeat`` (events off, in the
app's config too); the shipped Celery settings (``onceflow.tasks.config.celery_config``:
late acks, requeue on worker loss, prefetch 1) with a broker visibility timeout of
``VISIBILITY`` s for every side. The onceflow side also runs ``onceflow beat`` (the
sweeper, every 0.5 s), lease 4 s (the demo's), lock TTL 5 s.

Each (side, K) runs twice: without a fault, and with one ``kill -9`` of one of the two
worker processes (its whole process group) once 30 % of the expected calls reached the
stand-in; the run then continues with the one worker left until every accepted enqueue
finished (or ``--deadline`` s passed: then the row says so).

The two peers run from a venv of their own (``COST_PEER_VENV``, default
``/tmp/onceflow-bench-cost``), created if missing (``python -m venv`` then ``pip install
--no-deps celery_once celery-singleton``: they only need Celery and redis-py, which come
from this venv, so every side runs the same Celery). A peer that cannot be installed or
imported becomes a row with the reason.

Postgres: ``ONCEFLOW_BENCH_DATABASE_URL`` (admin URL; a fresh database is created and
dropped). Redis: ``ONCEFLOW_BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/13``); the
run deletes its own keys at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ROOT, Proc, admin_url, bench_redis_url, command_line, log, wait_for

REDIS_DEFAULT = "redis://127.0.0.1:6379/13"
PEER_VENV_DEFAULT = "/tmp/onceflow-bench-cost"  # noqa: S108 - a scratch virtualenv
VISIBILITY = 10.0
CONCURRENCY = 4
KILL_AT = 0.3
COLUMNS = ["fit", "pay", "remote", "growth", "stack", "team", "mission", "location"]
SIDES = ["naive", "celery-once", "celery-singleton", "onceflow", "onceflow-branches"]
CELERY_SIDE = {"naive": "naive", "celery-once": "once", "celery-singleton": "singleton"}


# ----------------------------------------------------------------------------- peer venv


def peer_site(venv: Path) -> tuple[str | None, str]:
    """The peer venv's site-packages (created and filled if missing), or (None, reason)."""
    py = venv / "bin" / "python"
    try:
        if not py.exists():
            log(f"creating the peers' venv {venv}")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                           capture_output=True, timeout=300)  # fmt: skip
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout.strip()  # fmt: skip
        # Installed without their dependencies (Celery, redis-py come from this venv), so
        # they are checked by pip, not imported by the venv's own python.
        ok = subprocess.run([str(py), "-m", "pip", "show", "-q", "celery_once", "celery-singleton"],
                            capture_output=True, timeout=60)  # fmt: skip
        if ok.returncode != 0:
            log("installing celery_once and celery-singleton into it (--no-deps)")
            out = subprocess.run(
                [str(py), "-m", "pip", "install", "-q", "--no-deps", "celery_once",
                 "celery-singleton"], capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if out.returncode != 0:
                return None, "pip install failed: " + out.stderr.strip().splitlines()[-1]
        return site, ""
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot make the peers' venv: {exc}"


# ------------------------------------------------------------------------------ workers


class Worker(Proc):
    """One `celery worker` process (its own process group), logging to a file."""

    def __init__(self, app: str, queues: list[str], tag: str, env: dict[str, str],
                 log_dir: Path) -> None:  # fmt: skip
        self.tag = tag
        args = [sys.executable, "-m", "celery", "-A", app, "worker", "-Q", ",".join(queues),
                "-c", str(CONCURRENCY), "-P", "prefork", "-l", "WARNING", "--without-gossip",
                "--without-mingle", "--without-heartbeat", "-n", f"{tag}@%h"]  # fmt: skip
        env = {**os.environ, **env, "COST_WORKER_TAG": tag}
        super().__init__(f"worker-{tag}", args, log_dir, env)

    def kill9(self) -> None:
        os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


# ---------------------------------------------------------------------------------- runs


@dataclass
class Row:
    side: str
    k: int
    kill: bool
    cells: int
    calls: int = 0
    calls_per_cell: float = 0.0
    max_per_cell: int = 0
    cells_done: int = 0
    enqueued: int = 0
    accepted: int = 0
    finished: int = 0
    wall: float = 0.0
    killed_at_calls: int | None = None
    complete: bool = True
    note: str = ""
    per_cell: dict[str, int] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.tag = secrets.token_hex(3)
        self.keys = f"onceflow-cost-{self.tag}"
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        self.jobs = [f"job-{j}" for j in range(args.jobs)]
        self.n_runs = 0
        self.beat: Any = None
        self.columns = COLUMNS[: args.columns]
        self.workers: list[Worker] = []
        self.n_workers = 0

    # -- environment
    def setup(self) -> None:
        from sqlalchemy import make_url

        from onceflow.demo.standins import StandIn

        self.api_key = secrets.token_urlsafe(16)
        self.llm = StandIn("llm", latency=self.args.latency, api_key=self.api_key).start()
        self.stack.callback(self.llm.stop)
        self.redis_url = bench_redis_url(REDIS_DEFAULT)
        admin = admin_url()
        # Settings every process reads (the driver too: it enqueues).
        self.env = {
            "ONCEFLOW_REDIS_URL": self.redis_url,
            "ONCEFLOW_BROKER_URL": self.redis_url,
            "ONCEFLOW_DEMO_RUN": self.tag,  # the demo's broker keys carry this prefix
            "ONCEFLOW_LLM_API_KEY": self.api_key,
            "ONCEFLOW_DEMO_LLM_URLS": self.llm.url,
            "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.5",
            "ONCEFLOW_REDISPATCH_AFTER_SECONDS": "10",
            "ONCEFLOW_LOCK_TTL_SECONDS": "3",
            "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
            "ONCEFLOW_BROKER_VISIBILITY_TIMEOUT_SECONDS": str(VISIBILITY),
            "ONCEFLOW_MAX_RUNTIME_SECONDS": "4",
            "COST_KEYS": self.keys,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), self.peer or "", os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        os.environ.update(self.env)
        if self.peer:
            sys.path.append(self.peer)
        from onceflow.demo.scenario import fresh_database
        from onceflow.settings import get_settings

        get_settings.cache_clear()
        self.db_url = self.stack.enter_context(fresh_database(admin))
        os.environ["ONCEFLOW_DATABASE_URL"] = self.env["ONCEFLOW_DATABASE_URL"] = self.db_url
        get_settings.cache_clear()
        log(f"database {make_url(self.db_url).database}, Redis {self.redis_url}")
        import redis

        self.r = redis.Redis.from_url(self.redis_url)
        self.stack.callback(self.cleanup_redis)

    def cleanup_redis(self) -> None:
        from onceflow.keys import PREFIX

        removed = 0
        for pattern in (f"{self.keys}*", f"onceflow-demo-{self.tag}:*",
                        f"{PREFIX}:{{cost-{self.tag}*", f"qo_cost.once_*{self.tag}*"):  # fmt: skip
            batch = list(self.r.scan_iter(match=pattern, count=1000))
            if batch:
                removed += int(self.r.delete(*batch))
        log(f"removed this run's {removed} Redis keys")

    # -- workers
    def start_workers(self, side: str, n: int) -> None:
        import bench.cost_stages as cs

        if side.startswith("onceflow"):
            app, queues = "bench.cost_stages:flow_app", cs.flow.broker_queues(["llm"])
        else:
            app, queues = "bench.cost_stages:capp", [cs.QUEUES[CELERY_SIDE[side]]]
        new = []
        for _ in range(n):
            self.n_workers += 1
            tag = f"cost-{self.tag}-{side}-{self.n_workers}"
            new.append(Worker(app, queues, tag, self.env, self.log_dir))
        for w in new:

            def ready(w: Worker = w) -> bool:
                if w.popen.poll() is not None:
                    raise RuntimeError(f"{w.tag} exited: {w.log_path.read_text()[-2000:]}")
                return bool(self.r.get(f"{self.keys}:ready:{w.tag}"))

            wait_for(ready, 60, f"worker {w.tag} ready")
        self.workers += new

    def stop_workers(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
        if self.beat is not None:
            self.beat.stop()
            self.beat = None

    def start_beat(self) -> None:
        """onceflow's sweeper (beat, every 0.5 s): it rescues a killed worker's requests."""
        from onceflow.demo.procs import Proc

        beat_log = self.log_dir / f"beat-{self.n_runs}.log"
        self.beat = Proc(["beat", "--app", "bench.cost_stages:flow"], beat_log, env=self.env,
                         cwd=ROOT)  # fmt: skip
        self.beat.wait_log("beat: Starting")

    # -- one run
    def calls(self, suffix: str) -> dict[str, int]:
        """This run's calls per cell (its job ids end with ``suffix``)."""
        per_key = self.llm.stats()["per_key"]
        return {k: n for k, n in per_key.items() if k.split("/", 1)[0].endswith(suffix)}

    def run(self, side: str, k: int, kill: bool) -> Row:
        self.n_runs += 1
        suffix = f"-r{self.n_runs}"
        run = f"{self.tag}{suffix}"
        jobs = [f"{j}{suffix}" for j in self.jobs]
        row = Row(side, k, kill, len(jobs) * len(self.columns))
        missing = 2 - len(self.workers)
        if missing:
            self.start_workers(side, missing)
        if side.startswith("onceflow") and self.beat is None:
            self.start_beat()
        expected = row.cells * (k if side == "naive" else 1)
        accepted = 0
        enqueued = 0
        lock = threading.Lock()
        barrier = threading.Barrier(k)
        errors: list[str] = []
        ws = f"cost-{run}"

        def client(n: int) -> None:
            nonlocal accepted, enqueued
            rng = random.Random(n)
            order = [(j, c) for j in jobs for c in self.columns]
            rng.shuffle(order)
            mine = list(jobs)
            rng.shuffle(mine)
            barrier.wait()
            try:
                if side.startswith("onceflow"):
                    from onceflow.demo.stages import flow

                    branch = "main" if side == "onceflow" else f"client-{n}"
                    for job in mine:
                        res = flow.enqueue("evaluate", ws, job, branch, {"columns": self.columns})
                        with lock:
                            enqueued += 1
                            accepted += int(res.created)
                    return
                import bench.cost_stages as cs

                task = getattr(cs, CELERY_SIDE[side])
                for job, column in order:
                    ok = self._send(side, task, run, job, column)
                    with lock:
                        enqueued += 1
                        accepted += int(ok)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(k)]
        for t in threads:
            t.start()
        if kill:
            target = max(1, int(KILL_AT * expected))
            try:
                wait_for(lambda: sum(self.calls(suffix).values()) >= target, 60,
                         "30 % of the calls", interval=0.005)  # fmt: skip
                row.killed_at_calls = sum(self.calls(suffix).values())
                self.workers.pop(0).kill9()
                log(f"  kill -9 of one worker at {row.killed_at_calls} calls")
            except TimeoutError:
                row.note = "the run ended before 30 % of the calls: no kill"
        for t in threads:
            t.join(timeout=120)
        row.enqueued, row.accepted = enqueued, accepted
        try:
            if side.startswith("onceflow"):
                wait_for(self._onceflow_drained, self.args.deadline, "onceflow drained", 0.1)
                row.finished = accepted
            else:
                key = f"{self.keys}:{run}:done"
                wait_for(lambda: int(self.r.get(key) or 0) >= accepted, self.args.deadline,
                         "every accepted task finished", 0.05)  # fmt: skip
                row.finished = int(self.r.get(key) or 0)
        except TimeoutError:
            row.complete = False
            self._dump_broker(run)
            if not side.startswith("onceflow"):
                row.finished = int(self.r.get(f"{self.keys}:{run}:done") or 0)
        row.wall = time.monotonic() - started

        # Late calls: in flight at the kill, or sent just before the end.
        def settled() -> bool:
            return not any(k.split("/", 1)[0].endswith(suffix) for k in self.llm.inflight_keys())

        wait_for(settled, 30, "no call in flight")
        row.per_cell = self.calls(suffix)
        row.calls = sum(row.per_cell.values())
        row.calls_per_cell = row.calls / row.cells
        row.max_per_cell = max(row.per_cell.values(), default=0)
        row.cells_done = self._cells_done(side, run, ws, jobs)
        if errors:
            row.note = (
                (row.note + "; " if row.note else "")
                + f"{len(errors)} client errors: "
                + errors[0][:200]
            )
        return row

    def _dump_broker(self, run: str) -> None:
        """Where the missing messages are: this run's broker keys and their sizes."""
        for key in self.r.scan_iter(match=f"{self.keys}*", count=1000):
            kind = self.r.type(key).decode()
            size = {"list": self.r.llen, "hash": self.r.hlen, "zset": self.r.zcard}.get(kind)
            log(f"    {key.decode()} {kind} {size(key) if size else ''}")
        for key in self.r.scan_iter(match=f"onceflow-demo-{self.tag}:*", count=1000):
            log(f"    {key.decode()} {self.r.type(key).decode()}")

    def _send(self, side: str, task: Any, run: str, job: str, column: str) -> bool:
        if side == "naive":
            task.apply_async((run, job, column))
            return True
        if side == "celery-once":
            from celery_once import AlreadyQueued

            try:
                task.apply_async((run, job, column))
            except AlreadyQueued:
                return False
            return True
        mine = str(uuid.uuid4())
        res = task.apply_async((run, job, column), task_id=mine)
        return bool(res.id == mine)

    def _onceflow_drained(self) -> bool:
        from onceflow.demo.stages import flow

        counts = flow.queue.counts()
        pending = sum(c["queued"] + c["running"] for c in counts.values())
        return pending == 0

    def _cells_done(self, side: str, run: str, ws: str, jobs: list[str]) -> int:
        if side.startswith("onceflow"):
            from onceflow.context import oplog_for
            from onceflow.demo.stages import flow, job_doc

            oplog = oplog_for(flow.queue)
            done = 0
            for job in jobs:
                cells = oplog.get_sub_doc(ws, job_doc(job)).state.get("cells", {})
                done += sum(c in cells for c in self.columns)
            return done
        return int(self.r.hlen(f"{self.keys}:{run}:cells"))


def main() -> None:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="K = 1, 4 only; J=2, C=3")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--columns", type=int, default=5)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--no-kill", action="store_true", help="only the runs without a fault")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the workers' logs here")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.columns, args.clients = 2, 3, "1,4"
    ks = [int(x) for x in args.clients.split(",")]
    sides = [s for s in args.sides.split(",") if s]
    t0 = time.monotonic()
    rows: list[Row] = []

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)  # unwind: workers stopped, database dropped, keys removed
    with contextlib.ExitStack() as stack:
        bench = Bench(args, stack)
        bench.peer = None
        peer_reason = ""
        if any(s in ("celery-once", "celery-singleton") for s in sides):
            bench.peer, peer_reason = peer_site(
                Path(os.environ.get("COST_PEER_VENV", PEER_VENV_DEFAULT))
            )
        bench.setup()
        stack.callback(bench.stop_workers)
        for side in sides:
            if side in ("celery-once", "celery-singleton"):
                reason = peer_reason or _peer_import_problem(side)
                if reason:
                    log(f"{side}: skipped: {reason}")
                    rows.append(Row(side, 0, False, 0, complete=False, note=reason))
                    continue
            for k in ks:
                for kill in [False] if args.no_kill else [False, True]:
                    log(f"{side} K={k}{' kill' if kill else ''}")
                    row = bench.run(side, k, kill)
                    log(
                        f"  {row.calls} calls ({row.calls_per_cell:.2f}/cell, "
                        f"max {row.max_per_cell}),"
                        f" cells done {row.cells_done}/{row.cells}, accepted {row.accepted}/"
                        f"{row.enqueued}, finished {row.finished}, {row.wall:.1f}s"
                        f"{'' if row.complete else ' INCOMPLETE'} {row.note}"
                    )
                    rows.append(row)
            bench.stop_workers()
    total = time.monotonic() - t0
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "celery": _version("celery"),
        "celery_once": _peer_version("celery_once", bench.peer),
        "celery_singleton": _peer_version("celery_singleton", bench.peer),
        "command": "python bench/cost_bench.py " + " ".join(sys.argv[1:]),
        "jobs": args.jobs, "columns": args.columns, "latency": args.latency,
        "seconds": round(total, 1),
    }  # fmt: skip
    if args.plot:
        plot(rows, ks, args.plot, meta)
    if args.json:
        print(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(report(rows, ks, meta))


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "n/a"


def _peer_version(dist: str, site: str | None) -> str:
    import importlib.metadata

    if site is None:
        return "n/a"
    for d in importlib.metadata.distributions(path=[site]):
        if d.metadata["Name"].replace("-", "_").lower() == dist:
            return d.version
    return "n/a"


def _peer_import_problem(side: str) -> str:
    try:
        import bench.cost_stages as cs
    except Exception as exc:
        return f"bench.cost_stages does not import: {exc}"
    if getattr(cs, CELERY_SIDE[side]) is None:
        return f"{side} does not import with Celery {_version('celery')}"
    return ""


def report(rows: list[Row], ks: list[int], meta: dict[str, Any]) -> str:
    lines = [
        f"{meta['date']}; {meta['machine']}; Celery {meta['celery']}, celery_once "
        f"{meta['celery_once']}, celery-singleton {meta['celery_singleton']}; "
        f"J={meta['jobs']} jobs x C={meta['columns']} columns, stand-in latency "
        f"{meta['latency'] * 1000:.0f} ms; whole run {meta['seconds']} s.",
        "",
        f"`{meta['command']}`",
        "",
        "LLM calls per cell at the stand-in (max for one cell in brackets), wall time "
        "from the clients' start to the last accepted enqueue finished:",
        "",
    ]
    head = "| side | kill -9 | " + " | ".join(f"K={k}" for k in ks) + " |"
    lines += [head, "|" + "---|" * (2 + len(ks))]
    seen: dict[tuple[str, bool], dict[int, Row]] = {}
    skipped = []
    for r in rows:
        if r.k == 0:
            skipped.append(r)
            continue
        seen.setdefault((r.side, r.kill), {})[r.k] = r
    for (side, kill), by_k in seen.items():
        cells = []
        for k in ks:
            r = by_k.get(k)
            if r is None:
                cells.append("-")
                continue
            text = f"{r.calls_per_cell:.2f} ({r.max_per_cell}), {r.wall:.1f} s"
            if r.cells_done < r.cells:
                text += f", **{r.cells - r.cells_done} cells lost**"
            if not r.complete:
                text += f", incomplete ({r.finished}/{r.accepted} done)"
            cells.append(text)
        lines.append(f"| {side} | {'yes' if kill else 'no'} | " + " | ".join(cells) + " |")
    for r in skipped:
        lines.append(f"| {r.side} | - | not run: {r.note} |")
    lines += ["", "Accepted enqueues (of J x C x K sent; onceflow: requests created):", ""]
    lines += [head, "|" + "---|" * (2 + len(ks))]
    for (side, kill), by_k in seen.items():
        vals = [f"{by_k[k].accepted}/{by_k[k].enqueued}" if k in by_k else "-" for k in ks]
        lines.append(f"| {side} | {'yes' if kill else 'no'} | " + " | ".join(vals) + " |")
    notes = [
        f"- {r.side} K={r.k}{' kill' if r.kill else ''}: {r.note}" for r in rows if r.note and r.k
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def plot(rows: list[Row], ks: list[int], path: Path, meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kill in zip(axes, (False, True), strict=True):
        for side in dict.fromkeys(r.side for r in rows if r.k):
            pts = sorted(
                (r.k, r.calls_per_cell) for r in rows if r.side == side and r.kill == kill and r.k
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=side)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("K clients enqueueing the same work")
        ax.set_title("one worker killed (kill -9) mid-run" if kill else "no fault")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("LLM calls per cell (at the provider)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"J={meta['jobs']} x C={meta['columns']} cells, {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot written to {path}")


if __name__ == "__main__":
    main()
