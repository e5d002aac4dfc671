"""Celery stage-runtime benchmark: onceflow's stage beside a bare Celery task and Procrastinate.

Superseded for the onceflow/Celery ratio by ``bench/drain_bench.py``: this script runs bare
Celery with onceflow's shipped flags, pools rounds and polls the sides differently. Kept for
its Procrastinate side and as the record of the earlier figures (docs/benchmarks.md, History).

    .venv/bin/python bench/runtime_bench.py [--quick] [--json] [--profile]

Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), used only as the admin
URL: the run creates its own database ``onceflow_bench_<random>`` (migrated with
``onceflow.migrate.migrate``) and one for Procrastinate,
``onceflow_bench_<random>_procrastinate``, and drops both ``WITH (FORCE)`` at the
end, also on error or Ctrl-C. The broker is ``ONCEFLOW_BENCH_REDIS_URL`` (default
``redis://127.0.0.1:6379/15``: a database number of its own, because every onceflow
worker also consumes the fixed maintenance queue ``onceflow``, and a worker on
another project's database would steal its sweeper messages). The queues are
named ``bench-rt-<random>``; the run deletes its own queues and keys at the end.

Procrastinate is not a dependency of onceflow. It runs from a separate virtualenv,
``ONCEFLOW_BENCH_PROCRASTINATE_VENV`` (default ``/tmp/procrastinate-venv``)::

    python3 -m venv /tmp/procrastinate-venv
    /tmp/procrastinate-venv/bin/pip install procrastinate psycopg-binary

Without it, the Procrastinate row is skipped.

Workers are real processes, each started as a user would start it, with
concurrency 2, at the default log level (INFO) of each tool:

* onceflow: ``python -m onceflow.cli worker --app bench.bench_stages:flow
  --worker-class <queue> --concurrency 2`` (Celery prefork, the shipped settings);
* bare Celery, the floor: the same command with ``--app bench.bench_stages:bare``,
  a plain Celery app with the same broker and the same shipped settings
  (``onceflow.tasks.config.celery_config``) and one no-op task ``bench.noop``;
* Procrastinate: ``procrastinate --app=bench_procrastinate.app worker
  --concurrency 2`` (one process, asyncio; the task is an ``async def`` no-op,
  Procrastinate's own fast path) on its own fresh database.

What is measured:

1. Drain rate. N requests are enqueued with the worker stopped (onceflow:
   ``flow.enqueue``, one call each; Celery: ``send_task``; Procrastinate:
   ``task.defer``), then the worker is started, and the run waits until the
   onceflow table's counts (or the Redis INCR counter of the bare task, or
   Procrastinate's job table) show all N finished. The rate is (N - 1) / (last
   finish - first finish): onceflow and Celery take ``time.time()`` in a
   ``task_postrun`` handler (one Redis INCR per task, on both), Procrastinate's
   are the ``succeeded`` rows of its ``procrastinate_events`` table (the
   Postgres clock). So worker start-up is outside the rate; the rate from worker
   launch to the poll seeing the last one is shown too, and the median time
   inside the task function as Celery logs it (``succeeded in …s``). Rounds
   are interleaved: onceflow, Celery, Procrastinate, then again.
2. Pickup latency on idle workers: enqueue -> the first line of the stage body,
   over sequential requests, onceflow and bare Celery alternating (both workers
   up and idle; each request waits for the previous one to finish, then 50 ms).
   The enqueuer takes ``time.time()`` just before ``flow.enqueue`` (so the
   latency includes the row's INSERT and commit, and the publish); the body
   takes ``time.time()`` first thing and pushes it to a Redis list. Both
   clocks are the same machine's CLOCK_REALTIME, so they compare directly.
   The first requests of each side are a warm-up (each pool child connects on
   its first task).

The machine line also gives the price of a durable commit here: a one-row
``INSERT`` in autocommit beside a ``SELECT 1``, interleaved, on a scratch table.

``--profile`` then drains N requests once more for onceflow and once for bare
Celery with ``py-spy record --idle --nonblocking`` (100 Hz; non-blocking, so the
worker is not paused and drains at about its unprofiled rate) attached to both
pool children (py-spy is in the dev venv; it needs ptrace), and reports where a child's main thread
spends its wall time per task: waiting for the pool's parent to hand it the
next message, Celery's task tracing, and, for onceflow, the claim, the
heartbeat thread's start and stop, the stage body and the completion.

Progress goes to stderr; the Markdown report (or ``--json``: the raw numbers)
to stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
import redis

from bench.harness import (
    ROOT,
    Proc,
    admin_url,
    bench_redis_url,
    command_header,
    command_line,
    finish,
    fresh_databases,
    latency_ms,
    libpq,
    loadavg,
    log,
    machine_info,
    median_or_none,
    ok,
    pct,
    per_round_ratios,
    psycopg_version,
    raw_connect,
    redis_version,
    stack_samples,
    table,
)

REDIS_DEFAULT = "redis://127.0.0.1:6379/15"
VENV_DEFAULT = "/tmp/procrastinate-venv"  # noqa: S108 - a virtualenv we only read
HELPER = "import bench_procrastinate as b; b.main()"
CONCURRENCY = 2
DRAIN_TARGET = 0.5
PICKUP_TARGET_MS = 10.0
IDLE_GAP = 0.05
BINDING_KEYS = ("binding", "binding_permanent")  # kombu's Redis routing tables of a queue

PROCRASTINATE_APP = '''\
"""Procrastinate's side of bench/runtime_bench.py (written by the bench into a temp dir)."""

