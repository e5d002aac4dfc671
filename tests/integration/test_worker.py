"""The standalone worker (``onceflow.worker.Worker``): layer 1 consumed without Celery.

Real Postgres; worker processes where the guarantee is across processes (kill -9,
SIGTERM). Time is the database's: conditions are awaited with deadlines, never slept on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from onceflow.context import StageContext
from onceflow.errors import InvalidRequest, LeaseLost, PermanentError, RetryLater
from onceflow.integrations.pull import PullWorker
from onceflow.models import NewRequest, Status
from onceflow.queue import Queue
from onceflow.settings import get_settings
from onceflow.worker import Worker

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def statuses(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT status FROM workspace_process_requests")).scalars()
        return Counter(rows)


def enqueue(queue: Queue, n: int, worker_class: str = "w", **kw: Any) -> list[str]:
    items = [
        NewRequest("ws", f"job-{i}", "s", worker_class=worker_class, input={"i": i}, **kw)
        for i in range(n)
    ]
    return [r.request_id for r in queue.enqueue_many(items)]


def listening(engine: Engine) -> bool:
    with engine.connect() as conn:
        query = "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%'"
        return bool(conn.execute(text(query)).scalar())


@pytest.fixture()
def fast_queue(clean_db: Engine) -> Iterator[Queue]:
    """A queue whose retries and sweeps are quick (no test waits seconds for them)."""
    settings = get_settings().model_copy(
        update={"backoff_base_seconds": 0.0, "sweep_interval_seconds": 0.3}
    )
    queue = Queue(clean_db, settings)
    yield queue
    queue.close()


def test_a_worker_drains_every_request_once(fast_queue: Queue, clean_db: Engine) -> None:
    ids = enqueue(fast_queue, 120)
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def body(ctx: StageContext) -> dict[str, Any]:
        with lock:
            seen[ctx.request.request_id] += 1
        return {"double": ctx.request.input["i"] * 2}

    with Worker(fast_queue, "w", body, concurrency=4, prefetch=4) as worker:
        wait_for(lambda: statuses(clean_db) == {"succeeded": 120}, "the drain")
    assert seen == Counter({rid: 1 for rid in ids})
    done = fast_queue.get(ids[7])
    assert (done.attempts, done.result) == (1, {"double": 14})
    assert worker.stats.succeeded == 120 and worker.stats.claimed == 120
    assert worker.held == 0


def test_an_idle_worker_wakes_on_the_enqueue_not_a_poll(
    fast_queue: Queue, clean_db: Engine
) -> None:
    # max_wait is a safety net of one minute: the request is done long before it, so the
    # wake-up came from the enqueue's NOTIFY.
    started = threading.Event()

    def body(ctx: StageContext) -> None:
        started.set()

    with Worker(fast_queue, "w", body, concurrency=1, max_wait=60.0):
        wait_for(lambda: listening(clean_db), "the worker to LISTEN")
        enqueue(fast_queue, 1)
        assert started.wait(20.0), "the idle worker did not wake for the enqueue"
        wait_for(lambda: statuses(clean_db) == {"succeeded": 1}, "the completion")


def test_failures_retry_then_die_and_permanent_errors_die_at_once(
    fast_queue: Queue, clean_db: Engine
) -> None:
    [flaky] = enqueue(fast_queue, 1, worker_class="w", max_attempts=3)
    [bad] = fast_queue.enqueue_many([NewRequest("ws", "perm", "s", worker_class="w")])
    [huge] = fast_queue.enqueue_many([NewRequest("ws", "huge", "s", worker_class="w")])
    [fine] = fast_queue.enqueue_many([NewRequest("ws", "fine", "s", worker_class="w")])

    def body(ctx: StageContext) -> Any:
        job = ctx.request.job_id
        if job == "perm":
            raise PermanentError("bad data")
        if job == "huge":
            return "x" * (fast_queue.settings.payload_limit_bytes + 1)
        if job == "fine":
            return "ok"
        raise ValueError(f"attempt {ctx.attempt}")

    with Worker(fast_queue, "w", body, concurrency=2):
        wait_for(
            lambda: statuses(clean_db) == {"dead": 3, "succeeded": 1}, "every request to settle"
        )
    row = fast_queue.get(flaky)
    assert (row.attempts, row.error["type"], row.error["message"]) == (3, "ValueError", "attempt 3")
    assert fast_queue.get(bad.request_id).attempts == 1
    assert fast_queue.get(huge.request_id).error["type"] == "PayloadTooLarge"
    assert fast_queue.get(fine.request_id).result == "ok"


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for this error")


@pytest.mark.parametrize(
    "raised",
    [
        SystemExit(3),
        KeyboardInterrupt(),
        RetryLater(delay=-1),
        RetryLater(delay=float("nan")),
        UnprintableError(),
    ],
    ids=["SystemExit", "KeyboardInterrupt", "RetryLater-negative", "RetryLater-nan", "unprintable"],
)
def test_odd_exceptions_from_a_body_are_recorded_not_held_forever(
    fast_queue: Queue, clean_db: Engine, raised: BaseException
) -> None:
    # Before: the body thread died (BaseException) or the whole batch of failures was
    # refused (a bad delay), and the heartbeater kept the request running for ever.
    [rid] = enqueue(fast_queue, 1, max_attempts=2)

    def body(ctx: StageContext) -> None:
        raise raised

    with Worker(fast_queue, "w", body, concurrency=1, lease_seconds=30):
        wait_for(lambda: fast_queue.get(rid).status is Status.DEAD, "the request to settle")
    assert fast_queue.get(rid).attempts == 2


def test_a_request_this_worker_claims_again_keeps_its_heartbeats(
    fast_queue: Queue, clean_db: Engine
) -> None:
    # Attempt 1 outlives max_runtime: its lease lapses and this same worker claims the request
    # again (attempt 2) while attempt 1's body is still running. When attempt 1 ends, its
    # bookkeeping must not drop attempt 2's claim: attempt 2 runs for several leases and
    # completes, under heartbeats (before: dropped, its lease lapsed, attempt 3 ran).
    [rid] = enqueue(fast_queue, 1)

    def body(ctx: StageContext) -> str:
        if ctx.attempt == 1:
            wait_for(lambda: fast_queue.get(rid).attempts == 2, "the second claim")
            return "late"  # its lease is gone: discarded
        end = time.monotonic() + 1.0  # the body's work: three leases long
        while time.monotonic() < end:
            ctx.check()
            time.sleep(0.02)
        return "second"

    with Worker(fast_queue, "w", body, concurrency=2, lease_seconds=0.3, max_runtime=2.0):
        wait_for(lambda: fast_queue.get(rid).status is Status.SUCCEEDED, "the completion")
    row = fast_queue.get(rid)
    assert (row.attempts, row.result) == (2, "second")


@contextlib.contextmanager
def _set_on_exit(event: threading.Event) -> Iterator[None]:
    try:
        yield
    finally:
        event.set()


def test_a_takeover_by_this_worker_tells_the_first_run_its_lease_is_gone(
    fast_queue: Queue, clean_db: Engine
) -> None:
    # Attempt 1's lease lapses while its body runs, and this same worker's fetcher takes the
    # request over (lapsed leases first). Attempt 1 must be told (ctx.check() raises): no
    # heartbeat will ever reach it again, since the worker now holds attempt 2 under that
    # request id (before: never told, it ran on beside attempt 2; the two outcomes in one
    # completion batch had the batch refused and every result in it lost).
    [rid] = enqueue(fast_queue, 1)
    runs: dict[int, StageContext] = {}
    told, finish = threading.Event(), threading.Event()

    def body(ctx: StageContext) -> str:
        runs[ctx.attempt] = ctx
        if ctx.attempt == 1:
            try:
                while not finish.is_set():  # (finish: the test failed; let the worker stop)
                    ctx.check()
                    time.sleep(0.02)
            except LeaseLost:
                told.set()
                raise
            return "first"
        assert finish.wait(30)
        return "second"

    worker = Worker(fast_queue, "w", body, concurrency=2, lease_seconds=30)
    with worker, _set_on_exit(finish):
        wait_for(lambda: 1 in runs, "the first run")
        with clean_db.begin() as conn:  # its lease lapses (database clock); the fetcher wakes
            conn.execute(
                text(
                    "UPDATE workspace_process_requests"
                    " SET lease_expires_at = now() - interval '1 second' WHERE request_id = :r"
                ),
                {"r": rid},
            )
            conn.execute(text("SELECT pg_notify('onceflow_work', 'w')"))
        wait_for(lambda: 2 in runs, "the takeover")
        wait_for(told.is_set, "the first run told that its lease is gone", timeout=5)
        finish.set()
        wait_for(lambda: fast_queue.get(rid).status is Status.SUCCEEDED, "the completion")
    row = fast_queue.get(rid)
    assert (row.attempts, row.crash_attempts, row.result) == (2, 1, "second")
    assert (worker.stats.succeeded, worker.stats.unrecorded) == (1, 0)


def test_cancel_reaches_a_running_body(fast_queue: Queue, clean_db: Engine) -> None:
    [rid] = enqueue(fast_queue, 1)
    running = threading.Event()

    def body(ctx: StageContext) -> None:
        running.set()
        while True:  # a long body that checks its lease at each step
            ctx.check()
            time.sleep(0.02)

    with Worker(fast_queue, "w", body, concurrency=1, lease_seconds=0.6):
        assert running.wait(20.0)
        fast_queue.cancel(rid)
        wait_for(lambda: fast_queue.get(rid).status is Status.CANCELLED, "the cancel")


def test_graceful_stop_hands_back_unstarted_claims_and_finishes_running(
    fast_queue: Queue, clean_db: Engine
) -> None:
    ids = enqueue(fast_queue, 4)
    release = threading.Event()
    started: list[str] = []

    def body(ctx: StageContext) -> None:
        started.append(ctx.request.request_id)
        assert release.wait(30.0)

    worker = Worker(fast_queue, "w", body, concurrency=1, prefetch=3).start()
    wait_for(lambda: worker.held == 4 and len(started) == 1, "one running, three prefetched")
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    wait_for(lambda: statuses(clean_db)["queued"] == 3, "the unstarted claims handed back")
    release.set()
    stopper.join(30.0)
    assert not stopper.is_alive()
    rows = {rid: fast_queue.get(rid) for rid in ids}
    assert rows[started[0]].status is Status.SUCCEEDED
    others = [r for rid, r in rows.items() if rid != started[0]]
    # Handed back without counting an attempt: claimable again as if never claimed.
    assert [(r.status, r.attempts, r.crash_attempts) for r in others] == [(Status.QUEUED, 0, 0)] * 3
    assert worker.stats.released == 3 and worker.held == 0


def test_the_workers_sweep_rescues_its_own_classes_only(
    fast_queue: Queue, clean_db: Engine
) -> None:
    # Spent requests whose leases lapse: no claim can take them, only a sweep settles them.
    mine, theirs = (
        fast_queue.enqueue("s", "ws", job, worker_class=wc, max_attempts=1).request_id
        for job, wc in (("mine", "w"), ("theirs", "other"))
    )
    assert fast_queue.claim(mine, "gone", lease_seconds=0.2) is not None
    assert fast_queue.claim(theirs, "gone", lease_seconds=0.2) is not None

    with Worker(fast_queue, "w", lambda ctx: None, concurrency=1) as worker:
        wait_for(lambda: fast_queue.get(mine).status is Status.DEAD, "the worker's sweep")
    assert fast_queue.get(mine).error["type"] == "LeaseLapsed"
    assert fast_queue.get(theirs).status is Status.RUNNING  # another class's: not ours
    assert worker.stats.rescued == 1


def test_bad_arguments_are_refused(fast_queue: Queue) -> None:
    def body(ctx: StageContext) -> None: ...

    for kwargs in (
        {"concurrency": 0}, {"prefetch": -1}, {"max_wait": 0}, {"concurrency": True},
        {"concurrency": 600, "prefetch": 600},  # more than one claim may take
        {"max_runtime": -5.0}, {"max_runtime": float("nan")},
        {"max_wait": 7200},  # longer than one wait_for_work may take
        {"concurrency": 8, "prefetch": 2, "max_held": 9},  # fewer than the threads take
        {"max_held": 10_001}, {"max_held": 8.0}, {"max_held": True},  # past one batch
    ):  # fmt: skip
        with pytest.raises(InvalidRequest):
            Worker(fast_queue, "w", body, **kwargs)
    with pytest.raises(InvalidRequest):
        Worker(fast_queue, [], body)
    with pytest.raises(InvalidRequest):
        Worker(fast_queue, "no spaces", body)
    with PullWorker("http://127.0.0.1:1", "k", "w") as pull:  # refused before any request
        for idle_wait in (0, -1, float("nan"), 61):
            with pytest.raises(InvalidRequest):
                pull.run(lambda ctx: None, idle_wait=idle_wait)


# ----------------------------------------------------------------- across processes


def start_worker(
    database_url: str, log: Path, *, concurrency: int = 2, prefetch: int = 0, seconds: float = 0
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.worker_app", database_url, str(log), "w",
         str(concurrency), str(prefetch), str(seconds)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", "the worker process did not start"
    return proc


def executions(log: Path) -> Counter[str]:
    if not log.exists():
        return Counter()
    return Counter(line.split()[0] for line in log.read_text().splitlines())


@pytest.mark.slow
def test_workers_in_several_processes_run_each_request_once(
    fast_queue: Queue, clean_db: Engine, database_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    procs = [start_worker(database_url, log, concurrency=3, prefetch=3) for _ in range(3)]
    try:
        ids = enqueue(fast_queue, 600)
        wait_for(lambda: statuses(clean_db) == {"succeeded": 600}, "the drain", timeout=90)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(30) == 0
    assert executions(log) == Counter({rid: 1 for rid in ids})
    assert len({line.split()[1] for line in log.read_text().splitlines()}) > 1


@pytest.mark.slow
def test_sigterm_leaves_nothing_running_and_kill_9_is_recovered_by_another_worker(
    fast_queue: Queue, clean_db: Engine, database_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    ids = enqueue(fast_queue, 40)
    # SIGTERM with bodies running and claims prefetched: nothing is left running.
    proc = start_worker(database_url, log, concurrency=2, prefetch=4, seconds=0.2)
    wait_for(lambda: len(executions(log)) >= 2, "some bodies to finish")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    after_term = statuses(clean_db)
    assert after_term["running"] == 0 and after_term["succeeded"] >= 2, after_term
    assert sum(after_term.values()) == 40

    # kill -9 mid-body: its leases (1 s) lapse and a second worker takes the requests up.
    victim = start_worker(database_url, log, concurrency=2, prefetch=2, seconds=0.2)
    wait_for(lambda: statuses(clean_db)["running"] > 0, "the victim to hold claims")
    victim.kill()
    victim.wait(10)
    orphaned = statuses(clean_db)["running"]
    assert orphaned > 0
    rescuer = start_worker(database_url, log, concurrency=4, prefetch=0)
    try:
        wait_for(lambda: statuses(clean_db) == {"succeeded": 40}, "the rescue", timeout=60)
    finally:
        rescuer.send_signal(signal.SIGTERM)
        assert rescuer.wait(30) == 0
    crashed = [r for r in (fast_queue.get(rid) for rid in ids) if r.crash_attempts]
    assert len(crashed) == orphaned  # each orphan counted one crash, then completed
    runs = executions(log)
    assert set(runs) == set(ids)
    # A body runs again only if it was killed mid-run (before its completion committed).
    assert all(n == 1 for rid, n in runs.items() if rid not in {r.request_id for r in crashed})


def test_onceflow_work_runs_a_handler_from_the_command_line(
    fast_queue: Queue, clean_db: Engine, database_url: str
) -> None:
    ids = enqueue(fast_queue, 5)
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "work", "tests.integration.worker_app:double",
         "-w", "w", "-c", "2", "--loglevel", "WARNING"],
        cwd=REPO_ROOT, env={**os.environ, "ONCEFLOW_DATABASE_URL": database_url},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: statuses(clean_db) == {"succeeded": 5}, "the CLI worker's drain")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert fast_queue.get(ids[3]).result == {"double": 6}
    bad = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "work", "no_such_module:f", "-w", "w"],
        cwd=REPO_ROOT, env={**os.environ, "ONCEFLOW_DATABASE_URL": database_url},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "cannot load" in bad.stderr


def test_heartbeats_never_race_the_completions_of_the_same_rows(
    fast_queue: Queue, clean_db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # Short leases: a heartbeat every 0.1 s while bodies finish all the time. A heartbeat
    # sent for a row whose completion committed after the heartbeater took its snapshot is
    # rejected by the database — a false "lease lost" (and a false zombie-write count).
    def rejected_heartbeats() -> float:
        sample = REGISTRY.get_sample_value(
            "onceflow_zombie_writes_rejected_total", {"operation": "heartbeat"}
        )
        return sample or 0.0

    before = rejected_heartbeats()
    enqueue(fast_queue, 1500)
    caplog.set_level(logging.WARNING, logger="onceflow")
    with Worker(fast_queue, "w", lambda ctx: None, concurrency=8, lease_seconds=0.3) as w:
        wait_for(lambda: statuses(clean_db) == {"succeeded": 1500}, "the drain", timeout=60)
    assert w.stats.succeeded == 1500
    assert [r.getMessage() for r in caplog.records if "lease lost" in r.getMessage()] == []
    assert rejected_heartbeats() == before


@contextlib.contextmanager
def slow_completions(engine: Engine, seconds: float) -> Iterator[Callable[[], None]]:
    """Every statement that marks rows succeeded takes ``seconds`` longer, in the database
    (an AFTER trigger that sleeps while it holds the rows): the completion path of a
    database under a held snapshot or a loaded machine. Claims and heartbeats stay fast.
    Yields a callable that ends the slowness (the database recovers) by updating the
    trigger's own setting row: dropping the trigger would lock the whole table meanwhile."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE onceflow_test_slowness (seconds float8 NOT NULL)"))
        conn.execute(text("INSERT INTO onceflow_test_slowness VALUES (:s)"), {"s": seconds})
        conn.execute(
            text("""
            CREATE FUNCTION onceflow_test_slow_completions() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                IF EXISTS (SELECT 1 FROM done WHERE status = 'succeeded') THEN
                    PERFORM pg_sleep(seconds) FROM onceflow_test_slowness;
                END IF;
                RETURN NULL;
            END $$""")
        )
        conn.execute(
            text("""
            CREATE TRIGGER onceflow_test_slow_completions
            AFTER UPDATE ON workspace_process_requests REFERENCING NEW TABLE AS done
            FOR EACH STATEMENT EXECUTE FUNCTION onceflow_test_slow_completions()""")
        )

    def recover() -> None:
        with engine.begin() as conn:
            conn.execute(text("UPDATE onceflow_test_slowness SET seconds = 0"))

    try:
        yield recover
    finally:
        with engine.begin() as conn:
            conn.execute(text(
                "DROP TRIGGER onceflow_test_slow_completions ON workspace_process_requests"
            ))  # fmt: skip
            conn.execute(text("DROP FUNCTION onceflow_test_slow_completions()"))
            conn.execute(text("DROP TABLE onceflow_test_slowness"))


