"""Many clients on one API process: idle tabs and agents, then a commit and an enqueue.

    PYTHONPATH=. .venv/bin/python bench/clients_bench.py [--sizes 100,1000,5000,10000]
        [--agents-share 0.1] [--procs 4] [--commits 5] [--enqueues 20] [--code DIR] [--json]

Results and their reading: docs/benchmarks.md, "Many clients". One real ``onceflow api``
process (uvicorn, one worker, the shipped pools) per size, fresh each time, serving this
file's flow on a fresh database (``ONCEFLOW_BENCH_DATABASE_URL``, as every bench) and the
Redis of ``ONCEFLOW_BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). ``--code DIR``
runs the server on the onceflow of checkout ``DIR`` (say, main): a before/after comparison.

Clients, N + M at each size, in ``--procs`` client processes of their own (asyncio, a
minimal HTTP/1.1 client on raw streams: one keep-alive connection per long poll, one per
event stream — the cheapest client, so the cores go to the server):

* a tab (N = total - M): an event stream ``GET /v1/workspaces/{ws}/events`` on the one
  workspace and a long-poll claim loop ``POST /v1/worker-classes/{wc}/claims`` with
  ``wait`` 20 s (the JavaScript SDK's default) of the one pull class — two connections;
* an agent (M = ``--agents-share`` of the total): the same claim loop, no stream.

Per size, once every stream said ``ready`` and every claim loop has sent its first poll
(and the server settled): the API process's RSS and open fds (per client), the database's
connections (``pg_stat_activity``) and Redis's (``CLIENT LIST`` on the bench's db), the API
CPU while idle (10 s: the clients only re-poll every 20 s), then ``--commits`` op commits
(``POST …/ops``, one at a time: time from the call to each stream's ``commit`` event) and
``--enqueues`` enqueues (``POST …/requests``, one at a time: time from the call to the
first ``201`` a claimer receives). The clocks are the machine's monotonic clock, shared
by every process. The figures at 100 clients are the baseline the others sit beside.

RLIMIT_NOFILE is raised to its hard limit for the server and the clients; a size that
needs more descriptors than that is reported as not reached (and why).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import psycopg
import redis
from pydantic import BaseModel

from bench.harness import (
    admin_url,
    bench_database,
    bench_redis_url,
    command_line,
    cpu_seconds,
    emit,
    free_port,
    libpq,
    loadavg,
    log,
    machine_info,
    table,
)
from onceflow.tasks import Flow, StageContext

HERE = Path(__file__).resolve().parent
WS = "ws-clients"
WARM = "ws-warm"  # the untimed first op's workspace: no stream follows it
WC = "bench-tabs"
API_KEY = "of_bench_clients_api_0123456789abcdef01"
WORKER_KEY = "of_bench_clients_worker_0123456789abcd"
WAIT = 20  # the JavaScript SDK's long poll
SETTLE = 5.0  # after the last client connected: its first polls answered, the server idle
IDLE = 10.0  # the window of idle CPU

# The flow the server serves (`onceflow api --app clients_bench:flow`).
flow = Flow(pull_worker_classes=(WC,))


def _log_gc_pauses(path: str) -> None:
    """In the server (``--stalls``): every collection of 5 ms or more, on the monotonic clock
    the other processes of this machine share."""
    import gc

    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[:] = [time.monotonic()]
        elif began:
            took = time.monotonic() - began[0]
            if took >= 0.005:
                out.write(f"{began[0]:.4f} {info['generation']} {took * 1000:.1f}\n")

    gc.callbacks.append(on_gc)

    def census(*_: object) -> None:
        """On SIGUSR1: the objects the collector tracks, by generation and by type."""
        objs = gc.get_objects()
        kinds: dict[str, int] = {}
        for o in objs:
            name = type(o).__qualname__
            kinds[name] = kinds.get(name, 0) + 1
        top = sorted(kinds.items(), key=lambda kv: -kv[1])[:15]
        gens = [len(gc.get_objects(g)) for g in range(3)]
        with open(path + ".census", "w") as f:
            json.dump({"tracked": len(objs), "generations": gens, "top": top}, f)

    signal.signal(signal.SIGUSR1, census)


if os.environ.get("CLIENTS_BENCH_GC_LOG"):
    _log_gc_pauses(os.environ["CLIENTS_BENCH_GC_LOG"])
if os.environ.get("CLIENTS_BENCH_GC_OFF"):  # the control run of ``--server-gc off``
    import gc

    gc.disable()


class TabInput(BaseModel):
    n: int = 0


@flow.stage("tab-work", input=TabInput, worker_class=WC)
def tab_work(ctx: StageContext, data: TabInput) -> dict[str, int]:
    """Run by a tab (never here): the benchmark only claims it."""
    return {"n": data.n}


# ------------------------------------------------------------------ the server


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


@contextmanager
def api_server(
    url: str, redis_url: str, code: str | None, gc_log: str | None = None, gc_off: bool = False
) -> Iterator[tuple[str, int, int]]:
    """A real `onceflow api` for this file's flow: base URL, pid, port."""
    from onceflow.integrations.fastapi import hash_key

    port = free_port()
    where = code if code is not None else os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "ONCEFLOW_DATABASE_URL": url,
        "ONCEFLOW_REDIS_URL": redis_url,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS, WARM]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [WC]}),
        # One key for every client here (a deployment has one per tab or user): no per-key
        # request or stream limit, and the process's stream bound out of reach.
        "ONCEFLOW_API_RATE_LIMIT": "",
        "ONCEFLOW_API_SSE_MAX_STREAMS": "100000",
        "ONCEFLOW_API_SSE_MAX_PER_KEY": "100000",
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), where) if p),
    }
    if gc_log:
        env["CLIENTS_BENCH_GC_LOG"] = gc_log
    if gc_off:
        env["CLIENTS_BENCH_GC_OFF"] = "1"
    args = ["api", "--app", "clients_bench:flow", "--port", str(port), "--log-level", "warning"]
    # The server's log to a file (a pipe nobody reads would block the server once full).
    log_path = Path(tempfile.gettempdir()) / f"clients_bench_api_{port}.log"
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", *args],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log(f"api server pid {proc.pid}, log {log_path}")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                err = log_path.read_text(errors="replace")
                raise RuntimeError(f"the API server did not start: {err[-2000:]}")
            time.sleep(0.1)
        yield base, proc.pid, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def pg_connections(url: str) -> int:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(row[0]) if row else 0


