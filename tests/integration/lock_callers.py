"""Caller processes for the compute-lock tests and benchmark.

Callers are real processes forked from a forkserver that has imported this
module once (:func:`context`): each child starts in milliseconds instead of the
~1.3 s a spawned interpreter needs to import SQLAlchemy, redis-py and onceflow,
and none inherits the test process's threads or sockets. A child builds its
own backend, opens its connections, waits at a barrier with the others, runs
:func:`onceflow.locks.compute_once` in one thread per assigned cell, and reports
every outcome on a queue.

Every caller runs on either API (``api``): ``"sync"`` is ``compute_once``,
``"async"`` is ``acompute_once`` on an event loop of its own
(:func:`run_compute_once`), with the same arguments and the same backend's Redis
and counters.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.context import BaseContext
from typing import Any

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from onceflow.db import make_engine
from onceflow.locks import (
    AsyncRedisLockBackend,
    LockBackend,
    RedisLockBackend,
    SqlLockBackend,
    acompute_once,
    compute_once,
    get_async_backend,
)
from onceflow.redis_clients import async_client, is_cluster, sync_client
from tests.integration.standin import call_provider, mark_waiting, store_get, store_put

Cell = tuple[str, str]  # (job_id, task)

#: The two APIs every compute_once test runs on.
APIS = ("sync", "async")


def async_twin(backend: LockBackend) -> AsyncRedisLockBackend:
    """An async backend on the same Redis as ``backend``, counting in its counters.

    Built inside the event loop that uses it (a redis.asyncio client belongs to one loop),
    with the socket timeouts of ``backend``'s client and the one immediate retry of
    onceflow's own clients.
    """
    if not isinstance(backend, RedisLockBackend):
        raise TypeError(f"no async twin for the {backend.name} lock backend (sync-only)")
    if is_cluster(backend.client):  # the same cluster, through onceflow's client factory
        first = backend.client.get_default_node().redis_connection
        timeout = first.connection_pool.connection_kwargs.get("socket_timeout")
        nodes = ",".join(f"{n.host}:{n.port}" for n in backend.client.get_primaries())
        cluster = async_client(f"redis+cluster://{nodes}", timeout=timeout, retries=1)
        return AsyncRedisLockBackend(cluster, settings=backend.settings, counters=backend.counters)
    kw = backend.client.connection_pool.connection_kwargs
    client = redis.asyncio.Redis(
        host=kw.get("host", "localhost"),
        port=kw.get("port", 6379),
        db=kw.get("db", 0),
        socket_timeout=kw.get("socket_timeout"),
        socket_connect_timeout=kw.get("socket_connect_timeout"),
        retry=Retry(NoBackoff(), 1),
    )
    return AsyncRedisLockBackend(client, settings=backend.settings, counters=backend.counters)


def in_thread(fn: Any) -> Any:
    """A plain (blocking) callable as a coroutine function that runs it in a worker thread."""
    if fn is None or inspect.iscoroutinefunction(fn):
        return fn

    async def run(*args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    return run


def run_compute_once(api: str, workspace_id: str, job_id: str, task: str, **kw: Any) -> Any:
    """``compute_once(...)``, or the same call as ``acompute_once`` in ``asyncio.run``.

    The async call gets :func:`async_twin` of ``backend`` (or, without one, the loop's
    default backend), and the test's blocking callbacks as coroutine functions running
    in threads (:func:`in_thread`) so that the loop, and its watchdog task, keep running.
    ``plain=True`` hands them to ``acompute_once`` as they are (called on the loop).
    """
    if api == "sync":
        kw.pop("plain", None)
        return compute_once(workspace_id, job_id, task, **kw)
    if api != "async":
        raise ValueError(f"unknown api {api!r}")
    backend = kw.pop("backend", None)
    if not kw.pop("plain", False):
        for name in ("check", "compute", "store", "on_wait"):
            if name in kw:
                kw[name] = in_thread(kw[name])

    async def main() -> Any:
        if backend is None:  # the loop's default backend, closed with the loop
            default = get_async_backend()
            try:
                return await acompute_once(workspace_id, job_id, task, backend=default, **kw)
            finally:
                await default.aclose()  # type: ignore[attr-defined]
        async with async_twin(backend) as abe:
            return await acompute_once(workspace_id, job_id, task, backend=abe, **kw)

    return asyncio.run(main())


def context() -> BaseContext:
    """The forkserver context, preloading this module (and so onceflow) in the server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def make_backend(kind: str, url: str, pool_size: int = 2) -> LockBackend:
    """A backend of its own for one process (small pool: 64 processes share Postgres)."""
    if kind == "redis":  # onceflow's client factory: redis+cluster:// URLs too
        return RedisLockBackend(sync_client(url, timeout=30, connect_timeout=10))
    return SqlLockBackend(make_engine(url, pool_size=pool_size))


