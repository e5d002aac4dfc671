"""The processes of bench/consumer_bench.py: one consumer or producer of one system per process.

Run by the orchestrator, never by hand::

    <python> bench/consumer_side.py consume  <system> <dsn> --done-dir D --concurrency C --stall S
    <python> bench/consumer_side.py preload  <system> <dsn> --prefix P --n N [--sleep S]
    <python> bench/consumer_side.py produce  <system> <dsn> --prefix P --rate R --seconds T --out F
    <python> bench/consumer_side.py schema   <system> <dsn>
    <python> bench/consumer_side.py versions

``system`` is ``onceflow`` (run with onceflow's own venv), ``procrastinate`` or ``pgqueuer``
(run with the peers' venv, which has no onceflow). Each system's libraries are imported only
inside its own functions, so either interpreter can load this file.

Every system runs the same job: a handler that (optionally) sleeps, then appends one line
``<key> <t_enqueue> <t_start> <t_end> <pid>`` to ``<done-dir>/<pid>.log`` with one
``os.write`` on an ``O_APPEND`` descriptor (atomic for a short line; it survives a ``kill -9``
of the process once the call returned). A job killed before that line is not "done"; one
run twice leaves two lines (a duplicate). ``t_enqueue`` is the producer's ``time.time()``
before its first enqueue attempt of the job; ``t_start`` the handler's first statement: the
pickup latency. Same host, same clock; used only for measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

QUEUE = "bench"  # queue name / worker class / entrypoint in every system
PRODUCER_APP = "bench-producer"  # application_name of producers: backend kills spare them


# ------------------------------------------------------------------------------ the job


class DoneLog:
    """One append-only file per consumer process."""

    def __init__(self, done_dir: str) -> None:
        os.makedirs(done_dir, exist_ok=True)
        self.fd = os.open(
            os.path.join(done_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT
        )
        self.start_fd = os.open(
            os.path.join(done_dir, f"{os.getpid()}.started"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        )
        self.pid = os.getpid()

    def started(self, key: str) -> None:
        os.write(self.start_fd, f"{key} {time.time():.6f}\n".encode())

    def done(self, key: str, t_enq: float, t_start: float) -> None:
        line = f"{key} {t_enq:.6f} {t_start:.6f} {time.time():.6f} {self.pid}\n"
        os.write(self.fd, line.encode())


def job_args(payload: dict[str, Any]) -> tuple[str, float, float]:
    return str(payload["k"]), float(payload["t"]), float(payload.get("s", 0.0))


# ------------------------------------------------------------------------------ onceflow


def _onceflow_item(key: str, t: float, sleep: float) -> Any:
    from onceflow.models import NewRequest

    payload: dict[str, Any] = {"k": key, "t": t}
    if sleep:
        payload["s"] = sleep
    return NewRequest(
        workspace_id="bench", job_id=key, stage="noop", input=payload, worker_class=QUEUE
    )


def onceflow_consume(args: argparse.Namespace) -> None:
    from onceflow.queue import Queue

    log = DoneLog(args.done_dir)

    def run_job(payload: dict[str, Any]) -> None:
        t_start = time.time()
        key, t_enq, sleep = job_args(payload)
        if sleep:
            log.started(key)
            time.sleep(sleep)  # the job's own work, not a wait for a condition
        log.done(key, t_enq, t_start)

    if args.fallback:
        _onceflow_fallback(Queue, args, run_job)
        return
    from onceflow.worker import Worker

    def handler(ctx: Any) -> None:
        run_job(ctx.request.input)

    # Given the URL, the worker builds its own pool, sized for its concurrency.
    Worker(args.dsn, [QUEUE], handler, concurrency=args.concurrency, lease_seconds=args.stall).run()


def _onceflow_fallback(
    queue_cls: Any, args: argparse.Namespace, run_job: Callable[[dict[str, Any]], None]
) -> None:
    """A plain consumer loop instead of the Worker: claim_next batches, one complete per
    row, polling every 50 ms when the queue is empty; SIGTERM stops claiming and finishes
    what it holds (nothing can be handed back)."""
    from concurrent.futures import ThreadPoolExecutor

    from onceflow.db import make_engine

    queue = queue_cls(make_engine(args.dsn, pool_size=args.concurrency + 2))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    slots = threading.Semaphore(args.concurrency)
    free = threading.Condition()
    held = [0]
    wid = f"fallback-{os.getpid()}"

    def work(claim: Any) -> None:
        try:
            run_job(claim.request.input)
            while True:
                try:
                    queue.complete(claim, None)
                    break
                except Exception as exc:
                    if type(exc).__name__ == "LeaseLost":
                        break
                    time.sleep(0.1)
        finally:
            with free:
                held[0] -= 1
                free.notify()
            slots.release()

    with ThreadPoolExecutor(args.concurrency) as pool:
        while not stop.is_set():
            with free:
                while held[0] >= args.concurrency and not stop.is_set():
                    free.wait(0.1)
                want = args.concurrency - held[0]
            if stop.is_set():
                break
            try:
                claims = queue.claim_next([QUEUE], wid, want, lease_seconds=args.stall)
            except Exception:
                time.sleep(0.1)
                continue
            if not claims:
                stop.wait(0.05)
                continue
            for claim in claims:
                slots.acquire()
                with free:
                    held[0] += 1
                pool.submit(work, claim)


def onceflow_schema(dsn: str) -> None:
    from onceflow.migrate import migrate

    migrate(dsn)


def onceflow_preload(dsn: str, keys: list[str], sleep: float) -> None:
    from onceflow.queue import Queue

    queue = Queue(dsn)
    now = time.time()
    for i in range(0, len(keys), 1000):
        queue.enqueue_many([_onceflow_item(k, now, sleep) for k in keys[i : i + 1000]])


def onceflow_enqueuer(
    dsn: str, sleep: float
) -> tuple[Callable[[str, float], None], Callable[[], None]]:
    from onceflow.db import make_engine
    from onceflow.queue import Queue

    sep = "&" if "?" in dsn else "?"
    queue = Queue(make_engine(f"{dsn}{sep}application_name={PRODUCER_APP}", pool_size=1))

    def enqueue(key: str, t: float) -> None:
        queue.enqueue_many([_onceflow_item(key, t, sleep)])

    return enqueue, lambda: None


# ------------------------------------------------------------------------------ Procrastinate

PROCRASTINATE_TASK = "bench.noop"


def _procrastinate_app(dsn: str, application_name: str | None = None) -> Any:
    import procrastinate

    kwargs: dict[str, Any] = {"conninfo": dsn}
    if application_name:
        kwargs["kwargs"] = {"application_name": application_name}
    return procrastinate.App(connector=procrastinate.PsycopgConnector(**kwargs))


def procrastinate_consume(args: argparse.Namespace) -> None:
    log = DoneLog(args.done_dir)
    app = _procrastinate_app(args.dsn)

    @app.task(name=PROCRASTINATE_TASK, queue=QUEUE)  # type: ignore[misc]
    async def noop(k: str, t: float, s: float = 0.0) -> None:
        t_start = time.time()
        if s:
            log.started(k)
            await asyncio.sleep(s)
        log.done(k, t, t_start)

    async def rescue_stalled() -> None:
        # Procrastinate's documented recipe (docs/howto/production/retry_stalled_jobs.md):
        # get_stalled_jobs() by worker heartbeat, then retry_job() each. The docs run it as a
        # periodic task; here every consumer runs it once a second.
        while True:
            await asyncio.sleep(1.0)
            try:
                stalled = await app.job_manager.get_stalled_jobs(
                    queue=QUEUE, seconds_since_heartbeat=args.stall
                )
                for job in stalled:
                    try:
                        await app.job_manager.retry_job(job)
                    except Exception as exc:  # another consumer retried it first
                        print(f"retry_job {job.id}: {exc}", file=sys.stderr, flush=True)
            except Exception as exc:
                print(f"rescue: {exc}", file=sys.stderr, flush=True)

    async def main() -> None:
        async with app.open_async():
            rescuer = asyncio.create_task(rescue_stalled())
            try:
                await app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=args.concurrency,
                    wait=True,
                    fetch_job_polling_interval=1.0,
                    update_heartbeat_interval=args.stall / 4,
                    stalled_worker_timeout=args.stall,
                    install_signal_handlers=True,
                )
            finally:
                rescuer.cancel()

    asyncio.run(main())


def procrastinate_schema(dsn: str) -> None:
    app = _procrastinate_app(dsn)
    with app.open():
        app.schema_manager.apply_schema()


def procrastinate_preload(dsn: str, keys: list[str], sleep: float) -> None:
    app = _procrastinate_app(dsn)
    task = app.configure_task(PROCRASTINATE_TASK, queue=QUEUE)
    now = time.time()
    with app.open():
        for i in range(0, len(keys), 1000):
            task.batch_defer(*[{"k": k, "t": now, "s": sleep} for k in keys[i : i + 1000]])


def procrastinate_enqueuer(
    dsn: str, sleep: float
) -> tuple[Callable[[str, float], None], Callable[[], None]]:
    app = _procrastinate_app(dsn, PRODUCER_APP)
    task = app.configure_task(PROCRASTINATE_TASK, queue=QUEUE)
    app.open()

    def enqueue(key: str, t: float) -> None:
        task.defer(k=key, t=t, s=sleep)

    return enqueue, app.close


# ------------------------------------------------------------------------------ PgQueuer


async def _pgqueuer_connect(dsn: str, application_name: str | None = None) -> Any:
    import psycopg

    kwargs: dict[str, Any] = {"autocommit": True}
    if application_name:
        kwargs["application_name"] = application_name
    return await psycopg.AsyncConnection.connect(dsn, **kwargs)


def pgqueuer_consume(args: argparse.Namespace) -> None:
    import pgqueuer
    from pgqueuer import PgQueuer, PsycopgDriver
    from pgqueuer.models import Job

    log = DoneLog(args.done_dir)

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        conn = await _pgqueuer_connect(args.dsn)
        pgq = PgQueuer(PsycopgDriver(conn))

        @pgq.entrypoint(QUEUE)
        async def noop(job: Job) -> None:
            t_start = time.time()
            key, t_enq, sleep = job_args(json.loads(job.payload or b"{}"))
            if sleep:
                log.started(key)
                await asyncio.sleep(sleep)
            log.done(key, t_enq, t_start)

        try:
            yield pgq
        finally:
            with contextlib.suppress(Exception):
                await conn.close()

    batch = max(1, args.concurrency // 2)  # PgQueuer: max_concurrent_tasks >= 2 x batch_size
    asyncio.run(
        pgqueuer.run(
            factory,
            batch_size=batch,
            max_concurrent_tasks=args.concurrency,
            heartbeat_timeout=timedelta(seconds=args.stall),
            dequeue_timeout=timedelta(seconds=1.0),
            restart_on_failure=True,
            restart_delay=timedelta(seconds=0.1),
        )
    )


def pgqueuer_schema(dsn: str) -> None:
    from pgqueuer import PsycopgDriver, Queries

    async def main() -> None:
        conn = await _pgqueuer_connect(dsn)
        await Queries(PsycopgDriver(conn)).install()
        await conn.close()

    asyncio.run(main())


def pgqueuer_preload(dsn: str, keys: list[str], sleep: float) -> None:
    from pgqueuer import PsycopgDriver, Queries

    async def main() -> None:
        conn = await _pgqueuer_connect(dsn)
        queries = Queries(PsycopgDriver(conn))
        now = time.time()
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            await queries.enqueue(
                [QUEUE] * len(chunk),
                [json.dumps({"k": k, "t": now, "s": sleep}).encode() for k in chunk],
                [0] * len(chunk),
            )
        await conn.close()

    asyncio.run(main())


def pgqueuer_enqueuer(
    dsn: str, sleep: float
) -> tuple[Callable[[str, float], None], Callable[[], None]]:
    from pgqueuer import PsycopgDriver, Queries

    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}

    async def connect() -> None:
        state["conn"] = await _pgqueuer_connect(dsn, PRODUCER_APP)
        state["queries"] = Queries(PsycopgDriver(state["conn"]))

    def enqueue(key: str, t: float) -> None:
        if "queries" not in state:
            loop.run_until_complete(connect())
        try:
            payload = json.dumps({"k": key, "t": t, "s": sleep}).encode()
            loop.run_until_complete(state["queries"].enqueue(QUEUE, payload))
        except Exception:
            state.pop("queries", None)  # a new connection on the next attempt
            raise

    return enqueue, loop.close


# ------------------------------------------------------------------------------ dispatch

SYSTEMS: dict[str, dict[str, Callable[..., Any]]] = {
    "onceflow": {
        "consume": onceflow_consume,
        "schema": onceflow_schema,
        "preload": onceflow_preload,
        "enqueuer": onceflow_enqueuer,
    },
    "procrastinate": {
        "consume": procrastinate_consume,
        "schema": procrastinate_schema,
        "preload": procrastinate_preload,
        "enqueuer": procrastinate_enqueuer,
    },
    "pgqueuer": {
        "consume": pgqueuer_consume,
        "schema": pgqueuer_schema,
        "preload": pgqueuer_preload,
        "enqueuer": pgqueuer_enqueuer,
    },
}


def produce(args: argparse.Namespace) -> None:
    """Enqueue at a fixed rate for a fixed time; one line ``<key> <t_enqueue>`` per acked job.

    A failed enqueue (server down, backend killed) is retried every 50 ms with the same key and
    the same ``t_enqueue`` until it succeeds or the run's end plus 30 s; the schedule is kept
    (a late producer catches up, it never skips a job)."""
    enqueue, close = SYSTEMS[args.system]["enqueuer"](args.dsn, args.sleep)
    out = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    n = int(args.rate * args.seconds)
    t0 = time.time()
    give_up = t0 + args.seconds + 30.0
    failures = 0
    for i in range(n):
        if stop.is_set():
            break
        delay = t0 + i / args.rate - time.time()
        if delay > 0:
            time.sleep(delay)  # the producer's schedule
        key = f"{args.prefix}{i}"
        t_enq = time.time()
        while True:
            try:
                enqueue(key, t_enq)
                break
            except Exception as exc:
                failures += 1
                if failures <= 3 or failures % 100 == 0:
                    print(f"enqueue {key}: {type(exc).__name__}: {exc}", file=sys.stderr)
                if time.time() > give_up or stop.is_set():
                    break
                time.sleep(0.05)
        else:
            continue
        os.write(out, f"{key} {t_enq:.6f}\n".encode())
    close()
    print(json.dumps({"failures": failures, "seconds": time.time() - t0}), flush=True)


def versions() -> None:
    import importlib.metadata

    found = {}
    for name in ("onceflow", "procrastinate", "pgqueuer", "psycopg"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    print(json.dumps(found))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["consume", "preload", "produce", "schema", "versions"])
    parser.add_argument("system", nargs="?", choices=sorted(SYSTEMS))
    parser.add_argument("dsn", nargs="?")
    parser.add_argument("--done-dir")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stall", type=float, default=2.0)
    parser.add_argument("--fallback", action="store_true")
    parser.add_argument("--prefix", default="j")
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.command == "versions":
        versions()
        return
    impl = SYSTEMS[args.system]
    if args.command == "consume":
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        impl["consume"](args)
    elif args.command == "schema":
        impl["schema"](args.dsn)
    elif args.command == "preload":
        t0 = time.perf_counter()
        impl["preload"](args.dsn, [f"{args.prefix}{i}" for i in range(args.n)], args.sleep)
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    elif args.command == "produce":
        produce(args)


if __name__ == "__main__":
    main()