def test_slow_completions_never_run_a_finished_body_twice(
    fast_queue: Queue, clean_db: Engine
) -> None:
    # Many instant bodies, and a completion path slower than the whole 2 s lease: the worker
    # must stop claiming while its finished bodies wait to be recorded, and keep every other
    # held lease alive meanwhile, so nothing finished is handed out again. Once the database
    # recovers, the backlog drains.
    n = 2000
    ids = enqueue(fast_queue, n)
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def body(ctx: StageContext) -> None:
        with lock:
            seen[ctx.request.request_id] += 1

    most_running = 0
    with (
        slow_completions(clean_db, 3.0) as recover,
        Worker(fast_queue, "w", body, concurrency=64, lease_seconds=2.0) as worker,
    ):
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # the pressure: watched, not slept through
            most_running = max(most_running, statuses(clean_db)["running"])
            time.sleep(0.1)
        recover()
        wait_for(lambda: statuses(clean_db) == {"succeeded": n}, "the drain", timeout=120)
    twice = sorted(rid for rid, count in seen.items() if count > 1)
    assert len(twice) == 0, f"{len(twice)} bodies ran more than once, e.g. {twice[:3]}"
    assert set(seen) == set(ids)
    assert most_running <= worker.max_held, most_running
    with clean_db.connect() as conn:
        crashes = conn.execute(
            text("SELECT coalesce(sum(crash_attempts), 0) FROM workspace_process_requests")
        ).scalar()
    assert crashes == 0
    assert worker.stats.succeeded == n and worker.stats.lease_lost == 0


def test_the_worker_logs_its_start_and_each_recorded_request(
    fast_queue: Queue, clean_db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    [good] = enqueue(fast_queue, 1)
    [bad] = fast_queue.enqueue_many([NewRequest("ws", "bad", "s", worker_class="w")])

    def body(ctx: StageContext) -> None:
        if ctx.request.request_id == bad.request_id:
            raise PermanentError("no")

    caplog.set_level(logging.INFO, logger="onceflow.worker")
    with Worker(fast_queue, "w", body, concurrency=2, worker_id="logged"):
        wait_for(lambda: statuses(clean_db) == {"succeeded": 1, "dead": 1}, "both outcomes")
    lines = [r.getMessage() for r in caplog.records if r.name == "onceflow.worker"]
    [start] = [line for line in lines if line.startswith("worker logged:")]
    assert "classes w, concurrency 2 (+0 prefetch, at most 4 held)" in start
    assert f"database {clean_db.url.render_as_string(hide_password=True)}" in start
    assert f"request {good} (stage s, class w): succeeded" in lines
    assert f"request {bad.request_id} (stage s, class w): dead" in lines
