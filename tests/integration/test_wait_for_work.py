"""Queue.wait_for_work: NOTIFY on commit, no lost wake-up, due times by the database clock.

The waits run three ways (``WAITS``): ``Queue.wait_for_work`` (a thread),
``Queue.wait_for_work_async`` and ``AsyncQueue.wait_for_work`` (coroutines).

Real Postgres, real processes; every wait is bounded by a deadline and only the
order of events is asserted, never a speed.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from onceflow import AsyncQueue, InvalidRequest, NewRequest, Queue
from onceflow.connector import run
from onceflow.queue import sql
from onceflow.queue.notify import CHANNEL, next_work
from onceflow.settings import get_settings
from tests.acceptance.procs import wait_for
from tests.conftest import libpq

LONG = 30.0  # a wait that must end by a wake-up long before this

#: How the waiter's NEXT_WORK statement begins (pg_stat_activity keeps only its first 1 KiB).
NEXT_WORK_START = sql.NEXT_WORK.sql.split("%(")[0]


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(text("SELECT now()")).scalar_one()
    assert isinstance(value, datetime)
    return value


def _side(engine: Engine) -> psycopg.Connection[Any]:
    """A connection outside the pool (a pooled one may be the waiter's own)."""
    return psycopg.connect(libpq(engine.url.render_as_string(hide_password=False)), autocommit=True)


def checked_since(engine: Engine, since: datetime) -> bool:
    """A waiter ran its 'when is the next work' query after ``since`` (so it is waiting)."""
    with _side(engine) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND starts_with(query, %s) AND state = 'idle' AND query_start >= %s"
            " AND pid <> pg_backend_pid())",
            (NEXT_WORK_START, since),
        ).fetchone()
        return bool(row and row[0])


def listener_pids(engine: Engine) -> set[int]:
    with _side(engine) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = %s AND pid <> pg_backend_pid()",
            (f"LISTEN {CHANNEL}",),
        ).fetchall()
        return {r[0] for r in rows}


@pytest.fixture()
def q(clean_db: Engine) -> Iterator[Queue]:
    queue = Queue(clean_db, settings=get_settings())
    yield queue
    queue.close()


Wait = Callable[[Queue, Any, float], bool]


def _sync_wait(queue: Queue, classes: Any, timeout: float) -> bool:
    return queue.wait_for_work(classes, timeout)


def _async_wait(queue: Queue, classes: Any, timeout: float) -> bool:
    async def run() -> bool:
        try:
            return await queue.wait_for_work_async(classes, timeout)
        finally:
            await queue.aclose()

    return asyncio.run(run())


def _asyncqueue_wait(queue: Queue, classes: Any, timeout: float) -> bool:
    async def run() -> bool:
        aqueue = AsyncQueue.from_queue(queue)
        try:
            return await aqueue.wait_for_work(classes, timeout)
        finally:
            await aqueue.aclose()

    return asyncio.run(run())


WAITS = pytest.mark.parametrize(
    "wait", [_sync_wait, _async_wait, _asyncqueue_wait], ids=["sync", "async", "asyncqueue"]
)


class Waiting:
    """A wait_for_work running in a thread of this process, with its answer."""

    def __init__(self, wait: Wait, queue: Queue, classes: Any, timeout: float) -> None:
        self.since = db_now(queue.engine)
        self.result: bool | None = None
        self.thread = threading.Thread(target=self._run, args=(wait, queue, classes, timeout))
        self.thread.start()
        wait_for(lambda: checked_since(queue.engine, self.since), what="the waiter to wait")

    def _run(self, wait: Wait, queue: Queue, classes: Any, timeout: float) -> None:
        self.result = wait(queue, classes, timeout)

    def join(self) -> bool | None:
        self.thread.join(LONG + 5)
        assert not self.thread.is_alive()
        return self.result


# ------------------------------------------------------------------ when the next work is