def redis_connections(redis_url: str) -> int:
    client = redis.Redis.from_url(redis_url)
    db = client.connection_pool.connection_kwargs.get("db", 0)
    try:
        listed = client.client_list()
        mine = client.client_id()
        return sum(1 for c in listed if int(c.get("db", -1)) == db and int(c["id"]) != mine)
    finally:
        client.close()


# ------------------------------------------------------------------ the clients


async def _request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: str, body: bytes
) -> tuple[int, bytes]:
    writer.write(head.encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("closed")
    status = int(status_line.split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "content-length":
            length = int(value.strip())
    data = await reader.readexactly(length) if length else b""
    return status, data


def _post(path: str, key: str, payload: dict[str, Any]) -> tuple[str, bytes]:
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head, body


class Client:
    """One client process's share: its streams and claim loops, and what they saw."""

    def __init__(self, host: str, port: int, tabs: int, agents: int, name: str) -> None:
        self.host, self.port = host, port
        self.tabs, self.agents, self.name = tabs, agents, name
        self.commits: list[list[float]] = []  # per stream: arrival of each commit event
        self.claims: list[tuple[str, float]] = []  # (request id, arrival)
        self.ready = 0
        self.polled = 0
        self.errors: list[str] = []
        self.polls: dict[int, int] = {}  # claim polls sent, per 100 ms of the monotonic clock

    async def stream(self, gate: asyncio.Semaphore) -> None:
        arrivals: list[float] = []
        self.commits.append(arrivals)
        async with gate:
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 16)
            writer.write(
                f"GET /v1/workspaces/{WS}/events HTTP/1.1\r\nHost: api\r\n"
                f"Authorization: Bearer {API_KEY}\r\nAccept: text/event-stream\r\n\r\n".encode()
            )
            await writer.drain()
            while True:
                line = await reader.readline()
                if not line:
                    self.errors.append("stream closed before ready")
                    return
                if line.startswith(b"event: ready"):
                    self.ready += 1
                    break
        while True:
            line = await reader.readline()
            if not line:
                self.errors.append("stream closed")
                return
            if line.startswith(b"event: commit"):
                arrivals.append(time.monotonic())

    async def claim_loop(self, n: int, gate: asyncio.Semaphore) -> None:
        path = f"/v1/worker-classes/{WC}/claims"
        async with gate:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        first = True
        while True:
            head, body = _post(path, WORKER_KEY, {"worker_id": f"{self.name}-{n}", "wait": WAIT})
            if first:
                self.polled += 1
                first = False
            tick = int(time.monotonic() * 10)
            self.polls[tick] = self.polls.get(tick, 0) + 1
            try:
                status, data = await _request(reader, writer, head, body)
            except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
                self.errors.append(f"claim: {type(exc).__name__}")
                return
            if status == 201:
                self.claims.append((json.loads(data)["request_id"], time.monotonic()))
            elif status != 204:
                self.errors.append(f"claim status {status}")
                await asyncio.sleep(1)

    async def run(self, conn: Any) -> None:
        gate = asyncio.Semaphore(64)  # connections opened at once
        tasks = []
        for n in range(self.tabs):
            tasks.append(asyncio.create_task(self.stream(gate)))
            tasks.append(asyncio.create_task(self.claim_loop(n, gate)))
        for n in range(self.tabs, self.tabs + self.agents):
            tasks.append(asyncio.create_task(self.claim_loop(n, gate)))
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "status":
                conn.send((self.ready, self.polled, self.errors[:5], len(self.errors)))
            elif command == "report":
                conn.send((self.commits, self.claims))
            elif command == "polls":
                conn.send(self.polls)
            elif command == "stop":
                for t in tasks:
                    t.cancel()
                conn.send("stopped")
                return


def client_main(host: str, port: int, tabs: int, agents: int, name: str, conn: Any) -> None:
    raise_nofile()
    asyncio.run(Client(host, port, tabs, agents, name).run(conn))


# ------------------------------------------------------------------ one size


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Prober:
    """``GET /healthz`` every 50 ms on a connection of its own (``--stalls``): what any call
    waits for the server's event loop, over the whole measurement."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.samples: list[tuple[float, float]] = []  # (sent, seconds to the answer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                http.get("/healthz")
                self.samples.append((t0, time.monotonic() - t0))
                self._stop.wait(0.05)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def stall_report(
    samples: list[tuple[float, float]], gc_log: Path, polls: dict[int, int]
) -> dict[str, Any]:
    """The prober's slow answers, each beside the GC pauses inside it and the claim polls
    the clients sent in the second before it."""
    pauses = []
    for line in gc_log.read_text().splitlines() if gc_log.exists() else []:
        t, gen, ms = line.split()
        pauses.append((float(t), int(gen), float(ms)))
    lat = sorted(d for _, d in samples)
    per_s: dict[int, int] = {}
    for tick, n in polls.items():
        per_s[tick // 10] = per_s.get(tick // 10, 0) + n
    slow = []
    for t0, d in samples:
        if d < 0.2:
            continue
        inside = [(g, ms) for t, g, ms in pauses if t0 - 0.5 <= t <= t0 + d]
        before = sum(n for tick, n in polls.items() if t0 - 1 <= tick / 10 <= t0)
        slow.append({"ms": round(d * 1000), "gc": inside,
                     "polls_1s_before": before})  # fmt: skip
    return {
        "probe_p50_ms": round(pct(lat, 0.5) * 1000, 1),
        "probe_p99_ms": round(pct(lat, 0.99) * 1000, 1),
        "probe_max_ms": round(lat[-1] * 1000, 1) if lat else None,
        "gc_pauses": len(pauses),
        "gc_total_ms": round(sum(ms for _, _, ms in pauses)),
        "gc_max_ms": max((ms for _, _, ms in pauses), default=0),
        "gc_gen2": [ms for _, g, ms in pauses if g == 2],
        "polls_per_s_mean": round(sum(per_s.values()) / max(1, len(per_s))),
        "polls_per_s_max": max(per_s.values(), default=0),
        "slow": slow[:30],
    }


def measure(
    url: str, redis_url: str, total: int, agents_share: float, procs: int, commits: int,
    enqueues: int, code: str | None, stalls: bool = False, gc_off: bool = False,
) -> dict[str, Any]:  # fmt: skip
    agents = round(total * agents_share)
    tabs = total - agents
    need = 2 * tabs + agents
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out: dict[str, Any] = {"clients": total, "tabs": tabs, "agents": agents, "connections": need}
    if need + 200 > hard:
        out["not_reached"] = f"needs ~{need + 200} descriptors in the API process; limit {hard}"
        return out
    gc_log = Path(tempfile.gettempdir()) / f"clients_bench_gc_{os.getpid()}_{total}.log"
    gc_log.unlink(missing_ok=True)
    with (
        api_server(url, redis_url, code, str(gc_log) if stalls else None, gc_off) as (
            base,
            pid,
            port,
        ),
        Prober(base) if stalls else nullcontext() as prober,
    ):
        out["rss_start_mb"] = rss_mb(pid)
        ctx = mp.get_context("spawn")
        pipes, workers = [], []
        for k in range(procs):
            share_t = tabs // procs + (1 if k < tabs % procs else 0)
            share_a = agents // procs + (1 if k < agents % procs else 0)
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=client_main, args=("127.0.0.1", port, share_t, share_a, f"c{k}", child)
            )
            p.start()
            pipes.append(parent)
            workers.append(p)
        try:
            started = time.monotonic()
            while True:
                states = []
                for c in pipes:
                    c.send("status")
                    states.append(c.recv())
                ready = sum(s[0] for s in states)
                polled = sum(s[1] for s in states)
                errors = sum(s[3] for s in states)
                if ready >= tabs and polled >= tabs + agents:
                    break
                if errors or time.monotonic() - started > 300:
                    firsts = [e for s in states for e in s[2]]
                    out["not_reached"] = (
                        f"{ready}/{tabs} streams ready, {polled}/{tabs + agents} polls sent, "
                        f"{errors} errors ({firsts[:3]}) after {time.monotonic() - started:.0f} s"
                    )
                    out["rss_mb"], out["fds"] = rss_mb(pid), fds(pid)
                    return out
                time.sleep(0.5)
            out["connect_s"] = round(time.monotonic() - started, 1)
            time.sleep(SETTLE)
            if stalls:
                os.kill(pid, signal.SIGUSR1)
                census = Path(f"{gc_log}.census")
                until = time.monotonic() + 60
                while not census.exists() and time.monotonic() < until:
                    time.sleep(0.2)
                time.sleep(0.5)  # written whole
                out["census"] = json.loads(census.read_text())
                census.unlink()
            out["rss_mb"] = rss_mb(pid)
            out["fds"] = fds(pid)
            out["pg_conns"] = pg_connections(url)
            out["redis_conns"] = redis_connections(redis_url)
            before = cpu_seconds([pid])
            time.sleep(IDLE)
            out["idle_cpu_pct"] = round(100 * (cpu_seconds([pid]) - before) / IDLE, 1)

            http = httpx.Client(base_url=base, timeout=60)
            # One op and one enqueue first, not timed: the process's first use of its op
            # log and async queue (connections, prepared statements) is not a wake-up.
            warm = {"op_id": secrets.token_hex(8), "op": {"type": "cell.set", "column": "c",
                    "value": 0}}  # fmt: skip
            http.post(f"/v1/workspaces/{WARM}/sub-docs/warm/ops", json=warm,
                      headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
            sent: list[float] = []
            for i in range(commits):
                body = {"op_id": secrets.token_hex(8),
                        "op": {"type": "cell.set", "column": "c", "value": i}}  # fmt: skip
                t0 = time.monotonic()
                r = http.post(f"/v1/workspaces/{WS}/sub-docs/doc/ops", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
                if r.status_code not in (200, 201):
                    raise RuntimeError(r.text)
                sent.append(t0)
                out.setdefault("commit_post_ms", []).append(round((time.monotonic() - t0) * 1000))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # every stream got it (or 30 s)
                    got = 0
                    for c in pipes:
                        c.send("report")
                        streams, _ = c.recv()
                        got += sum(1 for s in streams if len(s) > i)
                    if got >= tabs:
                        break
                    time.sleep(0.2)
            enq: dict[str, float] = {}
            for i in range(enqueues):
                body = {"stage": "tab-work", "job_id": f"e{total}-{i}", "input": {"n": i},
                        "worker_class": WC}  # fmt: skip
                t0 = time.monotonic()
                r = http.post(f"/v1/workspaces/{WS}/requests", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
                if r.status_code != 201:
                    raise RuntimeError(r.text)
                rid = r.json()["request_id"]
                enq[rid] = t0
                deadline = time.monotonic() + 60
                claimed = False
                while not claimed and time.monotonic() < deadline:
                    for c in pipes:
                        c.send("report")
                        _, claims = c.recv()
                        if any(r == rid for r, _ in claims):
                            claimed = True
                    if not claimed:
                        time.sleep(0.05)
            http.close()
            commit_lat: list[float] = []
            by_commit: list[list[float]] = [[] for _ in sent]
            arrivals: dict[str, float] = {}
            missing = 0
            for c in pipes:
                c.send("report")
                streams, claims = c.recv()
                for s in streams:
                    for i, t0 in enumerate(sent):
                        if len(s) > i:
                            commit_lat.append((s[i] - t0) * 1000)
                            by_commit[i].append((s[i] - t0) * 1000)
                        else:
                            missing += 1
                for rid, t in claims:
                    arrivals.setdefault(rid, t)
            # Per commit: the first, median and last stream's latency.
            out["commit_each_ms"] = [
                (round(min(v)), round(pct(v, 0.5)), round(max(v))) for v in by_commit if v
            ]
            claim_lat = [(arrivals[r] - t0) * 1000 for r, t0 in enq.items() if r in arrivals]
            out.update(
                commit_p50_ms=round(pct(commit_lat, 0.5), 1),
                commit_p99_ms=round(pct(commit_lat, 0.99), 1),
                commit_missing=missing,
                claim_p50_ms=round(pct(claim_lat, 0.5), 1),
                claim_p99_ms=round(pct(claim_lat, 0.99), 1),
                claim_max_ms=round(max(claim_lat), 1) if claim_lat else None,
                claim_each_ms=[round(v) for v in claim_lat],
                claims_seen=len(claim_lat),
                enqueues=enqueues,
                rss_end_mb=rss_mb(pid),
            )
            if prober is not None:
                polls: dict[int, int] = {}
                for c in pipes:
                    c.send("polls")
                    for tick, n in c.recv().items():
                        polls[tick] = polls.get(tick, 0) + n
                out["stalls"] = stall_report(prober.samples, gc_log, polls)
            return out
        finally:
            for c in pipes:
                try:
                    c.send("stop")
                    c.recv()
                except (OSError, EOFError):
                    pass
            for p in workers:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()


# ------------------------------------------------------------------ report


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        f"Date: {m['date']}; {m['nproc']} CPUs ({m['cpu']}), {m['os']}, Python {m['python']}; "
        f"load average at start {res['load_start']}. Server code: {res['code']}.",
        "",
    ]
    header = [
        "clients (tabs + agents)", "connections", "API RSS MB (per client KB)",
        "API fds (per client)", "Postgres conns", "Redis conns", "API CPU idle",
        "commit → every stream p50 / p99 ms", "enqueue → first claim p50 / p99 ms",
    ]  # fmt: skip
    rows = []
    for r in res["sizes"]:
        n = r["clients"]
        label = f"{n:,} ({r['tabs']:,} + {r['agents']:,})"
        if "commit_p50_ms" not in r:
            rows.append([label, f"{r['connections']:,}", f"not reached: {r.get('not_reached')}",
                         "", "", "", "", "", ""])  # fmt: skip
            continue
        per_kb = (r["rss_mb"] - r["rss_start_mb"]) * 1024 / n
        rows.append([
            label, f"{r['connections']:,}", f"{r['rss_mb']:.0f} ({per_kb:.0f})",
            f"{r['fds']:,} ({r['fds'] / n:.2f})", r["pg_conns"], r["redis_conns"],
            f"{r['idle_cpu_pct']} %",
            f"{r['commit_p50_ms']:.0f} / {r['commit_p99_ms']:.0f}"
            + (f" ({r['commit_missing']} missed)" if r["commit_missing"] else ""),
            f"{r['claim_p50_ms']:.0f} / {r['claim_p99_ms']:.0f}"
            + (f" ({r['claims_seen']}/{r['enqueues']} claimed)"
               if r["claims_seen"] != r["enqueues"] else ""),
        ])  # fmt: skip
    lines += table(header, rows)
    return "\n".join(lines)


def main() -> None:
    p = command_line(__doc__)
    p.add_argument("--sizes", default="100,1000,5000,10000")
    p.add_argument("--agents-share", type=float, default=0.1)
    p.add_argument("--procs", type=int, default=4, help="client processes")
    p.add_argument("--commits", type=int, default=5)
    p.add_argument("--enqueues", type=int, default=20)
    p.add_argument("--code", default=None, help="run the server on this checkout's onceflow")
    p.add_argument(
        "--stalls", action="store_true",
        help="also probe /healthz every 50 ms and log the server's GC pauses: each slow "
        "answer beside the pauses and claim polls around it",
    )  # fmt: skip
    p.add_argument(
        "--server-gc", choices=("on", "off"), default="on",
        help="off: the server runs with its cycle collector disabled (a control for --stalls; "
        "memory then only grows, so keep such runs short)",
    )  # fmt: skip
    a = p.parse_args()
    raise_nofile()
    redis_url = bench_redis_url("redis://127.0.0.1:6379/0")
    res: dict[str, Any] = {
        "machine": machine_info(),
        "load_start": loadavg(),
        "code": a.code or "this tree",
        "server_gc": a.server_gc,
        "sizes": [],
    }
    with bench_database(admin_url()) as url:
        for size in [int(s) for s in a.sizes.split(",")]:
            log(f"{size} clients")
            r = measure(url, redis_url, size, a.agents_share, a.procs, a.commits, a.enqueues,
                        a.code, a.stalls, a.server_gc == "off")  # fmt: skip
            log(json.dumps(r))
            res["sizes"].append(r)
            with psycopg.connect(libpq(url), autocommit=True) as conn:
                conn.execute("TRUNCATE workspace_process_requests")
    emit(res, a.json, render)


if __name__ == "__main__":
    main()
