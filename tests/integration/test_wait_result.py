"""Queue.wait / AsyncQueue.wait: a request's end, woken by the database's NOTIFY.

A waiter runs in a thread (the sync API) or on an event loop in a thread (the async one)
while the test ends the request from the main thread, once the waiter is LISTENing (seen
in ``pg_stat_activity``). Every wait is bounded by a 60 s timeout that must not be met:
only the order of events is asserted, never a speed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from onceflow import (
    AsyncQueue,
    InvalidRequest,
    NotFound,
    Queue,
    Request,
    Status,
    WaitTimeout,
)
from onceflow.queue import Failure
from onceflow.queue.done import DONE_CHANNEL
from onceflow.settings import get_settings
from tests.conftest import libpq

LONG = 60.0  # a wait that must end by its wake-up, long before this
DONE_LISTEN = f"LISTEN {DONE_CHANNEL}"


def _side(engine: Engine) -> psycopg.Connection[Any]:
    """A connection outside the pool."""
    return psycopg.connect(libpq(engine.url.render_as_string(hide_password=False)), autocommit=True)


def done_listeners(engine: Engine) -> list[int]:
    """Backends whose last statement was LISTEN onceflow_done: waiters that are listening."""
    with _side(engine) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = %s AND pid <> pg_backend_pid()",
            (DONE_LISTEN,),
        ).fetchall()
    return [r[0] for r in rows]


def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Waiter:
    """A wait running in a thread: its answer or its error once it returns."""

    def __init__(self, call: Callable[[], Request]) -> None:
        self.answer: Request | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], Request]) -> None:
        try:
            self.answer = call()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def result(self) -> Request:
        self.thread.join(LONG + 10)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


@pytest.fixture()
def q(clean_db: Engine) -> Iterator[Queue]:
    queue = Queue(clean_db, settings=get_settings())
    yield queue
    queue.close()


def sync_wait(q: Queue, rid: str, **kw: Any) -> Request:
    return q.wait(rid, **kw)


def async_wait(q: Queue, rid: str, **kw: Any) -> Request:
    async def go() -> Request:
        aq = AsyncQueue.from_queue(q)
        try:
            return await aq.wait(rid, **kw)
        finally:
            await aq.aclose()

    return asyncio.run(go())


WAITS = {"sync": sync_wait, "async": async_wait}


@pytest.fixture(params=sorted(WAITS))
def wait(request: pytest.FixtureRequest) -> Callable[..., Request]:
    return WAITS[request.param]


def started(q: Queue, engine: Engine, wait: Callable[..., Request], rid: str) -> Waiter:
    """A waiter on ``rid`` (60 s timeout), returned once it LISTENs."""
    before = len(done_listeners(engine))
    waiter = Waiter(lambda: wait(q, rid, timeout=LONG))
    until(lambda: len(done_listeners(engine)) > before or not waiter.thread.is_alive(), "LISTEN")
    return waiter


def test_a_waiter_is_woken_by_the_completion(
    q: Queue, clean_db: Engine, wait: Callable[..., Request]
) -> None:
    rid = q.enqueue("s", "w", "j").request_id
    claim = q.claim(rid, "worker")
    assert claim is not None
    waiter = started(q, clean_db, wait, rid)
    assert waiter.thread.is_alive()  # not ended: it waits
    q.complete(claim, {"answer": 42})
    done = waiter.result()
    assert (done.request_id, done.status, done.result) == (rid, Status.SUCCEEDED, {"answer": 42})
    until(lambda: done_listeners(clean_db) == [], "its LISTEN connection to close")


def test_dead_and_cancelled_wake_it_too(
    q: Queue, clean_db: Engine, wait: Callable[..., Request]
) -> None:
    dead = q.enqueue("s", "w", "j1").request_id
    claim = q.claim(dead, "worker")
    assert claim is not None
    waiter = started(q, clean_db, wait, dead)
    q.fail(claim, {"message": "no"}, retryable=False)
    assert waiter.result().status == Status.DEAD

    cancelled = q.enqueue("s", "w", "j2").request_id
    waiter = started(q, clean_db, wait, cancelled)
    q.cancel(cancelled)
    assert waiter.result().status == Status.CANCELLED


def test_a_retry_does_not_end_the_wait_the_last_failure_does(q: Queue, clean_db: Engine) -> None:
    rid = q.enqueue("s", "w", "j", max_attempts=2).request_id
    waiter = started(q, clean_db, sync_wait, rid)
    first = q.claim(rid, "worker")
    assert first is not None
    assert q.fail(first, {"message": "once"}, retry_in=0).status == Status.QUEUED
    second = q.claim(rid, "worker")
    assert second is not None
    assert waiter.thread.is_alive()
    q.fail(second, {"message": "twice"})
    done = waiter.result()
    assert (done.status, done.attempts) == (Status.DEAD, 2)


def test_batched_ends_and_the_sweeper_send_the_wake_up(q: Queue, clean_db: Engine) -> None:
    """Every statement that ends a request waited for notifies, once per request, at its
    commit; one nobody waits for sends nothing."""
    # Each row has one attempt: a lapsed lease is its last.
    ids = [q.enqueue("s", "w", f"j{i}", max_attempts=1).request_id for i in range(6)]
    claims = [q.claim(rid, "worker", lease_seconds=30) for rid in ids]
    assert all(c is not None for c in claims)
    with clean_db.begin() as conn:  # as a wait marks its row (the sixth: nobody waits)
        conn.execute(
            text("UPDATE workspace_process_requests SET waited = true WHERE request_id <> :r"),
            {"r": ids[5]},
        )
    with _side(clean_db) as listen:
        listen.execute(DONE_LISTEN)
        q.complete_many([(claims[5], 0)])  # type: ignore[list-item]
        q.complete_many([(claims[0], 1), (claims[1], 2)])  # type: ignore[list-item]
        q.fail_many([Failure(claims[2], "x", retryable=False)])  # type: ignore[arg-type]
        q.finish(claims[3], None)  # type: ignore[arg-type]
        # The sweeper gives up on a lease that lapsed past the crash budget: dead.
        later = claims[4].lease_expires_at + timedelta(seconds=1)  # type: ignore[union-attr]
        q.rescue_expired(now=later)
        assert q.get(ids[4]).status == Status.DEAD
        seen = [n.payload for n in listen.notifies(timeout=10, stop_after=5)]
        seen += [n.payload for n in listen.notifies(timeout=1)]  # and nothing more
    assert sorted(seen) == sorted(ids[:5])


def test_a_request_already_ended_is_returned_at_once(
    q: Queue, wait: Callable[..., Request]
) -> None:
    rid = q.enqueue("s", "w", "j").request_id
    q.cancel(rid)
    assert wait(q, rid, timeout=LONG).status == Status.CANCELLED


def test_the_timeout_raises_with_the_request_as_it_is(
    q: Queue, wait: Callable[..., Request]
) -> None:
    rid = q.enqueue("s", "w", "j").request_id
    with pytest.raises(WaitTimeout) as raised:
        wait(q, rid, timeout=0.2)
    assert raised.value.request_id == rid
    assert raised.value.request.status == Status.QUEUED


def test_no_such_request_is_not_found(q: Queue, wait: Callable[..., Request]) -> None:
    with pytest.raises(NotFound):
        wait(q, "no-such-request", timeout=LONG)
    q.enqueue("s", "w", "j", request_id="r1")
    with pytest.raises(NotFound):  # in another workspace
        wait(q, "r1", timeout=LONG, workspace_id="other")


@pytest.mark.parametrize(
    "timeout", [0, -1, float("nan"), float("inf"), True, "5", None, 3601, 10**9]
)
def test_bad_timeouts_are_refused_before_any_sql(
    q: Queue, wait: Callable[..., Request], timeout: Any
) -> None:
    # No such request: a check made after a read would raise NotFound instead.
    with pytest.raises(InvalidRequest, match="timeout"):
        wait(q, "no-such-request", timeout=timeout)


def test_a_bad_id_is_refused(q: Queue, wait: Callable[..., Request]) -> None:
    with pytest.raises(InvalidRequest):
        wait(q, "", timeout=LONG)


def test_a_lost_listen_connection_falls_back_to_reading_the_row(
    q: Queue, clean_db: Engine, wait: Callable[..., Request]
) -> None:
    rid = q.enqueue("s", "w", "j").request_id
    claim = q.claim(rid, "worker")
    assert claim is not None
    waiter = started(q, clean_db, wait, rid)
    killed = set(done_listeners(clean_db))
    with _side(clean_db) as admin:
        for pid in killed:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    until(lambda: not killed & set(done_listeners(clean_db)), "the kill")
    q.complete(claim, "late")
    done = waiter.result()
    assert (done.status, done.result) == (Status.SUCCEEDED, "late")


def test_flow_wait_delegates_to_its_queue(clean_db: Engine) -> None:
    from pydantic import BaseModel

    from onceflow.context import StageContext
    from onceflow.tasks import Flow

    class In(BaseModel):
        value: int = 0

    flow = Flow(settings=get_settings())

    @flow.stage("double", input=In)
    def double(ctx: StageContext, data: In) -> dict[str, int]:
        return {"value": 2 * data.value}

    # Enqueued without a wake-up: this test plays the worker.
    [made] = flow.queue.enqueue_many([flow.new_request("double", "w", "j", "", {"value": 2})])
    claim = flow.queue.claim(made.request_id, "worker")
    assert claim is not None
    waiter = started(
        flow.queue, clean_db, lambda _q, rid, **kw: flow.wait(rid, **kw), made.request_id
    )
    assert waiter.thread.is_alive()
    flow.queue.complete(claim, {"value": 4})
    assert waiter.result().result == {"value": 4}
    assert flow.wait(made.request_id, timeout=LONG, workspace_id="w").status == Status.SUCCEEDED
    with pytest.raises(WaitTimeout):
        flow.wait(flow.queue.enqueue("double", "w", "j2").request_id, timeout=0.1)


def test_async_waits_on_one_loop_share_one_listen_connection(q: Queue, clean_db: Engine) -> None:
    ids = [q.enqueue("s", "w", f"j{i}").request_id for i in range(5)]
    claims = [q.claim(rid, "worker") for rid in ids]

    async def go() -> tuple[list[Request], int]:
        aq = AsyncQueue.from_queue(q)
        try:
            waits = [asyncio.ensure_future(aq.wait(rid, timeout=LONG)) for rid in ids]
            await asyncio.to_thread(until, lambda: bool(done_listeners(clean_db)), "LISTEN")
            await asyncio.to_thread(q.complete_many, [(c, i) for i, c in enumerate(claims)])
            done = await asyncio.gather(*waits)
            # Every wait has returned: the loop's one LISTEN connection stays for the next.
            return done, len(done_listeners(clean_db))
        finally:
            await aq.aclose()

    done, listening = asyncio.run(go())
    assert [(r.request_id, r.status, r.result) for r in done] == [
        (rid, Status.SUCCEEDED, i) for i, rid in enumerate(ids)
    ]
    assert listening == 1
    until(lambda: done_listeners(clean_db) == [], "aclose to close it")