def cell_name(workspace_id: str, job_id: str, task: str) -> str:
    """The stand-in's name of a cell (one provider counter and one stored value each)."""
    return f"{workspace_id}.{job_id}.{task}"


def call(
    backend: LockBackend,
    standin: str,
    workspace_id: str,
    cell: Cell,
    *,
    hold: float = 0.0,
    ttl: float | None = None,
    watchdog: bool | None = None,
    api: str = "sync",
) -> dict[str, Any]:
    """One caller: ``compute_once`` on the stand-in provider and store; the outcome as a dict."""
    job_id, task = cell
    name = cell_name(workspace_id, job_id, task)
    outcome = run_compute_once(
        api,
        workspace_id,
        job_id,
        task,
        check=lambda: store_get(standin, name),
        compute=lambda: call_provider(standin, name, hold),
        store=lambda value: store_put(standin, name, value),
        ttl=ttl,
        watchdog=watchdog,
        backend=backend,
        on_wait=lambda: mark_waiting(standin, name),
    )
    return {
        "cell": name,
        "path": outcome.path.value,
        "value": outcome.value,
        "served_by": outcome.served_by,
        "waited": outcome.waited_seconds,
        "rounds": outcome.rounds,
        "duplicate": outcome.duplicate,
        "served_at": time.monotonic(),  # CLOCK_MONOTONIC: one clock for every process
        "pid": os.getpid(),
        "api": api,
    }


def call_without_lock(standin: str, workspace_id: str, cell: Cell, *, hold: float = 0.0) -> str:
    """The usual cache-aside without a lock (check, compute, store): the benchmark's baseline."""
    name = cell_name(workspace_id, *cell)
    value = store_get(standin, name)
    if value is None:
        value = call_provider(standin, name, hold)
        store_put(standin, name, value)
    return value


def run_process(plan: dict[str, Any], barrier: Any, results: Any) -> None:
    """Process target: build a backend, warm it, meet the others, run one thread per cell."""
    try:
        backend = make_backend(plan["kind"], plan["url"])
        ws = plan["workspace_id"]
        backend.remaining_ms(ws, "warm", "up")  # connect before the race starts
        if barrier is not None:
            barrier.wait(timeout=120)
        outcomes: list[dict[str, Any]] = []

        def one(cell: Cell) -> None:
            try:
                if plan.get("without_lock"):
                    value = call_without_lock(plan["standin"], ws, cell, hold=plan.get("hold", 0))
                    outcomes.append({"cell": cell_name(ws, *cell), "value": value})
                    return
                outcomes.append(
                    call(
                        backend, plan["standin"], ws, cell,
                        hold=plan.get("hold", 0.0), ttl=plan.get("ttl"),
                        watchdog=plan.get("watchdog"), api=plan.get("api", "sync"),
                    )
                )  # fmt: skip
            except BaseException:
                outcomes.append({"error": traceback.format_exc()})

        threads = [threading.Thread(target=one, args=(tuple(c),)) for c in plan["cells"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        backend.flush_counters()
        results.put(
            {"pid": os.getpid(), "outcomes": outcomes, "counters": backend.counters.snapshot(ws)}
        )
    except BaseException:
        results.put({"pid": os.getpid(), "error": traceback.format_exc(), "outcomes": []})


class Fleet:
    """Caller processes started together, their reports collected with a deadline."""

    def __init__(self, ctx: BaseContext, plans: Sequence[dict[str, Any]], *, barrier: bool = True):
        self.results: Any = ctx.Queue()
        self._barrier = ctx.Barrier(len(plans)) if barrier and len(plans) > 1 else None
        args = [(plan, self._barrier, self.results) for plan in plans]
        self.processes = [
            ctx.Process(target=run_process, args=a, daemon=True)  # type: ignore[attr-defined]
            for a in args
        ]
        for p in self.processes:
            p.start()

    def collect(self, expected: int | None = None, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Reports of ``expected`` processes (all by default); fails past ``timeout``."""
        want = len(self.processes) if expected is None else expected
        deadline = time.monotonic() + timeout
        reports: list[dict[str, Any]] = []
        while len(reports) < want:
            try:
                reports.append(self.results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"only {len(reports)} of {want} caller processes reported in {timeout}s"
                    ) from None
        errors = [r["error"] for r in reports if "error" in r]
        errors += [o["error"] for r in reports for o in r["outcomes"] if "error" in o]
        assert not errors, "\n".join(errors)
        return reports

    def stop(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def outcomes(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every caller's outcome, over all reports."""
    return [o for r in reports for o in r["outcomes"]]