import json
import os
import sys
import time

import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ["BENCH_PROCRASTINATE_DSN"])
)


@app.task(name="bench.noop", queue="bench")
async def noop(n: int = 0) -> None:
    return None


def main() -> None:
    import importlib.metadata

    cmd = sys.argv[1]
    if cmd == "version":
        print(importlib.metadata.version("procrastinate"))
        return
    with app.open():
        if cmd == "schema":
            app.schema_manager.apply_schema()
        elif cmd == "defer":
            n = int(sys.argv[2])
            t0 = time.perf_counter()
            for i in range(n):
                noop.defer(n=i)
            print(json.dumps({"seconds": time.perf_counter() - t0}))
'''


# ---------------------------------------------------------------------------- databases


@contextmanager
def bench_databases(admin: str, with_procrastinate: bool) -> Iterator[tuple[str, str | None]]:
    """A fresh migrated onceflow database (and an empty one for Procrastinate); both
    dropped WITH (FORCE) on the way out, whatever happens."""
    from onceflow.migrate import migrate

    name = f"onceflow_bench_{secrets.token_hex(4)}"
    names = [name] + ([f"{name}_procrastinate"] if with_procrastinate else [])
    with fresh_databases(admin, names) as urls:
        migrate(urls[0])
        yield urls[0], (urls[1] if with_procrastinate else None)


# ---------------------------------------------------------------------------- processes


class Bench:
    """Everything one run shares: databases, broker, names, the processes it started."""

    def __init__(self, url: str, purl: str | None, redis_url: str, venv: Path, logdir: Path):
        self.url = url
        self.purl = purl
        self.redis_url = redis_url
        self.venv = venv
        self.logdir = logdir
        tag = secrets.token_hex(3)
        self.queue = f"bench-rt-{tag}"
        self.keys = f"onceflow-bench-rt-{tag}"
        self.procs: list[Proc] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(logdir)]),
            "ONCEFLOW_DATABASE_URL": url,
            "ONCEFLOW_REDIS_URL": redis_url,
            "ONCEFLOW_BROKER_URL": redis_url,
            "ONCEFLOW_BENCH_QUEUE": self.queue,
            "ONCEFLOW_BENCH_KEYS": self.keys,
            "BENCH_PROCRASTINATE_DSN": libpq(purl) if purl else "",
        }
        # The enqueuing side (this process) reads the same settings as the workers.
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("ONCEFLOW_")})
        from onceflow.settings import get_settings

        get_settings.cache_clear()
        sys.path.insert(0, str(ROOT))
        from bench import bench_stages
        from onceflow.keys import queue_name

        self.stages = bench_stages
        #: Where bare Celery tasks go: the broker queue of the worker class the bare side's
        #: ``onceflow worker --worker-class`` consumes (``onceflow.wc.<class>``).
        self.bare_queue = queue_name(bench_stages.BARE_QUEUE)
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=60)
        self._poll: psycopg.Connection[Any] | None = None

    # -- processes

    def start(self, name: str, argv: list[str], total: int = 0) -> Proc:
        env = {**self.env, "ONCEFLOW_BENCH_TOTAL": str(total)}
        proc = Proc(name, argv, self.logdir, env)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        while self.procs:
            self.stop(self.procs[-1])

    def celery_worker(self, kind: str, total: int = 0) -> Proc:
        app = "bench.bench_stages:flow" if kind == "onceflow" else "bench.bench_stages:bare"
        queue = self.queue if kind == "onceflow" else self.stages.BARE_QUEUE
        argv = [
            sys.executable, "-m", "onceflow.cli", "worker", "--app", app,
            "--worker-class", queue, "--concurrency", str(CONCURRENCY),
            "-n", f"{kind}-{self.queue}@%h",
        ]  # fmt: skip
        return self.start(f"worker-{kind}", argv, total)

    def procrastinate(self, *args: str) -> str:
        out = subprocess.run(
            [str(self.venv / "bin" / "python"), "-c", HELPER, *args],
            cwd=self.logdir,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        return out.stdout.strip()

    # -- state

    def reset(self) -> None:
        """Empty the onceflow table, this run's queues and this run's counters."""
        with raw_connect(self.url) as conn:
            conn.execute("TRUNCATE workspace_process_requests")
            conn.execute("VACUUM ANALYZE workspace_process_requests")
        self.redis.delete(self.queue, self.stages.BARE_QUEUE, self.bare_queue)
        for key in self.redis.scan_iter(f"{self.keys}:*"):
            self.redis.delete(key)

    def cleanup(self) -> None:
        """At the very end: this run's queues, their kombu bindings and this run's keys.
        (Never between phases: a publisher that has declared a queue does not declare it
        again, and kombu drops a message whose binding is gone.)"""
        if self._poll is not None:
            self._poll.close()
        with contextlib.suppress(redis.RedisError):
            queues = [self.queue, self.stages.BARE_QUEUE, self.bare_queue]
            bindings = [f"_kombu.{kind}.{q}" for q in queues for kind in BINDING_KEYS]
            self.redis.delete(*queues, *bindings)
            for key in self.redis.scan_iter(f"{self.keys}:*"):
                self.redis.delete(key)

    def onceflow_counts(self) -> dict[str, int]:
        if self._poll is None or self._poll.closed:
            self._poll = raw_connect(self.url)  # one connection for all the polling
        rows = self._poll.execute(
            "SELECT status, count(*) FROM workspace_process_requests GROUP BY status"
        ).fetchall()
        return {str(s): int(c) for s, c in rows}

    def redis_time(self, what: str, tag: str, timeout: float = 10.0) -> float:
        """The time a task_postrun handler stored (it may land just after the poll saw the
        last row finished: the handler runs after the task returns)."""
        deadline = time.monotonic() + timeout
        while (value := self.redis.get(f"{self.keys}:{what}:{tag}")) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} time recorded for {tag}")
            time.sleep(0.01)
        return float(value)


# ---------------------------------------------------------------------------- 1. drain


def _wait(
    proc: Proc, done: Callable[[], bool], timeout: float, what: str, interval: float = 0.1
) -> float:
    """Poll ``done`` until true; the time.time() at which it first was."""
    deadline = time.monotonic() + timeout
    while not done():
        proc.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not drained after {timeout}s (see {proc.log_path})")
        time.sleep(interval)
    return time.time()


def _task_ms(proc: Proc) -> float | None:
    """Median of the run times Celery logs per task ("succeeded in 0.0123s")."""
    times = [float(x) for x in re.findall(r"succeeded in ([0-9.e-]+)s", proc.log())]
    return statistics.median(times) * 1e3 if times else None


def drain_onceflow(b: Bench, n: int, rnd: int, timeout: float) -> dict[str, Any]:
    b.reset()
    flow = b.stages.flow
    t0 = time.perf_counter()
    for i in range(n):
        flow.enqueue("bench_noop", "bench", f"r{rnd}-{i}", input={"n": i})
    enqueue_s = time.perf_counter() - t0
    assert b.onceflow_counts() == {"queued": n}
    proc = b.celery_worker("onceflow", total=n)
    try:
        seen = _wait(
            proc, lambda: b.onceflow_counts().get("succeeded", 0) >= n, timeout, "onceflow"
        )
        counts = b.onceflow_counts()
        first, last = b.redis_time("first", "onceflow"), b.redis_time("last", "onceflow")
    finally:
        b.stop(proc)
    if counts != {"succeeded": n}:
        raise RuntimeError(f"onceflow drain ended with {counts}")
    return _drain_result(n, enqueue_s, first, last, proc.launched, seen, _task_ms(proc))


def drain_celery(b: Bench, n: int, rnd: int, timeout: float) -> dict[str, Any]:
    b.reset()
    bare = b.stages.bare
    t0 = time.perf_counter()
    for i in range(n):
        bare.send_task("bench.noop", args=[i], queue=b.bare_queue)
    enqueue_s = time.perf_counter() - t0
    assert b.redis.llen(b.bare_queue) == n
    proc = b.celery_worker("bare", total=n)
    key = f"{b.keys}:done:bare"
    try:
        seen = _wait(proc, lambda: int(b.redis.get(key) or 0) >= n, timeout, "bare Celery")
        first, last = b.redis_time("first", "bare"), b.redis_time("last", "bare")
        time.sleep(0.2)
        done = int(b.redis.get(key) or 0)
    finally:
        b.stop(proc)
    if done != n:
        raise RuntimeError(f"bare Celery ran {done} tasks for {n} messages")
    return _drain_result(n, enqueue_s, first, last, proc.launched, seen, _task_ms(proc))


def _procrastinate_counts(purl: str) -> dict[str, int]:
    with raw_connect(purl) as conn:
        rows = conn.execute(
            "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY 1"
        ).fetchall()
    return {str(s): int(c) for s, c in rows}


def drain_procrastinate(b: Bench, n: int, rnd: int, timeout: float) -> dict[str, Any]:
    assert b.purl is not None
    with raw_connect(b.purl) as conn:
        conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        conn.execute("VACUUM ANALYZE procrastinate_jobs")
    enqueue_s = json.loads(b.procrastinate("defer", str(n)))["seconds"]
    assert _procrastinate_counts(b.purl) == {"todo": n}
    argv = [
        str(b.venv / "bin" / "procrastinate"), "--app=bench_procrastinate.app", "worker",
        "--concurrency", str(CONCURRENCY), "--queues", "bench",
    ]  # fmt: skip
    proc = b.start("worker-procrastinate", argv)
    try:
        seen = _wait(
            proc,
            lambda: _procrastinate_counts(b.purl or "").get("succeeded", 0) >= n,
            timeout,
            "Procrastinate",
        )
    finally:
        b.stop(proc)
    counts = _procrastinate_counts(b.purl)
    if counts != {"succeeded": n}:
        raise RuntimeError(f"Procrastinate drain ended with {counts}")
    with raw_connect(b.purl) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM min(at)), extract(epoch FROM max(at)) "
            "FROM procrastinate_events WHERE type = 'succeeded'"
        ).fetchone()
    assert row is not None
    return _drain_result(n, enqueue_s, float(row[0]), float(row[1]), proc.launched, seen)


def _drain_result(
    n: int,
    enqueue_s: float,
    first: float,
    last: float,
    launched: float,
    seen: float,
    task_ms: float | None = None,
) -> dict[str, Any]:
    return {
        "task_ms_median": task_ms,
        "n": n,
        "enqueue_per_s": n / enqueue_s,
        "window_s": last - first,
        "per_s": (n - 1) / (last - first),
        "from_launch_s": seen - launched,
        "from_launch_per_s": n / (seen - launched),
    }


def bench_drain(b: Bench, n: int, rounds: int, timeout: float) -> dict[str, Any]:
    sides: dict[str, Callable[[Bench, int, int, float], dict[str, Any]]] = {
        "onceflow": drain_onceflow,
        "celery": drain_celery,
    }
    if b.purl is not None:
        sides["procrastinate"] = drain_procrastinate
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    for rnd in range(rounds):
        for name, fn in sides.items():
            res = fn(b, n, rnd, timeout)
            runs[name].append(res)
            log(
                f"drain round {rnd + 1} {name}: {res['per_s']:,.0f}/s first->last finish "
                f"({res['window_s']:.2f} s), {res['from_launch_per_s']:,.0f}/s from launch; "
                f"enqueue {res['enqueue_per_s']:,.0f}/s"
            )
    out: dict[str, Any] = {"n": n, "rounds": rounds, "sides": {}}
    for name, rs in runs.items():
        out["sides"][name] = {
            "per_s": sum(r["n"] - 1 for r in rs) / sum(r["window_s"] for r in rs),
            "from_launch_per_s": sum(r["n"] for r in rs) / sum(r["from_launch_s"] for r in rs),
            "enqueue_per_s": sum(r["n"] for r in rs) / sum(r["n"] / r["enqueue_per_s"] for r in rs),
            "task_ms_median": median_or_none([r["task_ms_median"] for r in rs]),
            "runs": rs,
        }
    return out


# ---------------------------------------------------------------------------- 2. pickup


def bench_pickup(b: Bench, count: int, warm: int) -> dict[str, Any]:
    b.reset()
    workers = [b.celery_worker("onceflow"), b.celery_worker("bare")]
    try:
        for w in workers:
            w.wait_log(" ready.")
        time.sleep(1.0)  # idle
        flow, bare = b.stages.flow, b.stages.bare
        samples: dict[str, list[float]] = {"onceflow": [], "bare": []}
        enqueue_calls: dict[str, list[float]] = {"onceflow": [], "bare": []}
        done = {"onceflow": 0, "bare": 0}
        for i in range(2 * (count + warm)):
            tag = "onceflow" if i % 2 == 0 else "bare"
            t_enq = 0.0
            t0 = time.time()
            if tag == "onceflow":
                flow.enqueue("bench_noop", "bench", f"pick-{i}", input={"n": i, "pickup": True})
                t_enq = time.time() - t0
            else:
                bare.send_task("bench.noop", args=[i, True], queue=b.bare_queue)
                t_enq = time.time() - t0
            got = b.redis.blpop([f"{b.keys}:pickup:{tag}"], timeout=30)
            if got is None:
                for w in workers:
                    w.check_alive()
                raise RuntimeError(f"{tag}: the stage did not start within 30 s")
            started = float(got[1])
            done[tag] += 1
            key = f"{b.keys}:done:{tag}"
            deadline = time.monotonic() + 30
            while int(b.redis.get(key) or 0) < done[tag]:  # finished: the worker is idle again
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{tag}: the task did not finish within 30 s")
                time.sleep(0.002)
            if i // 2 >= warm:
                samples[tag].append(started - t0)
                enqueue_calls[tag].append(t_enq)
            time.sleep(IDLE_GAP)
    finally:
        for w in workers:
            b.stop(w)
    out: dict[str, Any] = {"count": count, "warmup": warm}
    for tag, xs in samples.items():
        out[tag] = latency_ms(xs)
        out[f"{tag}_enqueue_call"] = latency_ms(enqueue_calls[tag])
    log(
        f"pickup onceflow p50 {out['onceflow']['p50_ms']:.2f} ms p99 "
        f"{out['onceflow']['p99_ms']:.2f} ms; bare Celery p50 {out['bare']['p50_ms']:.2f} ms "
        f"p99 {out['bare']['p99_ms']:.2f} ms"
    )
    return out


# ---------------------------------------------------------------------------- 3. probes


def commit_probe(url: str, n: int = 200) -> dict[str, float]:
    """This machine's price of a durable commit: a one-row INSERT in autocommit beside a
    ``SELECT 1`` round trip, interleaved, on a scratch table of the bench database."""
    with raw_connect(url) as conn:
        conn.execute("CREATE TABLE bench_commit_probe (x int)")
        try:
            sel: list[float] = []
            ins: list[float] = []
            for _ in range(n + 20):
                t0 = time.perf_counter()
                conn.execute("SELECT 1").fetchone()
                t1 = time.perf_counter()
                conn.execute("INSERT INTO bench_commit_probe VALUES (1)")
                t2 = time.perf_counter()
                sel.append(t1 - t0)
                ins.append(t2 - t1)
        finally:
            conn.execute("DROP TABLE bench_commit_probe")
    return {
        "select1_p50_ms": pct(sel[20:], 50) * 1e3,
        "insert_commit_p50_ms": pct(ins[20:], 50) * 1e3,
    }


# Where a pool child's wall time goes, by the first matching frame of its main thread's stack
# (py-spy --idle samples; the heartbeat thread's own samples are left out).
PROFILE_BUCKETS = (
    ("Queue.claim (", "claim: the UPDATE … RETURNING (commit included)"),
    ("Queue.complete (", "complete: the UPDATE … RETURNING (commit included)"),
    ("_Heartbeater.stop (", "heartbeat thread: stop and join"),
    ("Thread.start (", "heartbeat thread: start"),
    ("bench_noop (", "the stage body"),
    ("run_request (", "the rest of run_request (validation, context)"),
    ("trace_task (", "Celery's task tracing (signals incl. the bench's INCR, logging)"),
    ("fast_trace_task (", "Celery's task tracing (signals incl. the bench's INCR, logging)"),
    ("_make_protected_receive", "waiting for the next message from the pool's parent"),
)


def profile_drain(b: Bench, kind: str, n: int, seconds: float) -> dict[str, Any]:
    """A drain of ``n`` queued requests with py-spy recording both pool children."""
    pyspy = Path(sys.executable).parent / "py-spy"
    b.reset()
    if kind == "onceflow":
        for i in range(n):
            b.stages.flow.enqueue("bench_noop", "bench", f"prof-{i}", input={"n": i})
    else:
        for i in range(n):
            b.stages.bare.send_task("bench.noop", args=[i], queue=b.bare_queue)
    proc = b.celery_worker(kind, total=n)
    key = f"{b.keys}:done:{kind}"
    try:
        proc.wait_log(" ready.")
        children = subprocess.run(
            ["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        done_before = int(b.redis.get(key) or 0)
        spies = []
        for pid in children:
            out = b.logdir / f"pyspy-{kind}-{pid}.txt"
            argv = [
                str(pyspy), "record", "--pid", pid, "--duration", str(int(seconds)),
                "--rate", "100", "--idle", "--nonblocking", "--format", "raw", "-o", str(out),
            ]  # fmt: skip
            spies.append(
                (out, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            )
        for _, spy in spies:
            spy.wait(timeout=seconds + 60)
        done_after = int(b.redis.get(key) or 0)
        done_in_window = done_after - done_before
        _wait(proc, lambda: int(b.redis.get(key) or 0) >= n, 900, f"{kind} (profile)")
    finally:
        b.stop(proc)
    # a pool child's main thread only
    paths = [out for out, _ in spies]
    buckets, _, total = stack_samples(paths, "Worker.workloop", PROFILE_BUCKETS)
    wall_per_task = len(spies) * seconds / max(done_in_window, 1)
    shares = {k: v / total for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])}
    log(
        f"profile {kind}: {done_in_window} tasks in {seconds:g} s; "
        + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
    )
    return {
        "kind": kind,
        "seconds": seconds,
        "children": len(spies),
        "tasks": done_in_window,
        "child_ms_per_task": wall_per_task * 1e3,
        "ran_dry": done_after >= n,
        "shares": shares,
    }


# ---------------------------------------------------------------------------- report


def runtime_machine(b: Bench) -> dict[str, Any]:
    """The report's header: the machine, the servers, Celery's and the peers' versions."""
    import celery
    import kombu

    with raw_connect(b.url) as conn:
        pg = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    return machine_info(
        postgres=pg,
        redis_server=redis_version(b.redis_url),
        celery=celery.__version__,
        kombu=kombu.__version__,
        redis_py=redis.__version__,
        psycopg=psycopg_version(),
        procrastinate=b.procrastinate("version") if b.purl else None,
        commit_probe=commit_probe(b.url),
    )


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    cp = m["commit_probe"]
    d = res["drain"]
    s = d["sides"]
    names = {
        "onceflow": "onceflow stage (`flow.enqueue`)",
        "celery": "bare Celery task (`send_task`)",
        "procrastinate": f"Procrastinate {m['procrastinate']} (`defer`, async no-op)",
    }
    lines = [
        command_header(res),
        "",
        f"Machine: nproc {m['nproc']} ({m['cpu']}), {m['os']}; PostgreSQL {m['postgres']}; "
        f"Redis {m['redis_server']}; Python {m['python']}; Celery {m['celery']}, "
        f"kombu {m['kombu']}, redis-py {m['redis_py']}; psycopg {m['psycopg']}; "
        f"load average {m['loadavg_start']} at start, {res['loadavg_end']} at end. "
        f"A durable one-row INSERT commit takes {cp['insert_commit_p50_ms']:.2f} ms (p50) here, "
        f"a `SELECT 1` round trip {cp['select1_p50_ms']:.2f} ms",
        "",
        f"#### 1. Drain rate: {d['n']:,} no-op requests queued with the worker stopped, one "
        f"worker with concurrency {CONCURRENCY}; {d['rounds']} rounds, interleaved, pooled",
        "",
    ]
    once = s["onceflow"]["per_s"]
    rows: list[list[str]] = []
    for name, side in s.items():
        ratio = once / side["per_s"]
        verdict = f" {ok(ratio >= DRAIN_TARGET)}" if name == "celery" else ""
        task = side["task_ms_median"]
        rounds = per_round_ratios(
            [o["per_s"] for o in s["onceflow"]["runs"]], [x["per_s"] for x in side["runs"]]
        )["ratios"]
        rows.append([
            names[name], f"{side['per_s']:,.0f}/s", f"{ratio:.2f}{verdict}",
            ", ".join(f"{r:.2f}" for r in rounds), f"{side['from_launch_per_s']:,.0f}/s",
            f"{side['enqueue_per_s']:,.0f}/s", f"{task:.2f} ms" if task is not None else "n/a",
        ])  # fmt: skip
    if "procrastinate" not in s:
        rows.append(["Procrastinate", "skipped: no virtualenv (see the docstring)", *[None] * 5])
    header = [
        "Side", "drained/s, first -> last finish", "onceflow / side (target ≥ 0.5 vs Celery)",
        "per-round ratios", "drained/s, from worker launch",
        "enqueue/s (one call each, worker stopped)", "task run time, median (Celery's log)",
    ]  # fmt: skip
    lines += table(header, rows)
    p = res["pickup"]
    once_p = p["onceflow"]
    lines += [
        "",
        f"#### 2. Pickup latency, enqueue -> stage body start, idle workers ({p['count']} "
        f"requests per side after {p['warmup']} of warm-up, sides alternating)",
        "",
        *table(
            ["Side", "p50", "p99", "mean", "max"],
            [
                [
                    f"onceflow (`flow.enqueue` -> body; target p50 ≤ {PICKUP_TARGET_MS:g} ms)",
                    f"{once_p['p50_ms']:.2f} ms {ok(once_p['p50_ms'] <= PICKUP_TARGET_MS)}",
                    *(f"{once_p[k]:.2f} ms" for k in ("p99_ms", "mean_ms", "max_ms")),
                ],
                _lat_row(
                    "of which the `flow.enqueue` call (INSERT + commit, then `send_task`)",
                    p["onceflow_enqueue_call"],
                ),
                _lat_row("bare Celery (`send_task` -> body)", p["bare"]),
                _lat_row("of which the `send_task` call", p["bare_enqueue_call"]),
                [
                    "**onceflow / bare Celery**",
                    *(f"{once_p[k] / p['bare'][k]:.2f}x" for k in ("p50_ms", "p99_ms", "mean_ms")),
                    None,
                ],
            ],
        ),
        "",
    ]
    for prof in res.get("profile", []):
        who = "onceflow" if prof["kind"] == "onceflow" else "bare Celery"
        lines += [
            f"#### Profile: a {who} pool child during a drain (`--profile`: py-spy "
            "--idle --nonblocking, "
            f"{prof['children']} children x {prof['seconds']:g} s, {prof['tasks']:,} tasks; "
            f"{prof['child_ms_per_task']:.1f} ms of child time per task)"
            + (
                " — **the queue ran dry inside the window: idle time is counted**"
                if prof["ran_dry"]
                else ""
            ),
            "",
            *table(
                ["Where the child's main thread was", "share", "ms per task"],
                [
                    [name, f"{share:.0%}", f"{share * prof['child_ms_per_task']:.1f}"]
                    for name, share in prof["shares"].items()
                ],
            ),
            "",
        ]
    return "\n".join(lines)


def _lat_row(name: str, st: dict[str, float]) -> list[str]:
    return [name, *(f"{st[k]:.2f} ms" for k in ("p50_ms", "p99_ms", "mean_ms", "max_ms"))]


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run: 300 requests, 1 round")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then profile a onceflow and a bare Celery drain with py-spy (needs ptrace)",
    )
    args = parser.parse_args(argv)

    admin = admin_url()
    redis_url = bench_redis_url(REDIS_DEFAULT)
    venv = Path(os.environ.get("ONCEFLOW_BENCH_PROCRASTINATE_VENV", VENV_DEFAULT))
    have_procrastinate = (venv / "bin" / "procrastinate").exists()
    if not have_procrastinate:
        log(f"no Procrastinate in {venv}: its row is skipped (see the docstring to set it up)")
    if args.quick:
        cfg = {"n": 300, "rounds": 1, "pickups": 50, "pickup_warm": 5}
    else:
        cfg = {"n": 2_000, "rounds": 3, "pickups": 200, "pickup_warm": 10}
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": "bench/runtime_bench.py" + " --quick" * args.quick + " --profile" * args.profile,
        "config": cfg,
    }
    with (
        tempfile.TemporaryDirectory(prefix="onceflow-runtime-bench-") as tmp,
        bench_databases(admin, have_procrastinate) as (url, purl),
    ):
        logdir = Path(tmp)
        (logdir / "bench_procrastinate.py").write_text(PROCRASTINATE_APP)
        b = Bench(url, purl, redis_url, venv, logdir)
        try:
            if purl is not None:
                b.procrastinate("schema")
            results["machine"] = runtime_machine(b)
            results["machine"]["loadavg_start"] = loadavg()
            timeout = 900.0
            results["drain"] = bench_drain(b, cfg["n"], cfg["rounds"], timeout)
            results["pickup"] = bench_pickup(b, cfg["pickups"], cfg["pickup_warm"])
            if args.profile:
                results["profile"] = [
                    profile_drain(b, kind, cfg["n"], 5.0 if not args.quick else 2.0)
                    for kind in ("onceflow", "bare")
                ]
        except BaseException:
            for path in sorted(logdir.glob("*.log")):  # the temp dir goes away with the run
                tail = "\n".join(path.read_text(errors="replace").splitlines()[-25:])
                log(f"--- last lines of {path.name}:\n{tail}")
            raise
        finally:
            b.stop_all()
            b.cleanup()
    return finish(results, started, args.json, render)


if __name__ == "__main__":
    sys.exit(main())
