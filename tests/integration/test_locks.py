"""Layer 2, the compute lock, on real Redis, real Postgres and real processes.

The stand-in provider (:mod:`tests.integration.standin`) counts every request it
receives; that count, not onceflow's counters, is what "paid once" is checked
against. Tests wait for conditions with deadlines, never for time to pass, and
assert no timing thresholds. Each test runs on the Redis backend and, where it
applies, on the SQL backend (``compute_locks`` + LISTEN/NOTIFY). Each test of
``compute_once`` runs on both APIs (``api``: ``compute_once``, and ``acompute_once``
through :func:`~tests.integration.lock_callers.run_compute_once`); the SQL backend
is sync-only, so it runs the sync API alone.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from onceflow.errors import InvalidRequest, LeaseLost, LockLost, LockUnavailable
from onceflow.keys import lock_key
from onceflow.locks import (
    LockBackend,
    Locked,
    Path,
    RedisLockBackend,
    SqlLockBackend,
    calls_saved,
    compute_once,
    redis_client,
)
from onceflow.locks.counters import Counters
from onceflow.settings import Settings
from tests.acceptance.procs import wait_for
from tests.integration import lock_callers
from tests.integration.lock_callers import APIS, Fleet, call, cell_name, outcomes, run_compute_once
from tests.integration.standin import StandIn, call_provider, store_get, store_put

BACKENDS = ["redis", "sql"]
SERVED_WITHOUT_CALL = {"preflight", "double_check", "waited"}
#: (backend, API) pairs: the SQL lock backend has no async API.
BACKEND_APIS = [(kind, api) for kind in BACKENDS for api in APIS if (kind, api) != ("sql", "async")]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``api`` runs on both APIs; with ``kind`` too, on every backend of each."""
    if "api" not in metafunc.fixturenames:
        return
    if "kind" in metafunc.fixturenames:
        ids = [f"{kind}-{api}" for kind, api in BACKEND_APIS]
        metafunc.parametrize(("kind", "api"), BACKEND_APIS, ids=ids)
    else:
        metafunc.parametrize("api", APIS)


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ctx() -> BaseContext:
    return lock_callers.context()


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture()
def url(kind: str, redis_url: str, database_url: str, engine: Engine) -> str:
    if kind == "redis":
        return redis_url
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE compute_locks"))
    return database_url


@pytest.fixture()
def backend(kind: str, url: str) -> LockBackend:
    return lock_callers.make_backend(kind, url, pool_size=4)


@pytest.fixture()
def ws() -> str:
    return f"ws-{secrets.token_hex(4)}"


def plan(
    kind: str, url: str, standin: StandIn, ws: str, cells: list[Any], **kw: Any
) -> dict[str, Any]:
    return {
        "kind": kind,
        "url": url,
        "standin": standin.url,
        "workspace_id": ws,
        "cells": cells,
        **kw,
    }


