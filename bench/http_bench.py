"""HTTP API benchmark: enqueue and apply-op calls/s through uvicorn vs the same calls in-process.

    PYTHONPATH=. .venv/bin/python bench/http_bench.py [--quick] [--json] [--rounds N]
        [--calls N] [--baseline DIR] [--only enqueue|apply_op]

Results and their reading: docs/benchmarks.md, "HTTP API". The server runs the
onceflow this process imports (``PYTHONPATH`` is passed on), so ``PYTHONPATH=<a checkout>``
measures that checkout's API; the report names it (path and commit). ``--baseline DIR``
starts a second server on the onceflow of checkout ``DIR`` (say, main) and measures it in
the same rounds, as a third side: a before/after comparison under the same load.

Postgres comes from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), used only as the admin
URL: the run creates its own database ``onceflow_bench_<random>``, migrates it
and drops it at the end (``WITH (FORCE)``). Redis comes from
``ONCEFLOW_BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); the run
deletes the one broker queue it fills (``bench-http``).

The server is a real ``onceflow api`` process (uvicorn, one worker process, the
default thread pool and a pool of 5+5 database connections, as shipped; the per-key
rate limit raised out of reach, still counted) serving this file's flow. The client
is ``httpx`` (sync, one keep-alive connection per client thread) in this process.
In-process means the same call on a :class:`~onceflow.tasks.Flow` /
:class:`~onceflow.oplog.OpLog` built here with the same settings, from the same
number of threads.

1. Enqueue: ``flow.enqueue`` of a new request (validate, one INSERT, the Celery
   wake-up sent to Redis) vs ``POST /v1/workspaces/{ws}/requests`` doing exactly
   that behind key check, body cap and pydantic validation.
2. Apply op: ``oplog.apply_op`` of a ``cell.set`` with a fresh op id (lookup,
   one transaction, the commit broadcast) vs ``POST …/sub-docs/{sub_doc}/ops``;
   one sub-doc per client thread, so threads do not queue on one row lock.
3. A floor for HTTP itself: ``GET /docs`` (no key, no database): what uvicorn,
   FastAPI and the httpx client cost per request on this machine.

Each figure is measured with 1 and 8 client threads: rounds of a fixed number of
calls (default 5 rounds of 300, split evenly between the threads) after a warm-up;
the two sides alternate within each round (the order flips every round), the ratio
is taken per round (HTTP rate over the in-process rate measured next to it) and the
headline is the median of the per-round ratios, so outside load on a shared machine
hits both sides alike.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from pydantic import BaseModel

from bench.harness import (
    admin_url,
    bench_database,
    bench_redis_url,
    command_line,
    emit,
    free_port,
    loadavg,
    log,
    machine_info,
    table,
)
from onceflow.tasks import Flow, StageContext

REDIS_DEFAULT = "redis://127.0.0.1:6379/0"
WC = "bench-http"
WS = "wb"
KEY = "of_bench_key_" + secrets.token_hex(8)
CONCURRENCY = (1, 8)
WARMUP = 20  # calls per thread before each timed batch
HERE = Path(__file__).resolve().parent

# The flow the server serves (imported by `onceflow api --app http_bench:flow`).
flow = Flow()


class BenchInput(BaseModel):
    """A small stage input."""

    n: int = 0


@flow.stage("bench", input=BenchInput, worker_class=WC)
def bench_stage(ctx: StageContext, data: BenchInput) -> dict[str, int]:
    """Never run here: the benchmark measures enqueues only."""
    return {"n": data.n}


@contextmanager
def api_server(url: str, redis_url: str, code: str | None = None) -> Iterator[tuple[str, int]]:
    """A real `onceflow api` for this file's flow: its base URL and pid.

    The server imports onceflow from ``code`` (a checkout's root) if given, else the
    caller's ``PYTHONPATH``: the same onceflow as this process.
    """
    from onceflow.integrations.fastapi import hash_key

    port = free_port()
    # This file's directory for the flow first.
    where = code if code is not None else os.environ.get("PYTHONPATH")
    pythonpath = os.pathsep.join(p for p in (str(HERE), where) if p)
    env = {
        **os.environ,
        "ONCEFLOW_DATABASE_URL": url,
        "ONCEFLOW_REDIS_URL": redis_url,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(KEY): [WS]}),
        # The shipped per-key limit (3000/minute) would refuse a benchmark's calls: the
        # limiter still counts every call, at a limit no round reaches.
        "ONCEFLOW_API_RATE_LIMIT": "1000000/second",
        "PYTHONPATH": pythonpath,
    }
    args = ["api", "--app", "http_bench:flow", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/docs", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"the API server did not start: {err[-2000:]}")
            time.sleep(0.1)
        log(f"api server pid {proc.pid} on {base}")
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


Op = Callable[[int], None]


def timed(
    threads: int,
    make_op: Callable[[int], Op],
    calls: int,
    cpu: Callable[[], float],
) -> tuple[float, float]:
    """Calls/s of ``threads`` threads making ``calls`` calls in all (an even share each,
    after :data:`WARMUP` each, released together), and the CPU seconds per call that
    ``cpu()`` (this process + the server) counted."""
    share = max(1, calls // threads)
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            op = make_op(t)
            for i in range(WARMUP):
                op(-1 - i)
            ready.wait()
            go.wait()
            for i in range(share):
                op(i)
        except BaseException as exc:  # reported below, never swallowed
            errors.append(exc)
            ready.abort()

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    with suppress(threading.BrokenBarrierError):
        ready.wait()
    cpu_start = cpu()
    start = time.perf_counter()
    go.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    cpu_used = cpu() - cpu_start
    if errors:
        raise errors[0]
    done = share * threads
    return done / elapsed, cpu_used / done


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 100 calls")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per figure (5)")
    parser.add_argument("--calls", type=int, default=300, help="calls per round and side (300)")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also serve the onceflow of checkout DIR (say, main) from a second server, "
        "measured in the same rounds: a before/after comparison under the same load",
    )
    parser.add_argument(
        "--only", choices=["enqueue", "apply_op"], help="measure this call only (no floor)"
    )
    args = parser.parse_args(argv)
    rounds, calls = (2, 100) if args.quick else (args.rounds, args.calls)
    admin = admin_url()
    redis_url = bench_redis_url(REDIS_DEFAULT)

    import redis

    from onceflow.oplog import OpLog, new_op_id
    from onceflow.settings import Settings

    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": "bench/http_bench.py"
        + " ".join(["", *(argv if argv is not None else sys.argv[1:])]).rstrip(),
        "calls": calls,
        "rounds": rounds,
        "onceflow": onceflow_source(),
        "baseline": source_of(Path(args.baseline)) if args.baseline else None,
        "machine": _machine(),
        "figures": {},
    }
    broker = redis.Redis.from_url(redis_url)
    import psutil

    with ExitStack() as stack:
        url = stack.enter_context(bench_database(admin))
        servers = {"http": stack.enter_context(api_server(url, redis_url))}
        if args.baseline:
            code = str(Path(args.baseline).resolve())
            servers["http_baseline"] = stack.enter_context(api_server(url, redis_url, code))
        me = psutil.Process()
        server_procs = {side: psutil.Process(pid) for side, (_, pid) in servers.items()}

        def cpu_of(side: str) -> Callable[[], float]:
            """CPU seconds of this process and the side's server (not Postgres, not Redis)."""
            procs = [me, *([server_procs[side]] if side in server_procs else [])]
            return lambda: sum(sum(p.cpu_times()[:2]) for p in procs)

        settings = Settings(database_url=url, redis_url=redis_url)
        local_flow = Flow(settings=settings)
        local_flow.stages = flow.stages  # the same stage, enqueued from this process
        oplog = OpLog(local_flow.queue.engine, settings)
        headers = {"Authorization": f"Bearer {KEY}"}
        tag = [0]

        def fresh(prefix: str) -> str:
            tag[0] += 1
            return f"{prefix}-{tag[0]}-{secrets.token_hex(3)}"

        def enqueue_local(t: int) -> Op:
            run = fresh("local")
            return lambda i: _ok(local_flow.enqueue("bench", WS, f"{run}-{i}", "", {"n": i}))

        def enqueue_http(base: str) -> Callable[[int], Op]:
            return lambda t: _enqueue_http(base)

        def _enqueue_http(base: str) -> Op:
            client = httpx.Client(base_url=base, headers=headers, timeout=30)
            run = fresh("http")

            def op(i: int) -> None:
                body = {"stage": "bench", "job_id": f"{run}-{i}", "input": {"n": i}}
                response = client.post(f"/v1/workspaces/{WS}/requests", json=body)
                if response.status_code != 201:
                    raise RuntimeError(response.text)

            return op

        def op_local(t: int) -> Op:
            doc = fresh("dl")
            cell = {"type": "cell.set", "column": "c", "value": 1}
            return lambda i: _ok(oplog.apply_op(WS, doc, cell, new_op_id()))

        def op_http(base: str) -> Callable[[int], Op]:
            return lambda t: _op_http(base)

        def _op_http(base: str) -> Op:
            client = httpx.Client(base_url=base, headers=headers, timeout=30)
            doc = fresh("dh")
            cell = {"type": "cell.set", "column": "c", "value": 1}

            def op(i: int) -> None:
                body = {"op_id": new_op_id(), "op": cell}
                response = client.post(f"/v1/workspaces/{WS}/sub-docs/{doc}/ops", json=body)
                if response.status_code != 201:
                    raise RuntimeError(response.text)

            return op

        def floor_http(t: int) -> Op:
            client = httpx.Client(base_url=servers["http"][0], timeout=30)

            def op(i: int) -> None:
                if client.get("/docs").status_code != 200:
                    raise RuntimeError("GET /docs failed")

            return op

        calls_of = {
            "enqueue": (enqueue_local, enqueue_http),
            "apply_op": (op_local, op_http),
        }
        for name, (local, http) in calls_of.items():
            if args.only and name != args.only:
                continue
            makers = {"in_process": local} | {
                side: http(base) for side, (base, _) in servers.items()
            }
            for threads in CONCURRENCY:
                samples: dict[str, list[float]] = {side: [] for side in makers}
                cpu_per_call: dict[str, list[float]] = {side: [] for side in makers}
                for r in range(rounds):
                    # Every side once per round; who goes first rotates round by round.
                    order = list(makers)
                    order = order[r % len(order) :] + order[: r % len(order)]
                    for side in order:
                        rate, per_call = timed(threads, makers[side], calls, cpu_of(side))
                        samples[side].append(rate)
                        cpu_per_call[side].append(per_call)
                        log(f"{name} x{threads} {side}: {rate:,.0f}/s")
                    broker.delete(WC)
                # Each round's HTTP figure over the in-process one of the same round.
                ratios = {
                    side: [h / i for h, i in zip(v, samples["in_process"], strict=True)]
                    for side, v in samples.items()
                    if side != "in_process"
                }
                results["figures"][f"{name} x{threads}"] = {
                    side: statistics.median(v) for side, v in samples.items()
                } | {
                    "samples": samples,
                    "ratio": {side: statistics.median(v) for side, v in ratios.items()},
                    "ratios": ratios,
                    "cpu_ms": {k: 1000 * statistics.median(v) for k, v in cpu_per_call.items()},
                }
        for threads in CONCURRENCY if not args.only else ():
            runs = [timed(threads, floor_http, calls, cpu_of("http")) for _ in range(rounds)]
            rate = statistics.median(r for r, _ in runs)
            results["figures"][f"http floor x{threads}"] = {
                "http": rate,
                "cpu_ms": {"http": 1000 * statistics.median(c for _, c in runs)},
            }
            log(f"floor x{threads}: {rate:,.0f}/s")
    broker.delete(WC)
    results["loadavg_end"] = loadavg()
    results["wall_seconds"] = time.perf_counter() - started
    emit(results, args.json, render)
    return 0


def _machine() -> dict[str, Any]:
    import fastapi
    import uvicorn

    return machine_info(
        fastapi=fastapi.__version__,
        uvicorn=uvicorn.__version__,
        httpx=httpx.__version__,
        loadavg_start=loadavg(),
    )


def _ok(_: object) -> None:
    return None


def onceflow_source() -> str:
    """Where the onceflow this process (and so the server) imports lives, and its commit."""
    import onceflow

    return source_of(Path(onceflow.__file__).resolve().parents[1])


def source_of(root: Path) -> str:
    """A checkout's root and its commit (if it is a git work tree)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{root} ({commit or 'no git commit'})"


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"Command: `{res['command']}` — {res['rounds']} round(s) of {res['calls']} calls "
        "per side and figure, sides alternating; medians.",
        f"Server: onceflow from {res['onceflow']}"
        + (f"; baseline server: onceflow from {res['baseline']}" if res.get("baseline") else "")
        + ".",
        f"Date: {m['date']}. Machine: {m['nproc']} CPUs ({m['cpu']}), {m['os']}; Python "
        f"{m['python']}, FastAPI {m['fastapi']}, uvicorn {m['uvicorn']}, httpx {m['httpx']}. "
        f"Load average {m['loadavg_start']} at the start, {res['loadavg_end']} at the end.",
        "",
    ]
    rows: list[list[str]] = []
    names = {"http": "this", "http_baseline": "baseline"}
    for name, fig in res["figures"].items():
        call, _, threads = name.rpartition(" x")
        local = fig.get("in_process")
        local_s = f"{local:,.0f}" if local else "—"
        cpu_ms = fig.get("cpu_ms", {})
        cpu_local = f"{cpu_ms['in_process']:.2f}" if "in_process" in cpu_ms else "—"
        for side in [k for k in names if k in fig]:
            ratio = f"{fig['ratio'][side]:.2f}" if local else "—"
            rounds = ", ".join(f"{r:.2f}" for r in fig.get("ratios", {}).get(side, [])) or "—"
            cpu_http = f"{cpu_ms[side]:.2f}" if side in cpu_ms else "—"
            rows.append([
                call, threads, names[side], local_s, f"{fig[side]:,.0f}", ratio, rounds,
                cpu_local, cpu_http,
            ])  # fmt: skip
    header = [
        "call", "client threads", "server", "in-process calls/s", "HTTP calls/s",
        "HTTP / in-process (median of rounds)", "per round", "CPU ms per call, in-process",
        "CPU ms per call, HTTP (client + server)",
    ]  # fmt: skip
    return "\n".join(lines + table(header, rows, "lrlrrrlrr"))


if __name__ == "__main__":
    sys.exit(main())