def test_the_next_work_is_the_earliest_due_time_or_lapse_over_priorities_and_classes(
    q: Queue,
) -> None:
    """NEXT_WORK reads each minimum at the front of its index (a loose scan over the
    priorities of queued rows, the first claimable lease of running ones): the answer is
    still the earliest of every priority and class."""

    def req(job: str, wc: str, delay: float, priority: int) -> NewRequest:
        return NewRequest("w1", job, "s", worker_class=wc, run_after_seconds=delay,
                          priority=priority)  # fmt: skip

    def next_in(*classes: str) -> float | None:
        return run(q.connector, next_work(list(classes)))

    q.enqueue_many(
        [req("a1", "wc-a", 300, 5), req("a2", "wc-a", 100, 0), req("a3", "wc-a", 200, -2)]
    )
    q.enqueue_many([req("b1", "wc-b", 500, 9), req("b2", "wc-b", 0, -5)])
    q.enqueue_many([req(f"c{i}", "wc-c", 0, 0) for i in range(3)])
    early, late, stopped = q.claim_next("wc-c", "w", limit=3, lease_seconds=50)
    q.heartbeat(early, lease_seconds=400)
    q.heartbeat(stopped, lease_seconds=20)
    q.cancel(stopped.request_id)  # asked to stop: its lapse makes nothing claimable
    a = next_in("wc-a")
    assert a is not None and 90 < a <= 100  # the lowest priority's row is the earliest
    b = next_in("wc-b")
    assert b is not None and b <= 0  # due now, behind a higher priority delayed row
    c = next_in("wc-c")
    assert c is not None and 40 < c <= 50, c  # `late`'s lease; not the cancelled one's
    both = next_in("wc-a", "wc-c", "wc-a")
    assert both is not None and abs(both - c) < 5
    assert next_in("wc-none") is None
    assert late.request_id not in (early.request_id, stopped.request_id)


# ------------------------------------------------------------------ the NOTIFY itself


def notified(url: str, action: Callable[[], None]) -> list[str]:
    """The payloads on the channel while ``action`` runs (a marker NOTIFY ends the list)."""
    with psycopg.connect(libpq(url), autocommit=True) as listen:
        listen.execute(f"LISTEN {CHANNEL}")
        action()
        with psycopg.connect(libpq(url), autocommit=True) as other:
            other.execute(f"NOTIFY {CHANNEL}, 'zz-end'")  # delivered after earlier commits
        seen: list[str] = []
        for note in listen.notifies(timeout=LONG):
            if note.payload == "zz-end":
                return seen
            seen.append(note.payload)
    raise AssertionError("the end marker never arrived")


def item(job: str, wc: str, delay: float = 0.0) -> NewRequest:
    return NewRequest("w1", job, "s", worker_class=wc, run_after_seconds=delay)


def test_enqueue_notifies_due_rows_once_per_class(q: Queue, database_url: str) -> None:
    def act() -> None:
        q.enqueue_many([item("a1", "wc-a"), item("a2", "wc-a"), item("b1", "wc-b")])
        q.enqueue_many([item("d1", "wc-late", delay=60)])  # delayed: nothing
        q.enqueue_many([item("a1", "wc-a")])  # a duplicate inserts nothing: nothing

    assert sorted(notified(database_url, act)) == ["wc-a", "wc-b"]


def test_a_single_enqueue_notifies_when_due_and_never_with_the_setting_off(
    q: Queue, clean_db: Engine, database_url: str
) -> None:
    # The one-row statement sends its NOTIFY from its result row's filter: due and new only.
    def act() -> None:
        q.enqueue("s", "w1", "n1", worker_class="wc-due")
        q.enqueue("s", "w1", "n2", worker_class="wc-later", run_after_seconds=60)
        q.enqueue("s", "w1", "n1", worker_class="wc-due")  # a duplicate: nothing
        q.enqueue("s", "w1", "n3", worker_class="wc-past", now=db_now(q.engine))

    assert notified(database_url, act) == ["wc-due", "wc-past"]

    quiet = Queue(clean_db, settings=get_settings().model_copy(update={"notify": False}))
    try:

        def act_quietly() -> None:
            assert quiet.enqueue("s", "w1", "q1", worker_class="wc-off").created
            assert quiet.enqueue_many([item("q2", "wc-off"), item("q3", "wc-off2")])[1].created

        assert notified(database_url, act_quietly) == []
        assert len(quiet.claim_next("wc-off", "w", limit=5)) == 2  # written all the same
    finally:
        quiet.close()