def summed(reports: list[dict[str, Any]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for r in reports:
        total.update(r["counters"])
    return total


def counters_of(backend: LockBackend, ws: str, reports: list[dict[str, Any]]) -> Counter[str]:
    """Redis: the workspace hash (every process flushed). SQL: the processes' own snapshots."""
    if backend.name == "redis":
        return Counter(backend.workspace_counters(ws))
    return summed(reports)


# ------------------------------------------------------------------ races of processes


def test_64_callers_race_one_cell(
    kind: str,
    api: str,
    url: str,
    backend: LockBackend,
    standin: StandIn,
    ctx: BaseContext,
    ws: str,
) -> None:
    # Redis: 64 processes of one caller each. SQL: 8 processes x 8 threads, because 64
    # processes x (pool + LISTEN connection) would pass the shared server's max_connections.
    procs, threads = (64, 1) if kind == "redis" else (8, 8)
    cell = ("job-1", "eval:score")
    one = plan(kind, url, standin, ws, [cell] * threads, hold=0.5, api=api)
    fleet = Fleet(ctx, [one] * procs)
    try:
        reports = fleet.collect()
    finally:
        fleet.stop()
    results = outcomes(reports)
    name = cell_name(ws, *cell)
    assert len(results) == 64
    assert {r["api"] for r in results} == {api}
    assert standin.calls[name] == 1  # the provider's own count
    assert standin.store_writes[name] == 1
    assert {r["value"] for r in results} == {f"answer-{name}-1"}
    paths = Counter(r["path"] for r in results)
    assert paths["computed"] == 1
    assert sum(paths[p] for p in SERVED_WITHOUT_CALL) == 63, paths
    counts = counters_of(backend, ws, reports)
    assert counts["computes"] == 1
    assert calls_saved(counts) == 63, counts
    assert counts["preflight_hits"] == paths["preflight"]
    assert counts["double_check_hits"] == paths["double_check"]


def test_16_cells_times_16_callers(
    kind: str,
    api: str,
    url: str,
    backend: LockBackend,
    standin: StandIn,
    ctx: BaseContext,
    ws: str,
) -> None:
    cells = [(f"job-{i}", "commute") for i in range(16)]
    if kind == "redis":  # 64 processes x 4 threads; each cell gets one thread in 16 processes
        # async: half the processes of each cell are async: its lock is raced from both APIs
        apis = ["sync", api]
        plans = [
            plan(
                kind, url, standin, ws, [cells[(p * 4 + t) % 16] for t in range(4)], hold=0.3,
                api=apis[(p // 4) % 2],
            )
            for p in range(64)
        ]  # fmt: skip
    else:  # 8 processes x 32 threads: every process races every cell twice
        plans = [plan(kind, url, standin, ws, cells * 2, hold=0.3) for _ in range(8)]
    fleet = Fleet(ctx, plans)
    try:
        results = outcomes(fleet.collect())
    finally:
        fleet.stop()
    assert len(results) == 256
    names = [cell_name(ws, *c) for c in cells]
    assert sum(standin.calls[n] for n in names) == 16
    assert all(standin.calls[n] == 1 for n in names)
    for n in names:
        mine = [r for r in results if r["cell"] == n]
        assert len(mine) == 16
        assert {r["api"] for r in mine} == {"sync", api}
        assert {r["value"] for r in mine} == {f"answer-{n}-1"}
        assert Counter(r["path"] for r in mine)["computed"] == 1


def test_holder_killed_mid_call_next_caller_computes_after_the_ttl(
    kind: str,
    api: str,
    url: str,
    backend: LockBackend,
    standin: StandIn,
    ctx: BaseContext,
    ws: str,
) -> None:
    # The holder is a sync caller; with api="async" its waiters, in other processes, are async.
    cell = ("job-k", "eval:summary")
    name = cell_name(ws, *cell)
    standin.block_next(name)  # the holder's call hangs at the provider until it is killed
    holder = Fleet(ctx, [plan(kind, url, standin, ws, [cell], ttl=1.0)], barrier=False)
    waiters: Fleet | None = None
    try:
        wait_for(lambda: standin.calls[name] == 1, what="the holder's provider call")
        waiting = plan(kind, url, standin, ws, [cell], ttl=1.0, api=api)
        waiters = Fleet(ctx, [waiting] * 4, barrier=False)
        wait_for(lambda: standin.marks[name] >= 4, what="4 callers waiting on the holder")
        os.kill(holder.processes[0].pid or 0, signal.SIGKILL)
        holder.processes[0].join(timeout=10)
        reports = waiters.collect(timeout=60)
    finally:
        standin.unblock(name)
        holder.stop()
        if waiters is not None:
            waiters.stop()
    results = outcomes(reports)
    assert {r["api"] for r in results} == {api}
    assert standin.calls[name] == 2  # the killed call, and exactly one more
    assert {r["value"] for r in results} == {f"answer-{name}-2"}
    paths = Counter(r["path"] for r in results)
    assert paths["computed"] == 1 and paths["waited"] + paths["double_check"] == 3, paths
    leader = next(r for r in results if r["path"] == "computed")
    assert leader["rounds"] >= 2  # it waited out the dead holder's TTL, then ran again
    assert counters_of(backend, ws, reports)["wait_timeouts"] >= 1
    assert backend.owner_token(ws, *cell) is None


def test_expired_then_reacquired_lock_is_not_deleted_by_the_old_holder(
    backend: LockBackend, ws: str, redis_url: str
) -> None:
    cell = ("job-e", "eval:x")
    old = backend.acquire(ws, *cell, ttl=0.2)
    assert old is not None
    wait_for(lambda: backend.owner_token(ws, *cell) is None, what="the old lock to expire")
    new = backend.acquire(ws, *cell, ttl=30)  # the same backend instance, as a shared client
    assert new is not None and new.token != old.token
    released: list[bool] = []
    t = threading.Thread(target=lambda: released.append(old.release()))  # another thread
    t.start()
    t.join(timeout=30)
    assert released == [False]
    assert old.lost and not new.lost
    assert old.extend() is False
    assert backend.owner_token(ws, *cell) == new.token
    if backend.name == "redis":  # the key's value itself, read with a separate client
        raw = redis.Redis.from_url(redis_url).get(lock_key(ws, *cell))
        assert raw == new.token.encode()
    with pytest.raises(LockLost):
        old.ensure_held()
    assert new.release() is True
    assert backend.owner_token(ws, *cell) is None


# ------------------------------------------------------------------ watchdog and lost locks


def test_watchdog_keeps_a_3x_ttl_calls_lock(
    backend: LockBackend, api: str, standin: StandIn, ws: str
) -> None:
    cell = ("job-w", "eval:long")
    name = cell_name(ws, *cell)
    seen: dict[str, Any] = {}

    def compute() -> str:
        value = call_provider(standin.url, name, hold=1.5)  # 3 x the 0.5 s TTL
        seen["owner"] = backend.owner_token(ws, *cell)
        seen["other"] = run_compute_once(
            api, ws, *cell, check=lambda: None, compute=lambda: "never", store=lambda v: None,
            wait=False, backend=backend,
        )  # fmt: skip
        return value

    out = run_compute_once(
        api, ws, *cell, check=lambda: store_get(standin.url, name), compute=compute,
        store=lambda v: store_put(standin.url, name, v), ttl=0.5, watchdog=True, backend=backend,
    )  # fmt: skip
    assert out.path is Path.COMPUTED
    assert seen["owner"] is not None  # still held after 3 TTLs
    assert isinstance(seen["other"], Locked) and seen["other"].locked
    assert standin.calls[name] == 1
    assert backend.counters.snapshot(ws)["locks_lost"] == 0


def test_without_watchdog_a_long_call_loses_its_lock_and_it_is_counted(
    backend: LockBackend, api: str, standin: StandIn, ws: str
) -> None:
    cell = ("job-nw", "eval:long")
    name = cell_name(ws, *cell)

    def compute() -> str:
        value = call_provider(standin.url, name, hold=1.5)  # 3 x the 0.5 s TTL
        wait_for(lambda: backend.owner_token(ws, *cell) is None, what="the lock to expire")
        return value

    out = run_compute_once(
        api, ws, *cell, check=lambda: store_get(standin.url, name), compute=compute,
        store=lambda v: store_put(standin.url, name, v), ttl=0.5, watchdog=False, backend=backend,
    )  # fmt: skip
    assert out.path is Path.LOCK_LOST
    assert out.value == f"answer-{name}-1"  # still stored and returned: nobody else had one
    assert store_get(standin.url, name) == out.value
    backend.flush_counters()
    assert backend.counters.snapshot(ws)["locks_lost"] == 1
    if backend.name == "redis":
        assert backend.workspace_counters(ws)["locks_lost"] == 1


def test_watchdog_flags_a_lock_taken_from_it(backend: LockBackend, ws: str, engine: Engine) -> None:
    cell = ("job-s", "eval:x")
    handle = backend.acquire(ws, *cell, ttl=0.3, watchdog=True)
    assert handle is not None
    if isinstance(backend, RedisLockBackend):
        backend.client.delete(lock_key(ws, *cell))  # e.g. evicted, or a failover lost it
    else:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM compute_locks WHERE workspace_id = :ws"), {"ws": ws})
    wait_for(lambda: handle.lost, what="the watchdog to notice")
    with pytest.raises(LockLost):
        handle.ensure_held()
    assert backend.counters.snapshot(ws)["locks_lost"] == 1
    assert handle.release() is False
    assert backend.counters.snapshot(ws)["locks_lost"] == 1  # counted once


def test_a_lost_lock_is_counted_before_anyone_sees_it_lost(backend: LockBackend, ws: str) -> None:
    """The watchdog thread marks a handle lost while its caller may read ``lost`` and the
    counters at once: the count must come first (a CI run once read ``lost`` True, 0 counted)."""
    handle = backend.acquire(ws, "job-s", "eval:order", ttl=5)
    assert handle is not None
    seen: list[bool] = []

    class Watching(Counters):
        def incr(self, workspace_id: str, name: str, n: int = 1) -> None:
            if name == "locks_lost":
                seen.append(handle.lost)  # what a reader could see before the count lands
            super().incr(workspace_id, name, n)

    backend.counters = Watching()
    handle.mark_lost("taken in a test")
    handle.mark_lost("taken again")  # counted once
    assert seen == [False]
    assert handle.lost and backend.counters.snapshot(ws)["locks_lost"] == 1


# ------------------------------------------------------------------ waking on the broadcast


def test_waiters_wake_on_the_broadcast_before_the_ttl(
    kind: str,
    api: str,
    url: str,
    backend: LockBackend,
    standin: StandIn,
    ctx: BaseContext,
    ws: str,
    record_property: Callable[[str, object], None],
) -> None:
    # The leader is a sync caller; with api="async" the 4 waiters (other processes) are
    # async: one lock per cell across the APIs, and the sync leader's broadcast wakes them.
    cell = ("job-b", "eval:fit")
    name = cell_name(ws, *cell)
    standin.block_next(name)
    leader = Fleet(ctx, [plan(kind, url, standin, ws, [cell], ttl=60)], barrier=False)
    waiters: Fleet | None = None
    try:
        wait_for(lambda: standin.calls[name] == 1, what="the leader's provider call")
        waiting = plan(kind, url, standin, ws, [cell], ttl=60, api=api)
        waiters = Fleet(ctx, [waiting] * 4, barrier=False)
        wait_for(lambda: standin.marks[name] >= 4, what="4 callers waiting")
        released_at = time.monotonic()
        standin.unblock(name)
        reports = waiters.collect(timeout=60) + leader.collect(timeout=60)
    finally:
        standin.unblock(name)
        leader.stop()
        if waiters is not None:
            waiters.stop()
    results = outcomes(reports)
    served = [r for r in results if r["path"] == "waited"]
    assert len(served) == 4
    assert {r["api"] for r in served} == {api}
    assert all(r["served_by"] == "broadcast" for r in served), served
    latencies = sorted(round((r["served_at"] - released_at) * 1000, 1) for r in served)
    record_property("wake_latency_ms", latencies)
    print(f"\n{kind}-{api}: waiters served {latencies} ms after the provider answered (TTL 60 s)")
    assert standin.calls[name] == 1
    assert counters_of(backend, ws, reports)["wait_timeouts"] == 0


def test_leader_error_is_not_shared_one_waiter_becomes_the_next_leader(
    backend: LockBackend, api: str, standin: StandIn, ws: str
) -> None:
    cell = ("job-f", "eval:flaky")
    name = cell_name(ws, *cell)
    standin.block_next(name)
    standin.fail_next(name)
    errors: list[BaseException] = []

    def leader() -> None:
        try:
            call(backend, standin.url, ws, cell, api=api)
        except BaseException as exc:
            errors.append(exc)

    results: list[dict[str, Any]] = []
    lead = threading.Thread(target=leader)
    lead.start()
    wait_for(lambda: standin.calls[name] == 1, what="the leader's call")
    waiters = [
        threading.Thread(
            target=lambda: results.append(call(backend, standin.url, ws, cell, api=api))
        )
        for _ in range(3)
    ]
    for t in waiters:
        t.start()
    wait_for(lambda: standin.marks[name] >= 3, what="3 waiters")
    standin.unblock(name)
    for t in [lead, *waiters]:
        t.join(timeout=60)
    assert len(errors) == 1 and "provider answered 500" in str(errors[0])
    assert standin.calls[name] == 2  # the failed call, then exactly one new leader
    assert {r["value"] for r in results} == {f"answer-{name}-2"}
    assert Counter(r["path"] for r in results)["computed"] == 1
    assert backend.counters.snapshot(ws)["compute_errors"] == 1


class _Interrupted(BaseException):
    """Stands for KeyboardInterrupt / SystemExit / a worker's shutdown mid-call."""


def test_base_exception_in_compute_still_releases_and_wakes_waiters(
    backend: LockBackend, api: str, ws: str
) -> None:
    cell = ("job-i", "eval:x")
    sub = backend.subscribe(ws)
    try:

        def compute() -> str:
            raise _Interrupted

        with pytest.raises(_Interrupted):
            run_compute_once(
                api, ws, *cell, check=lambda: None, compute=compute, store=lambda v: None,
                backend=backend,
            )  # fmt: skip
        assert backend.owner_token(ws, *cell) is None
        message = sub.wait(30)
    finally:
        sub.close()
    assert message is not None
    assert message["kind"] == "lock_released" and message["ok"] is False
    assert (message["job_id"], message["task"]) == cell


# ------------------------------------------------------------------ Redis down, and back


def _redis_server_binary() -> str:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    from onceflow.embedded import _valkey_executable

    return str(_valkey_executable())


class PrivateRedis:
    """A redis-server of this test's own on a free port (the shared one is never stopped)."""

    def __init__(self, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        argv = [_redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", *self.extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis(port=self.port, socket_connect_timeout=1)
        wait_for(lambda: _pings(probe), what=f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture()
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis().start()
    yield server
    server.stop()


def _finishes(fn: Callable[[], Any], within: float) -> Any:
    """Run ``fn`` in a thread; fail if it hangs past ``within`` seconds (a hang detector)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), f"still running after {within}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_redis_stopped_lock_unavailable_then_back(
    private_redis: PrivateRedis, api: str, standin: StandIn, ws: str
) -> None:
    timeout = 2.0
    client = redis.Redis.from_url(
        private_redis.url, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    be = RedisLockBackend(client)
    assert call(be, standin.url, ws, ("job-r", "a"), api=api)["path"] == "computed"

    # A waiter blocked on the holder's broadcast when Redis dies must not hang.
    holder = be.acquire(ws, "job-r", "b", ttl=60)
    assert holder is not None
    waiting = threading.Event()
    box: dict[str, Any] = {}

    def waiter() -> None:
        try:
            run_compute_once(
                api, ws, "job-r", "b", check=lambda: None, compute=lambda: "x",
                store=lambda v: None, backend=be, on_wait=waiting.set,
            )  # fmt: skip
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    wait_for(waiting.is_set, what="the waiter to wait")
    private_redis.stop()
    t.join(timeout=10 * timeout)
    assert not t.is_alive(), "the waiter hung after Redis stopped"
    assert isinstance(box.get("error"), LockUnavailable)

    name = cell_name(ws, "job-r", "c")
    with pytest.raises(LockUnavailable):
        _finishes(lambda: call(be, standin.url, ws, ("job-r", "c"), api=api), within=10 * timeout)
    assert standin.calls[name] == 0  # policy "fail": no call was paid for without the lock

    private_redis.start()  # same port, empty data: work resumes on the same client
    result = _finishes(lambda: call(be, standin.url, ws, ("job-r", "c"), api=api), within=30)
    assert result["path"] == "computed"
    assert standin.calls[name] == 1


def test_policy_compute_without_the_lock_when_redis_is_down(
    private_redis: PrivateRedis, api: str, standin: StandIn, ws: str
) -> None:
    settings = Settings(lock_unavailable="compute")
    client = redis.Redis.from_url(private_redis.url, socket_timeout=2, socket_connect_timeout=2)
    be = RedisLockBackend(client, settings=settings)
    private_redis.stop()
    name = cell_name(ws, "job-p", "t")
    out = _finishes(
        lambda: run_compute_once(
            api, ws, "job-p", "t", check=lambda: store_get(standin.url, name),
            compute=lambda: call_provider(standin.url, name),
            store=lambda v: store_put(standin.url, name, v), backend=be,
        ),
        within=30,
    )  # fmt: skip
    assert out.path is Path.COMPUTED and out.with_lock is False
    assert standin.calls[name] == 1
    snap = be.counters.snapshot(ws)
    assert snap["computes_without_lock"] == 1 and snap["computes"] == 1


def test_sql_backend_postgres_unreachable_is_lock_unavailable(ws: str) -> None:
    be = SqlLockBackend("postgresql+psycopg://root@127.0.0.1:1/none")
    with pytest.raises(LockUnavailable):
        _finishes(lambda: be.acquire(ws, "j", "t"), within=60)
    with pytest.raises(LockUnavailable):
        _finishes(lambda: be.subscribe(ws), within=60)


def test_eviction_policy_warning_and_config_refused(
    caplog: pytest.LogCaptureFixture, ws: str
) -> None:
    lru = PrivateRedis("--maxmemory-policy", "allkeys-lru").start()
    refused = PrivateRedis("--rename-command", "CONFIG", "").start()
    try:
        with caplog.at_level(logging.INFO, logger="onceflow.locks"):
            handle = RedisLockBackend(redis.Redis.from_url(lru.url)).acquire(ws, "j", "t")
            assert handle is not None and handle.release()
            assert any(
                r.levelno == logging.WARNING and "allkeys-lru" in r.getMessage()
                for r in caplog.records
            )
            caplog.clear()
            handle = RedisLockBackend(redis.Redis.from_url(refused.url)).acquire(ws, "j", "t")
            assert handle is not None and handle.release()  # works without CONFIG
            assert any("could not read" in r.getMessage() for r in caplog.records)
            assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    finally:
        lru.stop()
        refused.stop()


def test_a_preflight_hit_makes_no_redis_round_trip(
    private_redis: PrivateRedis, api: str, ws: str
) -> None:
    client = redis.Redis.from_url(private_redis.url)
    be = RedisLockBackend(client)
    probe = redis.Redis.from_url(private_redis.url)

    def processed() -> int:
        return int(probe.info("stats")["total_commands_processed"])

    baseline = -processed() + processed()  # what reading the figure itself adds
    before = processed()
    calls = 1000 if api == "sync" else 200  # async: an event loop each (asyncio.run)
    for _ in range(calls):  # async: plain callables, called on the loop
        out = run_compute_once(
            api, ws, "j", "t", check=lambda: "stored", compute=lambda: "x", store=lambda v: None,
            backend=be, plain=True,
        )  # fmt: skip
        assert out.path is Path.PREFLIGHT
    assert processed() - before == baseline
    assert be.counters.snapshot(ws)["preflight_hits"] == calls
    be.flush_counters()  # pending hits reach the workspace hash on the next round trip
    assert be.workspace_counters(ws)["preflight_hits"] == calls


def test_ids_are_validated_before_anything_runs(backend: LockBackend, api: str) -> None:
    called: list[str] = []
    with pytest.raises(InvalidRequest):
        run_compute_once(
            api, "", "j", "t", check=lambda: called.append("check"), compute=lambda: "x",
            store=lambda v: None, backend=backend, plain=True,
        )  # fmt: skip
    assert called == []
    assert lock_key("w{1}", "j:1", "eval:a") == "onceflow:{w%7B1%7D}:lock:j%3A1:eval%3Aa"


@pytest.mark.parametrize(
    "ttl", [True, 0, -1, 1e-9, 0.0004, float("nan"), float("inf"), 1e16, "5", 86_401]
)
def test_a_bad_ttl_is_refused_before_anything_runs(
    backend: LockBackend, api: str, ttl: Any, ws: str
) -> None:
    # A caller's mistake, not an outage: InvalidRequest (a stage does not retry it), before
    # check() and before Redis (before: 1e16 reached Redis and came back as a retryable
    # LockUnavailable blaming Redis; True was taken as a one-second lock).
    called: list[str] = []
    with pytest.raises(InvalidRequest, match="lock TTL"):
        run_compute_once(
            api, ws, "j", "t", check=lambda: called.append("check"), compute=lambda: "x",
            store=lambda v: None, backend=backend, ttl=ttl, plain=True,
        )  # fmt: skip
    assert called == []
    with pytest.raises(InvalidRequest, match="lock TTL"):
        backend.acquire(ws, "j", "t", ttl=ttl)
    assert backend.remaining_ms(ws, "j", "t") is None  # nothing was taken


def test_coroutine_callbacks_are_refused_by_the_sync_call(backend: LockBackend, ws: str) -> None:
    # Before: an async def check's coroutine object was a pre-flight "hit" (the caller got
    # a coroutine as the cell's value), and an async compute's was stored as the value.
    stored: list[Any] = []

    async def check() -> Any:
        return None

    async def compute() -> str:
        return "x"

    with pytest.raises(InvalidRequest, match="acompute_once"):
        compute_once(ws, "j", "t", check=check, compute=lambda: "x",
                     store=stored.append, backend=backend)  # fmt: skip
    with pytest.raises(InvalidRequest, match="acompute_once"):
        compute_once(ws, "j", "t", check=lambda: None, compute=compute,
                     store=stored.append, backend=backend)  # fmt: skip
    assert stored == []
    assert backend.remaining_ms(ws, "j", "t") is None  # the lock taken for compute: released
    assert backend.counters.snapshot(ws).get("preflight_hits", 0) == 0


# ------------------------------------------------------------------ inside a stage


@pytest.fixture()
def stage_ctx(clean_db: Engine) -> Any:
    from onceflow.context import StageContext
    from onceflow.queue import Queue

    queue = Queue(clean_db)
    ws = f"ws-{secrets.token_hex(4)}"
    queue.enqueue("evaluate", ws, "job-stage")
    claim = queue.claim_next("default", "w1")[0]
    return StageContext(queue, claim, "w1")


def test_stage_context_compute_once_uses_the_requests_cell_and_its_lease(
    stage_ctx: Any, backend: LockBackend, standin: StandIn
) -> None:
    ws, job = stage_ctx.request.workspace_id, stage_ctx.request.job_id
    name = cell_name(ws, job, "eval:col")

    def run() -> Any:
        return stage_ctx.compute_once(
            "eval:col", lambda: store_get(standin.url, name),
            lambda: call_provider(standin.url, name), lambda v: store_put(standin.url, name, v),
            backend=backend,
        )  # fmt: skip

    assert run().path is Path.COMPUTED
    assert run().path is Path.PREFLIGHT
    assert standin.calls[name] == 1

    other = cell_name(ws, job, "eval:other")
    stage_ctx._lost.set()  # a heartbeat learned that the lease is gone
    with pytest.raises(LeaseLost):
        stage_ctx.compute_once(
            "eval:other", lambda: None, lambda: call_provider(standin.url, other),
            lambda v: None, backend=backend,
        )  # fmt: skip
    assert standin.calls[other] == 0  # stopped before paying
    assert backend.owner_token(ws, job, "eval:other") is None  # and the lock was released


def test_lock_unavailable_in_a_stage_is_retried(clean_db: Engine, ws: str) -> None:
    from pydantic import BaseModel

    from onceflow.models.status import Status
    from onceflow.queue import Queue
    from onceflow.tasks.flow import StageSpec
    from onceflow.tasks.runtime import run_request

    class Empty(BaseModel):
        pass

    dead = RedisLockBackend(redis_client("redis://127.0.0.1:1/0", timeout=1))

    def body(ctx: Any, data: Empty) -> Any:
        return ctx.compute_once("t", lambda: None, lambda: "x", lambda v: None, backend=dead)

    spec = StageSpec("evaluate", body, Empty, "default", True, None, None, None, 0, None)
    queue = Queue(clean_db)
    request_id = queue.enqueue("evaluate", ws, "j").request_id
    outcome = run_request(queue, spec, request_id, "w1", lambda exc: spec.retry_on is None)
    assert outcome["outcome"] == "retry"
    row = queue.get(request_id)
    assert row.status is Status.QUEUED and row.error is not None
    assert row.error["type"] == "LockUnavailable"
