# Over ~300 lines on purpose: one simulation harness (servers, workload, checks, report),
# shared by the benchmark (main) and the acceptance test (tests/acceptance/test_shard_sim.py).
"""Past one machine, simulated on this one: the demo's workload over many
workspaces, on 1, 2 or 4 Postgres shards and a 3-node local Redis Cluster.

Each round starts its own shards (databases on the Postgres server named by
``ONCEFLOW_SIM_POSTGRES_URL``, default this machine's; with ``restart``, shard 0 is a
private embedded PostgreSQL 18 instead, stopped mid-run and started again), real
``onceflow worker`` processes (Celery prefork, classes ``llm`` and ``fallback``) and
``onceflow beat`` with ``ONCEFLOW_DATABASE_URLS`` naming the shards, the compute locks,
broadcasts and counters on the Redis Cluster, the broker on a private Redis, and the
demo's stand-in LLM and Maps servers, which count every call per cell. K client threads
enqueue the same jobs (evaluate / enrich / tailor / radar per job) for W workspaces.

Checked per shard at the end (:func:`check`): every row on its workspace's shard, one row
per request (no request id twice across shards), every request succeeded, one LLM call
per cell, op clocks gapless per sub-doc. With ``restart``: the other shards finished
requests while shard 0 was down (their own clocks, read at the stop and at the restart),
and no cell of theirs was paid twice. A cell of the stopped shard may be: the demo's stages
hold a 4 s lease, and a run whose database was away longer than that has lost its claim —
its fenced writes, the paid value's store among them, are refused (a zombie never writes),
and the rescued run pays again. Those are counted apart
(``llm_cells_paid_twice_on_stopped_shard``), as the chaos harness counts the duplicates
its fault windows explain.

    PYTHONPATH=$PWD .venv/bin/python bench/shard_sim.py --rounds 3 --json

prints requests/s per shard count, rounds interleaved, and the median of the per-round
ratios to one shard (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This tree's onceflow first: run from another worktree, the script must not import the
# editable install's (a before/after comparison would run one tree twice).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench.harness import (
    PrivatePostgres,
    command_line,
    free_port,
    fresh_databases,
    libpq,
    redis_answers,
    start_redis,
)
from onceflow.demo.procs import Proc, wait_for
from onceflow.demo.scenario import SECTIONS
from onceflow.demo.standins import StandIn
from onceflow.migrate import register_shard
from onceflow.shards import ShardMap

APP = "onceflow.demo.stages:flow"
COLUMNS = ["fit", "pay", "remote", "growth"]
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
STAGES = 4  # evaluate, enrich, tailor, radar per job


@dataclass
class Options:
    shards: int = 2
    workspaces: int = 12
    jobs: int = 2
    clients: int = 4
    workers: int = 2  # per worker class
    restart: bool = False
    timeout: float = 180.0
    log_dir: Path | None = None

    def expected(self) -> int:
        return self.workspaces * self.jobs * STAGES


@dataclass
class Round:
    opts: Options
    urls: list[str]
    shard_map: ShardMap
    llm: StandIn
    workspaces: list[str]
    enqueued: int = 0
    started: float = 0.0
    drained: float = 0.0
    #: restart: each other shard's clock when shard 0 stopped and when it answered again.
    window: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    #: restart: each other shard's unfinished requests when shard 0 stopped.
    left_at_stop: dict[int, int] = field(default_factory=dict)
    #: restart: seconds from shard 0's stop until it answered again.
    outage: float | None = None

    @property
    def seconds(self) -> float:
        return self.drained - self.started


def _one(url: str, sql: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(libpq(url), connect_timeout=5) as conn:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq(url), connect_timeout=5) as conn:
        return list(conn.execute(sql).fetchall())


@contextlib.contextmanager
def shard_databases(server: str, n: int) -> Iterator[list[str]]:
    """``n`` fresh migrated databases on ``server``; dropped at the end."""
    from onceflow.db import dispose_engines
    from onceflow.migrate import migrate

    tag = f"onceflow_sim_{os.getpid()}_{secrets.token_hex(3)}"
    with fresh_databases(server, [f"{tag}_s{k}" for k in range(n)], quiet=True) as urls:
        try:
            for url in urls:
                migrate(url)
            yield urls
        finally:
            dispose_engines()


class Servers:
    """What every round shares: the Redis Cluster, the broker, the stand-ins, the log dir."""

    def __init__(self, log_dir: Path | None = None) -> None:
        from tests.integration.redis_cluster import LocalCluster, server_binary

        self.stack = contextlib.ExitStack()
        binary = server_binary()
        if binary is None:
            raise RuntimeError("no redis-server or valkey-server to run the cluster with")
        self.cluster = LocalCluster(binary).start()
        self.stack.callback(self.cluster.stop)
        port = free_port()
        self.broker = start_redis(binary, port)
        self.stack.callback(self._stop_broker)
        self.broker_url = f"redis://127.0.0.1:{port}/0"
        self.broker_port = port
        self.run_id = secrets.token_hex(4)

        wait_for(lambda: redis_answers(self.broker_url), timeout=30, what="the broker")
        self.api_key = secrets.token_urlsafe(24)
        self.maps = StandIn("maps", latency=0.02).start()
        self.stack.callback(self.maps.stop)
        self.log_dir = log_dir or Path(self.stack.enter_context(tempfile.TemporaryDirectory()))
        self.private: PrivatePostgres | None = None

    def private_postgres(self) -> PrivatePostgres:
        if self.private is None:
            self.private = PrivatePostgres()
            self.stack.callback(self.private.close)
        return self.private

    def flush_broker(self) -> None:
        """Empty the private broker (what a round left: nothing of another application)."""
        import redis

        client = redis.Redis(port=self.broker_port)
        try:
            client.flushall()
        finally:
            client.close()

    def _stop_broker(self) -> None:
        self.broker.kill()
        self.broker.wait(timeout=10)

    def close(self) -> None:
        self.stack.close()


def spread_workspaces(shard_map: ShardMap, count: int) -> list[str]:
    """``count`` workspace ids, as evenly over the shards as their hashes allow (each shard
    gets ``count // shards`` or one more)."""
    per = {k: [] for k in range(len(shard_map))}  # type: dict[int, list[str]]
    i = 0
    target = -(-count // len(shard_map))
    while sum(len(v) for v in per.values()) < count:
        ws = f"sim-ws-{i}"
        k = shard_map.shard_of(ws)
        if len(per[k]) < target:
            per[k].append(ws)
        i += 1
    return [ws for k in sorted(per) for ws in per[k]][:count]


def _client(n: int, rnd: Round, lock: threading.Lock) -> None:
    """One client: every workspace's jobs, all four stages, in its own order (overlapping
    the others: the same requests, collapsed by their deterministic ids)."""
    from onceflow.demo.stages import flow

    rng = random.Random(n)
    work = [(ws, j) for ws in rnd.workspaces for j in range(rnd.opts.jobs)]
    rng.shuffle(work)
    for ws, j in work:
        job = f"{ws}-job-{j}"  # unique over workspaces: the stand-in counts per job/column
        for stage, branch, data in (
            ("evaluate", "main", {"columns": COLUMNS}),
            ("enrich", "", {"origin": "home", "destination": f"office-{j}"}),
            ("tailor", "main", {"sections": SECTIONS[:2]}),
            ("radar", "", {"page": f"radar-{j % 8}"}),
        ):
            _enqueue(flow, stage, ws, job, branch, data, rnd.opts.timeout)
            with lock:
                rnd.enqueued += 1


def _enqueue(flow: Any, stage: str, ws: str, job: str, branch: str, data: Any,
             timeout: float) -> None:  # fmt: skip
    """As a client does: an enqueue whose shard is down is tried again (the id is
    deterministic, so a retry after a lost answer collapses onto the row)."""
    from onceflow.errors import DatabaseUnavailable

    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            flow.enqueue(stage, ws, job, branch, data)
            return
        except DatabaseUnavailable:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)  # a client's backoff between tries, not a wait for a condition
            delay = min(1.0, delay * 2)


def _finished(urls: list[str]) -> int:
    total = 0
    for url in urls:
        with contextlib.suppress(psycopg.OperationalError):
            total += int(
                _one(
                    url,
                    "SELECT count(*) FROM workspace_process_requests"
                    " WHERE status IN ('succeeded', 'dead', 'cancelled')",
                )
            )
    return total


def run_round(servers: Servers, opts: Options) -> tuple[Round, dict[str, Any]]:
    """One run of the workload on ``opts.shards`` shards; returns it and its checks."""
    from onceflow.demo.stages import RUN_ENV
    from onceflow.settings import get_settings

    server = os.environ.get("ONCEFLOW_SIM_POSTGRES_URL", DEFAULT_POSTGRES)
    procs: list[Proc] = []
    llm = StandIn("llm", latency=0.02, api_key=servers.api_key).start()
    with contextlib.ExitStack() as stack:
        stack.callback(llm.stop)
        shared = opts.shards - (1 if opts.restart else 0)
        urls = stack.enter_context(shard_databases(server, shared))
        if opts.restart:
            private = servers.private_postgres()
            urls = [*stack.enter_context(shard_databases(private.admin_url, 1)), *urls]
        shard_map = ShardMap.from_urls(urls)
        for index, url in enumerate(urls):  # as `onceflow migrate` does under this map
            register_shard(url, index, shard_map)
        rnd = Round(opts, urls, shard_map, llm, spread_workspaces(shard_map, opts.workspaces))
        # One broker prefix per Servers: this process's Celery app reads it once, when it
        # first publishes, and keeps it (a new prefix per round would publish the wake-ups
        # of later rounds where no worker listens). The broker is ours alone: emptied here.
        run_id = servers.run_id
        servers.flush_broker()
        env = {
            "ONCEFLOW_DATABASE_URLS": ",".join(urls),
            "ONCEFLOW_DATABASE_URL": urls[-1],
            "ONCEFLOW_REDIS_URL": servers.cluster.url,
            "ONCEFLOW_BROKER_URL": servers.broker_url,
            RUN_ENV: run_id,
            "ONCEFLOW_APP": APP,
            "ONCEFLOW_DEMO_LLM_URLS": llm.url,
            "ONCEFLOW_DEMO_MAPS_URL": servers.maps.url,
            "ONCEFLOW_LLM_API_KEY": servers.api_key,
            "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.5",
            "ONCEFLOW_REDISPATCH_AFTER_SECONDS": "5",
            "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        get_settings.cache_clear()
        _fresh_queue()  # this round's shards, not the last round's

        @stack.callback
        def _restore() -> None:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            get_settings.cache_clear()
            _fresh_queue()

        @stack.callback
        def _stop() -> None:
            for proc in procs:
                proc.stop()

        tag = f"{opts.shards}s-{secrets.token_hex(3)}"
        for i in range(opts.workers):
            for wc in ("llm", "fallback"):
                args = ["worker", "--app", APP, "--worker-class", wc, "--concurrency", "2",
                        "-n", f"sim-{wc}-{i}-{tag}@%h"]  # fmt: skip
                procs.append(Proc(args, servers.log_dir / f"w-{wc}-{i}-{tag}.log", env=env))
        procs.append(Proc(["beat", "--app", APP], servers.log_dir / f"beat-{tag}.log", env=env))
        for proc in procs[:-1]:
            proc.wait_log(" ready.", timeout=90)
        procs[-1].wait_log("beat: Starting", timeout=60)
        lock = threading.Lock()
        threads = [threading.Thread(target=_client, args=(n, rnd, lock), daemon=True)
                   for n in range(opts.clients)]  # fmt: skip
        rnd.started = time.monotonic()
        for t in threads:
            t.start()
        if opts.restart:
            _restart_mid_run(servers, rnd)
        for t in threads:
            t.join(timeout=opts.timeout)
        wait_for(lambda: _finished(urls) >= opts.expected(), timeout=opts.timeout,
                 what="every request finished")  # fmt: skip
        rnd.drained = time.monotonic()
        return rnd, check(rnd)
    raise AssertionError("unreachable")  # pragma: no cover


def _fresh_queue() -> None:
    """Make the demo Flow build its queue again from the settings now in force (it keeps
    one per process; each round names other databases)."""
    from onceflow.demo.stages import flow

    flow._queue = None


def _restart_mid_run(servers: Servers, rnd: Round) -> None:
    """Stop shard 0 (the private server) once work is under way; wait until every other
    shard that had work left finished some of it meanwhile (by its own clock); start shard 0
    again."""
    private = servers.private_postgres()
    wait_for(lambda: _finished(rnd.urls) >= rnd.opts.expected() // 8, timeout=rnd.opts.timeout,
             what="some requests finished before the stop")  # fmt: skip
    others = range(1, len(rnd.urls))
    stopped = {k: _one(rnd.urls[k], "SELECT now()") for k in others}
    rnd.left_at_stop = {k: int(_one(rnd.urls[k], UNFINISHED)) for k in others}
    down = time.monotonic()
    private.stop()

    def others_progressed() -> bool:
        return all(
            _one(rnd.urls[k], FINISHED_SINCE, (stopped[k],)) > 0
            for k in others
            if rnd.left_at_stop[k] > 0
        )

    def outage_over() -> bool:  # the fault lasts MIN_OUTAGE at least (3 claim retry windows)
        return time.monotonic() - down >= MIN_OUTAGE_SECONDS and others_progressed()

    wait_for(outage_over, timeout=rnd.opts.timeout, what="other shards finishing work")
    private.start()
    rnd.outage = round(time.monotonic() - down, 2)
    rnd.window = {k: (stopped[k], _one(rnd.urls[k], "SELECT now()")) for k in others}


#: The shortest outage of a restart round: longer than a worker's claim retry on a database
#: split by workspace (onceflow.tasks.runtime.SHARDED_CLAIM_RETRY_SECONDS), so the other
#: shards' progress is measured while wake-ups of the stopped one keep arriving.
MIN_OUTAGE_SECONDS = 3.0

UNFINISHED = """SELECT count(*) FROM workspace_process_requests
WHERE status NOT IN ('succeeded', 'dead', 'cancelled')"""
FINISHED_SINCE = "SELECT count(*) FROM workspace_process_requests WHERE finished_at > %s"


def check(rnd: Round) -> dict[str, Any]:
    """The invariants, per shard (see the module docstring)."""
    out: dict[str, Any] = {"shards": []}
    ids: list[str] = []
    for k, url in enumerate(rnd.urls):
        rows = _rows(url, "SELECT workspace_id, request_id, status FROM workspace_process_requests")
        ids += [r[1] for r in rows]
        misplaced = sum(1 for r in rows if rnd.shard_map.shard_of(r[0]) != k)
        not_done = sum(1 for r in rows if r[2] != "succeeded")
        gaps = int(_one(url, GAPS))
        ops = int(_one(url, "SELECT count(*) FROM workspace_sub_doc_ops WHERE clock IS NOT NULL"))
        reruns = int(_one(url, RERUNS))
        during = None
        if k in rnd.window:
            stop, back = rnd.window[k]
            during = int(
                _one(
                    url,
                    "SELECT count(*) FROM workspace_process_requests"
                    " WHERE finished_at > %s AND finished_at < %s",
                    (stop, back),
                )
            )
        out["shards"].append(
            {
                "rows": len(rows),
                "misplaced": misplaced,
                "not_succeeded": not_done,
                "ops": ops,
                "clock_gaps": gaps,
                "evaluate_reruns": reruns,
                "finished_while_0_down": during,
                "unfinished_when_0_stopped": rnd.left_at_stop.get(k),
            }
        )
    calls: dict[str, int] = rnd.llm.stats()["per_key"]
    cells = rnd.opts.workspaces * rnd.opts.jobs * len(COLUMNS)
    twice = {key: n for key, n in calls.items() if "/eval:" in key and n > 1}
    out.update(
        rows=len(ids),
        expected_rows=rnd.opts.expected(),
        duplicate_ids=len(ids) - len(set(ids)),
        cells=cells,
        llm_cells_called=sum(1 for key, n in calls.items() if "/eval:" in key and n >= 1),
        llm_cells_paid_twice=sum(1 for key, n in twice.items() if not _on_stopped(rnd, key)),
        # Cells of the stopped shard whose run lost its lease while their database was down
        # (the demo's stages lease 4 s): the run's fenced store is refused, the rescued run
        # pays again. Only the stopped shard's cells can be.
        llm_cells_paid_twice_on_stopped_shard=sum(1 for key in twice if _on_stopped(rnd, key)),
        enqueued=rnd.enqueued,
        outage_seconds=rnd.outage,
        seconds=round(rnd.seconds, 2),
        requests_per_second=round(rnd.opts.expected() / rnd.seconds, 1),
    )
    return out


# Runs of evaluate beyond each request's first (each pays at most one call per column).
RERUNS = """
SELECT coalesce(sum(attempts - 1), 0) FROM workspace_process_requests WHERE stage = 'evaluate'
"""

# Per sub-doc: the clocks of its applied ops must be exactly pruned_clock+1 … clock, once each.
GAPS = """
SELECT count(*) FROM workspace_sub_docs d
WHERE (SELECT count(DISTINCT o.clock) FROM workspace_sub_doc_ops o
       WHERE o.workspace_id = d.workspace_id AND o.sub_doc = d.sub_doc AND o.clock IS NOT NULL)
      <> d.clock - d.pruned_clock
   OR EXISTS (SELECT 1 FROM workspace_sub_doc_ops o
              WHERE o.workspace_id = d.workspace_id AND o.sub_doc = d.sub_doc
                AND (o.clock <= d.pruned_clock OR o.clock > d.clock))
"""


def _on_stopped(rnd: Round, key: str) -> bool:
    """Whether a stand-in key (``<ws>-job-<j>/eval:<column>``) is a cell of the shard that
    was stopped (shard 0, only in a restart round)."""
    return rnd.opts.restart and rnd.shard_map.shard_of(key.split("-job-")[0]) == 0


def passes(result: dict[str, Any]) -> bool:
    """Every invariant of :func:`check` holds."""
    shards = result["shards"]
    return (
        result["rows"] == result["expected_rows"]
        and result["duplicate_ids"] == 0
        and result["llm_cells_called"] == result["cells"]
        and result["llm_cells_paid_twice"] == 0
        and all(
            s["misplaced"] == 0 and s["not_succeeded"] == 0 and s["clock_gaps"] == 0 for s in shards
        )
        and all(  # every other shard that had work left did some while shard 0 was down
            s["finished_while_0_down"] is None
            or s["unfinished_when_0_stopped"] == 0
            or s["finished_while_0_down"] > 0
            for s in shards[1:]
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__)
    parser.add_argument("--shards", default="1,2,4", help="shard counts, interleaved per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workspaces", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="worker processes per class")
    parser.add_argument("--restart", action="store_true", help="also one round with a restart")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.shards.split(",")]
    servers = Servers()
    results: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    ok = True
    try:
        for r in range(args.rounds):
            for n in counts:
                opts = Options(shards=n, workspaces=args.workspaces, jobs=args.jobs,
                               clients=args.clients, workers=args.workers)  # fmt: skip
                _, result = run_round(servers, opts)
                ok = ok and passes(result)
                results[n].append(result)
                print(
                    f"round {r + 1} shards {n}: {result['requests_per_second']} req/s,"
                    f" invariants {'hold' if passes(result) else 'BROKEN'}",
                    file=sys.stderr,
                )
        if args.restart:
            opts = Options(shards=max(2, max(counts)), workspaces=args.workspaces,
                           jobs=args.jobs, clients=args.clients, workers=args.workers,
                           restart=True)  # fmt: skip
            _, restarted = run_round(servers, opts)
            ok = ok and passes(restarted)
    finally:
        servers.close()
    base = results[counts[0]]
    summary = {
        str(n): {
            "median_rps": statistics.median(r["requests_per_second"] for r in results[n]),
            "median_ratio_to_first": statistics.median(
                r["requests_per_second"] / b["requests_per_second"]
                for r, b in zip(results[n], base, strict=True)
            ),
        }
        for n in counts
    }
    report = {"summary": summary, "rounds": results, "cores": os.cpu_count(), "ok": ok}
    if args.restart:
        report["restart"] = restarted
    print(json.dumps(report, indent=2, default=str) if args.json else json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
