"""Claims, leases and fencing on a real Postgres, with the database clock injected."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow import (
    DatabaseUnavailable,
    InvalidTransition,
    LeaseLost,
    NewRequest,
    NotFound,
    Queue,
    Status,
)
from onceflow.ids import request_id_for
from onceflow.models import Dispatch
from tests.acceptance.procs import wait_for


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(text("SELECT now()")).scalar_one()
    assert isinstance(value, datetime)
    return value


#: Rows the eight processes drain. The property is each row claimed exactly once while the
#: processes claim at the same time, not volume: they wait at a barrier once connected, so
#: their claims overlap from the first (2,000 rows, started one by one, mostly did not).
ROWS = 800


def _claim_loop(database_url: str, worker: str, start: Any, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from onceflow.queue import Queue as Q

    q = Q(database_url)
    q.counts()  # connected before the barrier: the first claims race
    start.wait(timeout=120)
    claimed: list[str] = []
    while True:
        claims = q.claim_next("default", worker, limit=7)
        if not claims:
            break
        for c in claims:
            q.complete(c, {"by": worker})
            claimed.append(c.request_id)
    out.put(claimed)


@pytest.mark.slow
def test_8_processes_claim_rows_each_exactly_once(queue: Queue, database_url: str) -> None:
    items = [NewRequest("w", f"j{i}", "s") for i in range(ROWS)]
    queue.enqueue_many(items)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(8)
    procs = [
        ctx.Process(target=_claim_loop, args=(database_url, f"p{i}", start, out)) for i in range(8)
    ]
    for p in procs:
        p.start()
    lists = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    claimed = Counter(rid for lst in lists for rid in lst)
    assert len(claimed) == ROWS
    assert set(claimed.values()) == {1}
    assert sum(1 for lst in lists if lst) >= 2  # the work really was shared
    assert queue.counts()["default"]["succeeded"] == ROWS
    assert all(r.attempts == 1 for r in queue.list(limit=1000))


def test_claim_is_exclusive_while_the_lease_lives(queue: Queue) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    first = queue.claim(rid, "a")
    assert first is not None and first.attempt == 1
    assert queue.claim(rid, "b") is None
    assert queue.claim_next("default", "b") == []
    assert "token" not in repr(first) or first.token not in repr(first)


def test_lease_expiry_fences_the_old_claim(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    old = queue.claim(rid, "a", lease_seconds=10)
    assert old is not None
    later = db_now(clean_db) + timedelta(seconds=11)
    # With the database clock moved past the lease, the old token is worthless ...
    with pytest.raises(LeaseLost):
        queue.heartbeat(old, now=later)
    with pytest.raises(LeaseLost):
        queue.complete(old, {"by": "a"}, now=later)
    with pytest.raises(LeaseLost):
        queue.fail(old, {"e": 1}, now=later)
    # ... and the request is claimable again: a new token, the next attempt, one crash counted.
    new = queue.claim(rid, "b", lease_seconds=10, now=later)
    assert new is not None
    assert new.token != old.token
    assert (new.attempt, new.request.crash_attempts) == (2, 1)
    # The old holder still cannot write, even at the real time when its lease would be alive.
    with pytest.raises(LeaseLost):
        queue.heartbeat(old)
    with pytest.raises(LeaseLost):
        queue.complete(old, {"by": "a"})
    done = queue.complete(new, {"by": "b"}, now=later)
    assert (done.status, done.result, done.claimed_by) == (Status.SUCCEEDED, {"by": "b"}, "b")


def test_a_failure_report_after_a_rescue_is_not_taken_for_our_own(
    queue: Queue, clean_db: Engine
) -> None:
    # The sweeper requeued the lapsed request (same claimant, same attempt count, status
    # queued — what our own retryable failure would have left): the late report is a zombie.
    rid = queue.enqueue("s", "w", "j").request_id
    old = queue.claim(rid, "a", lease_seconds=10)
    assert old is not None
    later = db_now(clean_db) + timedelta(seconds=11)
    assert queue.rescue_expired(now=later).rescued == [rid]
    with pytest.raises(LeaseLost):
        queue.fail(old, {"e": 1}, now=later)
    row = queue.get(rid)
    assert (row.status, row.error, row.crash_attempts) == (Status.QUEUED, None, 1)


def test_claim_next_takes_lapsed_leases_too(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    assert queue.claim(rid, "a", lease_seconds=5) is not None
    later = db_now(clean_db) + timedelta(seconds=6)
    [again] = queue.claim_next("default", "b", now=later)
    assert (again.request_id, again.attempt, again.request.crash_attempts) == (rid, 2, 1)


def test_heartbeat_extends_from_database_time_and_reports_cancel(
    queue: Queue, clean_db: Engine
) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    claim = queue.claim(rid, "a", lease_seconds=10)
    assert claim is not None
    t = db_now(clean_db) + timedelta(seconds=8)
    beat = queue.heartbeat(claim, now=t)
    assert beat.lease_expires_at == t + timedelta(seconds=10)
    assert not beat.cancel_requested
    # Kept alive by heartbeats well past the original lease.
    beat = queue.heartbeat(claim, now=t + timedelta(seconds=9))
    assert queue.claim(rid, "b", now=t + timedelta(seconds=12)) is None
    queue.cancel(rid)
    assert queue.heartbeat(claim).cancel_requested
    assert queue.fail(claim, {"type": "Cancelled"}).status is Status.CANCELLED


def test_retry_backoff_then_dead_with_error_kept(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j", max_attempts=3).request_id
    now = db_now(clean_db)
    for attempt in (1, 2):
        claim = queue.claim(rid, "a", now=now)
        assert claim is not None and claim.attempt == attempt
        failed = queue.fail(claim, {"type": "Boom", "attempt": attempt}, now=now)
        assert failed.status is Status.QUEUED
        delay = (failed.run_after - now).total_seconds()
        base = queue.settings.backoff_base_seconds * 2 ** (attempt - 1)
        assert base / 2 <= delay <= base  # exponential, with equal jitter
        # Not due before run_after: neither by id nor by class.
        assert queue.claim(rid, "a", now=now) is None
        assert queue.claim_next("default", "a", now=now) == []
        now = failed.run_after
    claim = queue.claim(rid, "a", now=now)
    assert claim is not None and claim.attempt == 3
    dead = queue.fail(claim, {"type": "Boom", "attempt": 3}, now=now)
    assert dead.status is Status.DEAD
    assert dead.error == {"type": "Boom", "attempt": 3}
    assert dead.finished_at is not None
    assert queue.claim(rid, "a", now=now + timedelta(days=1)) is None


def test_non_retryable_failure_is_dead_at_once(queue: Queue) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    claim = queue.claim(rid, "a")
    assert claim is not None
    assert queue.fail(claim, ValueError("bad input"), retryable=False).status is Status.DEAD
    assert queue.get(rid).error == {"type": "ValueError", "message": "bad input"}


def test_cancel_queued_and_running(queue: Queue) -> None:
    queued = queue.enqueue("s", "w", "j1").request_id
    assert queue.cancel(queued).status is Status.CANCELLED
    assert queue.claim(queued, "a") is None
    running = queue.enqueue("s", "w", "j2").request_id
    claim = queue.claim(running, "a")
    assert claim is not None
    after = queue.cancel(running)
    assert (after.status, after.cancel_requested) == (Status.RUNNING, True)
    # Finished requests are returned unchanged; unknown ones are NotFound.
    queue.complete(claim, {"done": True})
    assert queue.cancel(running).status is Status.SUCCEEDED
    with pytest.raises(NotFound):
        queue.cancel("no-such-request")


def test_requeue_refused_while_running_allowed_when_finished(queue: Queue) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    claim = queue.claim(rid, "a")
    assert claim is not None
    with pytest.raises(InvalidTransition):
        queue.requeue(rid)
    queue.complete(claim, {"v": 1})
    again = queue.requeue(rid)
    assert (again.status, again.attempts, again.result) == (Status.QUEUED, 0, None)
    assert queue.claim(rid, "b") is not None


def test_complete_then_hands_off_in_one_transaction(queue: Queue) -> None:
    rid = queue.enqueue("evaluate", "w", "j", "main").request_id
    claim = queue.claim(rid, "a")
    assert claim is not None
    queue.complete(claim, {"ok": 1}, then=[NewRequest("w", "j", "tailor", "main")])
    nxt = queue.get(request_id_for("w", "j", "main", "tailor"))
    assert nxt.status is Status.QUEUED


KILL_TRIGGER = """
CREATE SEQUENCE kill_count;
CREATE FUNCTION kill_own_backend() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- nextval is not rolled back: it counts the kills across the retries.
    IF nextval('kill_count') <= TG_ARGV[0]::int THEN
        PERFORM pg_terminate_backend(pg_backend_pid());
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER kill_hand_off BEFORE INSERT ON workspace_process_requests
FOR EACH ROW WHEN (NEW.job_id = 'then-test') EXECUTE FUNCTION kill_own_backend(%d);
"""


@contextlib.contextmanager
def hand_off_killer(engine: Engine, kills: int) -> Iterator[None]:
    """The server process of the completing transaction dies after the completion's UPDATE,
    just as the follow-up INSERT arrives: a trigger terminates its own backend."""
    with engine.begin() as conn:
        conn.execute(text(KILL_TRIGGER % kills))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER kill_hand_off ON workspace_process_requests"))
            conn.execute(text("DROP FUNCTION kill_own_backend(); DROP SEQUENCE kill_count"))


def test_hand_off_killed_between_the_two_writes_lands_nothing(
    queue: Queue, clean_db: Engine
) -> None:
    rid = queue.enqueue("evaluate", "w", "j", "main").request_id
    claim = queue.claim(rid, "a", lease_seconds=1)
    assert claim is not None
    then = [NewRequest("w", "then-test", "tailor", "main")]
    with hand_off_killer(clean_db, kills=1000), pytest.raises(DatabaseUnavailable):
        # Every attempt dies between its two writes; retried for one lease, then raised.
        queue.complete(claim, {"ok": 1}, then=then)
    # Each attempt rolled back with its hand-off: still running, no follow-up row.
    assert queue.get(rid).status is Status.RUNNING
    with pytest.raises(NotFound):
        queue.get(request_id_for("w", "then-test", "main", "tailor"))
    # The pool dropped the dead connections: once the lease lapsed, a new claim completes.
    again = wait_for(lambda: queue.claim(rid, "b"), what="the lapsed lease reclaimed")
    assert again is not None
    queue.complete(again, {"ok": 2}, then=then)
    assert queue.get(request_id_for("w", "then-test", "main", "tailor")).status is Status.QUEUED


def test_hand_off_killed_once_is_retried_and_lands_once(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("evaluate", "w", "j", "main").request_id
    claim = queue.claim(rid, "a")
    assert claim is not None
    then = [NewRequest("w", "then-test", "tailor", "main", dedupe=False)]
    with hand_off_killer(clean_db, kills=1):
        row, [made] = queue.hand_off(claim, {"ok": 1}, then=then)
    assert row.status is Status.SUCCEEDED and row.result == {"ok": 1}
    assert made.created  # the retry inserted it: the killed attempt left nothing
    # A random (non-dedupe) id is minted once: the retry did not add a second row.
    assert [r.request_id for r in queue.list(job_id="then-test")] == [made.request_id]


def test_rescue_expired_requeues_then_quarantines(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j", max_crash_attempts=2).request_id
    now = db_now(clean_db)
    assert queue.claim(rid, "a", lease_seconds=5, now=now) is not None
    # Two sweepers at once: the compare-and-set lets only one act on the row.
    first = queue.rescue_expired(now=now + timedelta(seconds=6))
    second = queue.rescue_expired(now=now + timedelta(seconds=6))
    assert first.rescued == [rid] and second.rescued == []
    assert first.to_dispatch == [Dispatch(rid, "s", "default")]
    assert queue.get(rid).crash_attempts == 1
    # Crash again: the budget of 2 lapsed leases is spent, the request is quarantined (dead).
    assert queue.claim(rid, "b", lease_seconds=5, now=now + timedelta(seconds=7)) is not None
    swept = queue.rescue_expired(now=now + timedelta(seconds=13))
    assert swept.quarantined == [rid]
    dead = queue.get(rid)
    assert (dead.status, dead.crash_attempts, dead.error["type"]) == (Status.DEAD, 2, "LeaseLapsed")


def test_rescue_never_touches_a_live_or_finished_claim(queue: Queue, clean_db: Engine) -> None:
    live = queue.enqueue("s", "w", "live").request_id
    done = queue.enqueue("s", "w", "done").request_id
    claim_live = queue.claim(live, "a", lease_seconds=60)
    claim_done = queue.claim(done, "a", lease_seconds=1)
    assert claim_live is not None and claim_done is not None
    queue.complete(claim_done, {"v": 1})
    swept = queue.rescue_expired(now=db_now(clean_db) + timedelta(seconds=30))
    assert swept.rescued == [] and swept.quarantined == []
    assert queue.get(done).status is Status.SUCCEEDED
    queue.heartbeat(claim_live)


def test_due_for_dispatch_resends_only_stale_wakeups(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    now = db_now(clean_db)
    assert queue.due_for_dispatch(redispatch_after=30, now=now) == []
    later = now + timedelta(seconds=31)
    assert queue.due_for_dispatch(redispatch_after=30, now=later) == [Dispatch(rid, "s", "default")]
    assert queue.due_for_dispatch(redispatch_after=30, now=later) == []


def test_database_down_is_a_clear_error() -> None:
    q = Queue("postgresql+psycopg://127.0.0.1:1/nothing")
    with pytest.raises(DatabaseUnavailable):
        q.get("x")
    assert os.environ.get("ONCEFLOW_DATABASE_URL") != "postgresql+psycopg://127.0.0.1:1/nothing"