def test_notify_is_sent_on_commit_only_and_on_every_enqueue_path(
    q: Queue, engine: Engine, database_url: str
) -> None:
    def act() -> None:
        with engine.connect() as conn:  # the caller's transaction, rolled back
            with conn.begin() as tx:
                q.enqueue_many([item("r1", "wc-rolled")], connection=conn)
                tx.rollback()
            with conn.begin():  # committed
                q.enqueue_many([item("c1", "wc-sa")], connection=conn)
        with psycopg.connect(libpq(database_url)) as raw:  # enqueue_many_with (Django's way)

            def execute(query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
                with raw.cursor(row_factory=psycopg.rows.dict_row) as cur:
                    cur.execute(query, params)
                    return cur.fetchall()

            q.enqueue_many_with(execute, [item("x1", "wc-with")])
            raw.rollback()
            q.enqueue_many_with(execute, [item("x2", "wc-with2")])
            raw.commit()

    assert notified(database_url, act) == ["wc-sa", "wc-with2"]


def test_fail_requeue_and_rescue_notify_when_claimable(q: Queue, database_url: str) -> None:
    q.enqueue_many([item("f1", "wc-f"), item("f2", "wc-g"), item("f3", "wc-h")])
    now = db_now(q.engine)
    (f1,) = q.claim_next("wc-f", "w")
    (f2,) = q.claim_next("wc-g", "w")
    (f3,) = q.claim_next("wc-h", "w", lease_seconds=0.001)

    def act() -> None:
        q.fail(f1, {"m": "x"}, retry_in=0)  # queued and due: notify
        q.fail(f2, {"m": "x"}, retry_in=60)  # queued later: nothing now
        wait_for(lambda: db_now(q.engine) > now, what="f3's lease to lapse")
        assert q.rescue_expired().rescued == [f3.request_id]  # requeued: notify
        done = q.claim_next("wc-f", "w")[0]
        q.complete(done)
        q.requeue(done.request_id)  # queued again: notify

    assert notified(database_url, act) == ["wc-f", "wc-h", "wc-f"]


def test_sweeper_marks_notify(q: Queue, database_url: str) -> None:
    q.enqueue_many([item("u1", "wc-u")])
    q.mark_undispatched(q.enqueue_many([item("u1", "wc-u")])[0].request_id)
    assert notified(database_url, lambda: q.due_for_dispatch(redispatch_after=3600)) == ["wc-u"]


def test_notify_setting_off_sends_nothing(q: Queue, database_url: str) -> None:
    off = Queue(q.engine, settings=get_settings().model_copy(update={"notify": False}))

    def act() -> None:
        off.enqueue_many([item("n1", "wc-off")])
        (claim,) = off.claim_next("wc-off", "w")
        off.fail(claim, {"m": "x"}, retry_in=0)
        q.enqueue_many([item("n2", "wc-on")])

    assert notified(database_url, act) == ["wc-on"]


# ----------------------------------------------------------------- wait_for_work


def _wait_in_child(url: str, classes: list[str], timeout: float, out: Any) -> None:
    queue = Queue(url)
    start = time.monotonic()
    woke = queue.wait_for_work(classes, timeout)
    out.put((woke, time.monotonic() - start))
    queue.close()


def _child(url: str, classes: list[str], timeout: float) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_wait_in_child, args=(url, classes, timeout, out))
    proc.start()
    return proc, out


def test_a_waiter_in_another_process_wakes_on_commit(q: Queue, database_url: str) -> None:
    since = db_now(q.engine)
    proc, out = _child(database_url, ["wc-x", "wc-p"], LONG)
    wait_for(lambda: checked_since(q.engine, since), what="the child to wait")
    q.enqueue_many([item("p1", "wc-p")])
    woke, took = out.get(timeout=LONG + 10)
    proc.join(10)
    assert woke is True and took < LONG  # woken by the commit, not by its timeout


def test_a_waiter_in_another_process_ignores_other_classes(q: Queue, database_url: str) -> None:
    since = db_now(q.engine)
    proc, out = _child(database_url, ["wc-mine"], 1.0)
    wait_for(lambda: checked_since(q.engine, since), what="the child to wait")
    q.enqueue_many([item("o1", "wc-other"), item("o2", "wc-other2", delay=120)])
    woke, _ = out.get(timeout=LONG)
    proc.join(10)
    assert woke is False


@WAITS
def test_work_due_already_returns_at_once(q: Queue, wait: Wait) -> None:
    q.enqueue_many([item("d1", "wc-d")])
    assert wait(q, "wc-d", LONG) is True
    assert wait(q, ["wc-none"], 0) is False  # nothing known: a zero wait just checks


@WAITS
def test_woken_when_a_delayed_row_becomes_due(q: Queue, wait: Wait) -> None:
    q.enqueue_many([item("l1", "wc-late", delay=0.3)])  # no NOTIFY: it is not due
    assert q.claim_next("wc-late", "w") == []
    start = time.monotonic()
    assert wait(q, "wc-late", LONG) is True
    assert time.monotonic() - start < LONG
    assert len(q.claim_next("wc-late", "w")) == 1  # the database clock agrees


