"""Layer-2 compute-lock benchmark: onceflow's lock beside its floor and its peers, one run.

    .venv/bin/python bench/lock_bench.py [--quick] [--json]

Needs ``python-redis-lock`` for one comparison row. It is a benchmark-only
install (``.venv/bin/pip install python-redis-lock``), not a dependency of
onceflow. Redis is a private ``redis-server`` (or ``valkey-server``) that the
script starts on a free loopback port with no persistence, so other clients
of a shared server cannot disturb the timings or the command counts. The SQL
rows use Postgres from ``ONCEFLOW_BENCH_DATABASE_URL`` (default
``postgresql+psycopg://root@127.0.0.1:5432/postgres``), used only as the admin
URL: the run creates ``onceflow_lockbench_<random>``, migrates it and drops it.

What is measured:

1. Uncontended acquire+release pairs/s from one client, on one connection, each
   contender run in blocks of ``--pairs`` with the blocks interleaved round-robin
   (so outside load hits every contender alike):
   the raw floor (``SET key token NX PX`` + ``EVALSHA`` of the same release
   script, by hand); onceflow's ``RedisLockBackend.acquire`` + ``LockHandle.release``;
   redis-py's ``Lock`` (``client.lock(name, timeout=60)``, one object per pair,
   as ``with client.lock(...)`` makes one); python-redis-lock's ``Lock``
   (``expire=60``). The SQL backend beside its own floor (the same two
   statements by hand in raw psycopg, autocommit).
2. The Redis cost of a pre-flight hit, and of the other paths: round trips
   counted client-side (a connection class that counts every packet sent, so a
   pipeline is one) and commands counted server-side (``INFO stats``
   ``total_commands_processed``), per ``compute_once`` call.
3. Provider calls per cell for 1, 4, 16 and 64 concurrent callers per cell (4
   cells; callers are processes, forked from a preloaded forkserver, up to 64,
   then threads in them), with ``compute_once`` and with plain cache-aside
   (check, call, store) without a lock. The provider is the test suite's
   stand-in HTTP server, which counts every request and answers after 200 ms of
   simulated latency.

Progress goes to stderr; the Markdown report (or ``--json``) to stdout.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402

from bench.harness import (  # noqa: E402
    admin_url,
    bench_database,
    command_line,
    interleaved,
    loadavg,
    log,
    machine_info,
    private_redis,
    redis_version,
    table,
)

try:
    import redis_lock  # python-redis-lock: a benchmark-only install
except ImportError:  # pragma: no cover
    raise SystemExit("needs python-redis-lock: .venv/bin/pip install python-redis-lock") from None
from sqlalchemy import make_url  # noqa: E402

from onceflow.db import make_engine  # noqa: E402
from onceflow.locks import RedisLockBackend, SqlLockBackend, compute_once  # noqa: E402
from onceflow.locks.sql_lock import ACQUIRE, RELEASE  # noqa: E402

PROVIDER_LATENCY = 0.2


# ---------------------------------------------------------------- servers


# ---------------------------------------------------------------- 1. pairs/s


#: The floor's release: the classic compare-and-delete (onceflow's ``release.lua`` also
#: leaves a mark, so that a resent release answers as the first did).
FLOOR_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


def redis_contenders(url: str) -> dict[str, Callable[[], None]]:
    client = redis.Redis.from_url(url, single_connection_client=True)  # one socket for all
    sha = client.script_load(FLOOR_RELEASE_LUA)
    onceflow = RedisLockBackend(client)
    ws = "bench"

    def floor() -> None:
        token = secrets.token_hex(16)
        assert client.set("onceflow:{bench}:lock:floor:t", token, nx=True, px=60_000)
        assert client.evalsha(sha, 1, "onceflow:{bench}:lock:floor:t", token) == 1

    def ours() -> None:
        handle = onceflow.acquire(ws, "ours", "t", 60)
        assert handle is not None
        assert handle.release()

    def redis_py() -> None:
        lock = client.lock("redis-py-lock", timeout=60)
        assert lock.acquire(blocking=False)
        lock.release()

    def python_redis_lock() -> None:
        lock = redis_lock.Lock(client, "python-redis-lock", expire=60)
        assert lock.acquire(blocking=False)
        lock.release()

    return {
        "raw floor: SET NX PX + EVALSHA release": floor,
        "onceflow RedisLockBackend": ours,
        "redis-py Lock": redis_py,
        "python-redis-lock Lock": python_redis_lock,
    }


def sql_contenders(db_url: str) -> dict[str, Callable[[], None]]:
    engine = make_engine(db_url, pool_size=1)
    onceflow = SqlLockBackend(engine)
    conn = psycopg.connect(
        make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )
    cell = {"workspace_id": "bench", "job_id": "floor", "task": "t", "ttl": 60.0}

    def floor() -> None:
        token = secrets.token_hex(16)
        assert conn.execute(ACQUIRE, {**cell, "token": token}).fetchone()
        assert conn.execute(RELEASE, {**cell, "token": token}).fetchone()

    def ours() -> None:
        handle = onceflow.acquire("bench", "ours", "t", 60)
        assert handle is not None
        assert handle.release()

    return {
        "SQL floor: the same two statements, raw psycopg": floor,
        "onceflow SqlLockBackend": ours,
    }


# ---------------------------------------------------------------- 2. round trips per path


class _Counting(redis.Connection):
    sent = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _Counting.sent += 1  # one packet: one command, or one whole pipeline
        super().send_packed_command(command, check_health)


def round_trips(url: str, n: int) -> dict[str, Any]:
    pool = redis.ConnectionPool.from_url(url, connection_class=_Counting)
    be = RedisLockBackend(redis.Redis(connection_pool=pool))
    probe = redis.Redis.from_url(url)
    be.acquire("rt", "warm", "up", 1).release()  # type: ignore[union-attr]  # eviction check

    def commands() -> int:
        return int(probe.info("stats")["total_commands_processed"])

    info_cost = -commands() + commands()
    stored: dict[str, str] = {}

    def run(label: str, make_check: Callable[[int], Callable[[], str | None]]) -> dict[str, Any]:
        be.flush_counters()
        before_sent, before_cmds = _Counting.sent, commands()
        start = time.perf_counter()
        for i in range(n):
            compute_once(
                "rt", f"job-{label}-{i}", "t", check=make_check(i), compute=lambda: "v",
                store=lambda v, i=i: stored.__setitem__(f"{label}-{i}", v), backend=be,
                watchdog=False,
            )  # fmt: skip
        elapsed = time.perf_counter() - start
        sent = _Counting.sent - before_sent
        cmds = commands() - before_cmds - info_cost
        return {"round_trips": sent / n, "commands": cmds / n, "us_per_call": elapsed / n * 1e6}

    hit = run("preflight", lambda i: lambda: "stored")

    def second_check_hits(i: int) -> Callable[[], str | None]:
        calls = [0]

        def check() -> str | None:
            calls[0] += 1
            return "stored" if calls[0] > 1 else None

        return check

    double = run("double", second_check_hits)
    computed = run("computed", lambda i: lambda: None)
    start = time.perf_counter()
    for _ in range(n):
        (lambda: "stored")()
    bare = (time.perf_counter() - start) / n * 1e6
    return {"preflight": hit, "double_check": double, "computed": computed, "bare_check_us": bare}


# ---------------------------------------------------------------- 3. provider calls per cell


def provider_calls(redis_url: str, per_cell: list[int], cells: int) -> list[dict[str, Any]]:
    from tests.integration import lock_callers
    from tests.integration.standin import StandIn

    ctx = lock_callers.context()
    standin = StandIn().start()
    rows = []
    try:
        for callers in per_cell:
            for without_lock in (True, False):
                ws = f"bench-{secrets.token_hex(3)}"
                total = callers * cells
                procs = min(64, total)
                plans = []
                for p in range(procs):
                    mine = [(f"job-{k % cells}", "eval") for k in range(p, total, procs)]
                    plans.append({
                        "kind": "redis", "url": redis_url, "standin": standin.url,
                        "workspace_id": ws, "cells": mine, "hold": PROVIDER_LATENCY,
                        "without_lock": without_lock,
                    })  # fmt: skip
                start = time.perf_counter()
                fleet = lock_callers.Fleet(ctx, plans)
                try:
                    fleet.collect(timeout=300)
                finally:
                    fleet.stop()
                wall = time.perf_counter() - start
                names = [lock_callers.cell_name(ws, f"job-{k}", "eval") for k in range(cells)]
                calls = [standin.calls[n] for n in names]
                rows.append({
                    "callers_per_cell": callers, "lock": not without_lock,
                    "calls_per_cell": sum(calls) / cells, "max_calls_per_cell": max(calls),
                    "processes": procs, "wall_s": wall,
                })  # fmt: skip
                log(f"  {callers} per cell, lock={not without_lock}: {calls}")
    finally:
        standin.stop()
    return rows


# ---------------------------------------------------------------- report


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    out = [
        f"Run: {m['date']}; {m['nproc']} CPUs ({m['cpu']}), {m['os']}; Redis {m['redis_server']} "
        f"(private, no persistence); Python {m['python']}, redis-py {m['redis_py']}, "
        f"python-redis-lock {m['python_redis_lock']}; load average {m['loadavg']} at the start, "
        f"{res['loadavg_end']} at the end.",
        "",
        "#### 1. Uncontended acquire + release, one client, one connection",
        "",
    ]
    pairs = res["pairs"]
    floor = pairs["raw floor: SET NX PX + EVALSHA release"]["per_s"]
    sql = res["sql_pairs"]
    sql_floor = sql["SQL floor: the same two statements, raw psycopg"]["per_s"]
    out += table(
        ["Contender", "pairs/s", "/ raw floor"],
        [[name, f"{r['per_s']:,.0f}", f"{r['per_s'] / floor:.2f}"] for name, r in pairs.items()]
        + [
            [name, f"{r['per_s']:,.0f}", f"{r['per_s'] / sql_floor:.2f} of the SQL floor"]
            for name, r in sql.items()
        ],
    )
    rt = res["round_trips"]
    out += [
        "",
        f"#### 2. Redis cost per `compute_once` call ({res['n_round_trips']:,} calls per path)",
        "",
    ]
    out += table(
        ["Path", "Redis round trips / call", "Redis commands / call", "µs / call"],
        [
            [path, f"{r['round_trips']:.3f}", f"{r['commands']:.3f}", f"{r['us_per_call']:.1f}"]
            for path, r in ((p, rt[p]) for p in ("preflight", "double_check", "computed"))
        ]
        + [["(calling `check()` alone)", "0", "0", f"{rt['bare_check_us']:.2f}"]],
    )
    out += [
        "",
        f"#### 3. Provider calls per cell ({res['cells']} cells, {PROVIDER_LATENCY * 1000:.0f} ms "
        "provider latency, callers released together by a barrier)",
        "",
    ]
    by = {(r["callers_per_cell"], r["lock"]): r for r in res["provider"]}
    rows = []
    for c in sorted({r["callers_per_cell"] for r in res["provider"]}):
        a, b = by[(c, False)], by[(c, True)]
        rows.append([
            c, a["processes"], f"{a['calls_per_cell']:.2f} ({a['max_calls_per_cell']})",
            f"{b['calls_per_cell']:.2f} ({b['max_calls_per_cell']})",
            f"{a['wall_s']:.2f} / {b['wall_s']:.2f}",
        ])  # fmt: skip
    header = ["Callers per cell", "Processes", "Without lock: calls / cell (max)",
              "compute_once: calls / cell (max)", "Wall s without / with"]  # fmt: skip
    out += table(header, rows, align="rrrrr")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = command_line(__doc__, "print the raw numbers")
    parser.add_argument("--quick", action="store_true", help="fewer pairs and calls")
    parser.add_argument("--pairs", type=int, default=None, help="pairs per block")
    args = parser.parse_args(argv)
    pairs = args.pairs or (500 if args.quick else 2000)
    rounds = 4 if args.quick else 10
    n = 2000 if args.quick else 10_000
    res: dict[str, Any] = {"cells": 4, "n_round_trips": n}
    with (
        private_redis() as url,
        bench_database(admin_url(), prefix="onceflow_lockbench", quiet=True) as db_url,
    ):
        res["machine"] = machine_info(
            redis_server=redis_version(url),
            redis_py=redis.__version__,
            python_redis_lock=redis_lock.__version__,
            loadavg=loadavg(" / "),
        )
        log(f"1. pairs/s: {rounds} rounds x {pairs} pairs per contender")
        res["pairs"] = interleaved(redis_contenders(url), pairs, rounds)
        res["sql_pairs"] = interleaved(sql_contenders(db_url), max(100, pairs // 4), rounds)
        log("2. round trips per path")
        res["round_trips"] = round_trips(url, n)
        log("3. provider calls per cell")
        res["provider"] = provider_calls(url, [1, 4, 16, 64], res["cells"])
        res["loadavg_end"] = loadavg(" / ")
    print(json.dumps(res, indent=2) if args.json else render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