@WAITS
def test_woken_when_a_lease_lapses(q: Queue, wait: Wait) -> None:
    q.enqueue_many([item("z1", "wc-zombie")])
    (claim,) = q.claim_next("wc-zombie", "w", lease_seconds=0.3)
    start = time.monotonic()
    assert wait(q, "wc-zombie", LONG) is True
    assert time.monotonic() - start < LONG
    (again,) = q.claim_next("wc-zombie", "w2")  # a lapsed lease is claimable
    assert again.request_id == claim.request_id


@WAITS
def test_woken_by_a_commit_while_waiting(q: Queue, wait: Wait) -> None:
    waiting = Waiting(wait, q, ["wc-w"], LONG)
    q.enqueue_many([item("w1", "wc-w")])
    assert waiting.join() is True


@WAITS
def test_times_out_without_work(q: Queue, wait: Wait) -> None:
    q.enqueue_many([item("t1", "wc-t", delay=3600)])
    assert wait(q, "wc-t", 0.3) is False


def test_interrupt_ends_the_wait(q: Queue) -> None:
    stop = threading.Event()
    result: list[bool] = []
    since = db_now(q.engine)
    thread = threading.Thread(
        target=lambda: result.append(q.wait_for_work("wc-i", LONG, interrupt=stop))
    )
    thread.start()
    wait_for(lambda: checked_since(q.engine, since), what="the waiter to wait")
    stop.set()
    thread.join(LONG)
    assert result == [False]


def test_listener_survives_pg_terminate_backend(q: Queue) -> None:
    waiting = Waiting(_sync_wait, q, "wc-k", LONG)
    (old,) = listener_pids(q.engine)
    with _side(q.engine) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (old,))
    assert waiting.join() is True  # woken: notifies may have been missed
    wait_for(lambda: listener_pids(q.engine) - {old}, what="the listener to reconnect")
    waiting = Waiting(_sync_wait, q, "wc-k", LONG)
    q.enqueue_many([item("k1", "wc-k")])
    assert waiting.join() is True


def test_async_listener_survives_pg_terminate_backend(q: Queue) -> None:
    async def scenario() -> list[bool]:
        since = db_now(q.engine)
        first = asyncio.ensure_future(q.wait_for_work_async("wc-k", LONG))
        while not checked_since(q.engine, since):
            await asyncio.sleep(0.05)
        (old,) = listener_pids(q.engine)
        with _side(q.engine) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (old,))
        woke = [await asyncio.wait_for(first, LONG)]
        while not listener_pids(q.engine) - {old}:
            await asyncio.sleep(0.05)
        since = db_now(q.engine)
        second = asyncio.ensure_future(q.wait_for_work_async("wc-k", LONG))
        while not checked_since(q.engine, since):
            await asyncio.sleep(0.05)
        await asyncio.to_thread(q.enqueue_many, [item("k2", "wc-k")])
        woke.append(await asyncio.wait_for(second, LONG))
        await q.aclose()
        return woke

    assert asyncio.run(scenario()) == [True, True]


@pytest.mark.parametrize(
    ("classes", "timeout"),
    [([], 1), ("bad class!", 1), (None, 1), ("ok", -1), ("ok", 3601), ("ok", float("nan")),
     ("ok", True), ("ok", "1")],
)  # fmt: skip
def test_bad_input_is_refused(q: Queue, classes: Any, timeout: Any) -> None:
    with pytest.raises(InvalidRequest):
        q.wait_for_work(classes, timeout)
    with pytest.raises(InvalidRequest):
        asyncio.run(q.wait_for_work_async(classes, timeout))
    with pytest.raises(InvalidRequest):
        asyncio.run(AsyncQueue.from_queue(q).wait_for_work(classes, timeout))


@WAITS
def test_a_listener_that_cannot_connect_does_not_cost_the_whole_wait(
    q: Queue, wait: Wait, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LISTEN's own connection is refused (a full server, a bad route): the wait still ends
    # at the next known due time instead of burning its timeout waiting for the listener.
    from onceflow.queue import notify

    monkeypatch.setattr(notify, "_conninfo", lambda engine: "postgresql://root@127.0.0.1:1/x")
    q.enqueue_many([item("l2", "wc-nolisten", delay=0.3)])
    start = time.monotonic()
    assert wait(q, "wc-nolisten", LONG) is True
    assert time.monotonic() - start < LONG
    assert len(q.claim_next("wc-nolisten", "w")) == 1
