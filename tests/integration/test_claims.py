"""Claims, leases and fencing on a real Postgres, with the database clock injected."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from onceflow import (
    AsyncQueue,
    Claim,
    ClaimRef,
    DatabaseUnavailable,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    NewRequest,
    NotFound,
    Queue,
    Status,
)
from onceflow.connector import FetchOne, Query, Steps, Transaction, run
from onceflow.db import raw_connection
from onceflow.ids import request_id_for
from onceflow.models import Dispatch
from onceflow.queue import sql
from onceflow.queue.claims import fence_steps
from tests.acceptance.procs import wait_for
from tests.both_apis import both
from tests.conftest import libpq, table_snapshot
from tests.integration.test_db_blips import kill_backends, own_engine


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


def test_claim_is_exclusive_while_the_lease_lives(api_queue: Queue) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    first = api_queue.claim(rid, "a")
    assert first is not None and first.attempt == 1
    assert api_queue.claim(rid, "b") is None
    assert api_queue.claim_next("default", "b") == []
    assert "token" not in repr(first) or first.token not in repr(first)


def test_lease_expiry_fences_the_old_claim(api_queue: Queue, clean_db: Engine) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    old = api_queue.claim(rid, "a", lease_seconds=10)
    assert old is not None
    later = db_now(clean_db) + timedelta(seconds=11)
    # With the database clock moved past the lease, the old token is worthless ...
    with pytest.raises(LeaseLost):
        api_queue.heartbeat(old, now=later)
    with pytest.raises(LeaseLost):
        api_queue.complete(old, {"by": "a"}, now=later)
    with pytest.raises(LeaseLost):
        api_queue.fail(old, {"e": 1}, now=later)
    # ... and the request is claimable again: a new token, the next attempt, one crash counted.
    new = api_queue.claim(rid, "b", lease_seconds=10, now=later)
    assert new is not None
    assert new.token != old.token
    assert (new.attempt, new.request.crash_attempts) == (2, 1)
    # The old holder still cannot write, even at the real time when its lease would be alive.
    with pytest.raises(LeaseLost):
        api_queue.heartbeat(old)
    with pytest.raises(LeaseLost):
        api_queue.complete(old, {"by": "a"})
    done = api_queue.complete(new, {"by": "b"}, now=later)
    assert (done.status, done.result, done.claimed_by) == (Status.SUCCEEDED, {"by": "b"}, "b")


def test_a_failure_report_after_a_rescue_is_not_taken_for_our_own(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    # The sweeper requeued the lapsed request (same claimant, same attempt count, status
    # queued — what our own retryable failure would have left): the late report is a zombie.
    rid = api_queue.enqueue("s", "w", "j").request_id
    old = api_queue.claim(rid, "a", lease_seconds=10)
    assert old is not None
    later = db_now(clean_db) + timedelta(seconds=11)
    assert queue.rescue_expired(now=later).rescued == [rid]
    with pytest.raises(LeaseLost):
        api_queue.fail(old, {"e": 1}, now=later)
    row = api_queue.get(rid)
    assert (row.status, row.error, row.crash_attempts) == (Status.QUEUED, None, 1)


def test_claim_next_takes_lapsed_leases_too(api_queue: Queue, clean_db: Engine) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    assert api_queue.claim(rid, "a", lease_seconds=5) is not None
    later = db_now(clean_db) + timedelta(seconds=6)
    [again] = api_queue.claim_next("default", "b", now=later)
    assert (again.request_id, again.attempt, again.request.crash_attempts) == (rid, 2, 1)


def test_claim_next_takes_the_highest_due_priority_past_delayed_higher_ones(
    api_queue: Queue, clean_db: Engine
) -> None:
    """claim_next's order is priority, then due time, among due rows only: rows delayed at a
    higher priority wait behind due ones of a lower priority, and go first once due. The rows
    are inserted in an order that is none of the expected ones (the table's physical order
    must not decide)."""
    rows = [  # (job, priority, delay in seconds), in insertion order
        ("e-2-d300", -2, 300), ("c3-d400", 3, 400), ("f-2-now", -2, 0), ("b3-d200", 3, 200),
        ("a5-d600", 5, 600), ("d1-now", 1, 0), ("g3-now", 3, 0), ("h3-d100", 3, 100),
    ]  # fmt: skip
    api_queue.enqueue_many(
        [NewRequest("w1", job, "s", priority=p, run_after_seconds=d) for job, p, d in rows]
    )
    t0 = db_now(clean_db)

    def take(now: datetime | None, most: int = 100) -> list[str]:
        taken: list[str] = []
        while len(taken) < most and (claims := api_queue.claim_next("default", "w", now=now)):
            taken.append(claims[0].request.job_id)
            api_queue.complete(claims[0])  # not left to lapse: lapsed leases come first
        return taken

    assert take(None, most=1) == ["g3-now"]  # d1-now and f-2-now stay due
    # 250 s on: h3 and b3 (priority 3, delayed) are due and go before d1 (1, due all along);
    # within priority 3, by due time (b3 was inserted first).
    assert take(t0 + timedelta(seconds=250)) == ["h3-d100", "b3-d200", "d1-now", "f-2-now"]
    assert take(t0 + timedelta(seconds=700)) == ["a5-d600", "c3-d400", "e-2-d300"]


def test_heartbeat_extends_from_database_time_and_reports_cancel(
    api_queue: Queue, clean_db: Engine
) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a", lease_seconds=10)
    assert claim is not None
    t = db_now(clean_db) + timedelta(seconds=8)
    beat = api_queue.heartbeat(claim, now=t)
    assert beat.lease_expires_at == t + timedelta(seconds=10)
    assert not beat.cancel_requested
    # Kept alive by heartbeats well past the original lease.
    beat = api_queue.heartbeat(claim, now=t + timedelta(seconds=9))
    assert api_queue.claim(rid, "b", now=t + timedelta(seconds=12)) is None
    api_queue.cancel(rid)
    assert api_queue.heartbeat(claim).cancel_requested
    assert api_queue.fail(claim, {"type": "Cancelled"}).status is Status.CANCELLED


def test_heartbeat_by_ref_extends_by_the_claims_own_lease_from_the_row(
    api_queue: Queue, clean_db: Engine
) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a", lease_seconds=17)
    assert claim is not None and api_queue.settings.lease_seconds != 17
    ref = ClaimRef(rid, claim.token)  # all a pull worker holds: nothing read to rebuild a Claim
    t = db_now(clean_db) + timedelta(seconds=5)
    beat = api_queue.heartbeat(ref, now=t)
    assert beat.lease_expires_at == t + timedelta(seconds=17)  # the claim's lease, from the row
    assert api_queue.get(rid).lease_expires_at == t + timedelta(seconds=17)
    # A Claim's own lease (a stage's, the HTTP API's per-heartbeat one) is applied and kept.
    longer = Claim(claim.request, claim.token, claim.lease_expires_at, 40)
    assert api_queue.heartbeat(longer, now=t).lease_expires_at == t + timedelta(seconds=40)
    later = t + timedelta(seconds=1)
    assert api_queue.heartbeat(ref, now=later).lease_expires_at == later + timedelta(seconds=40)


def test_heartbeat_by_ref_never_passes_the_claims_max_runtime(
    api_queue: Queue, clean_db: Engine
) -> None:
    rid = api_queue.enqueue("s", "w", "j", priority=1).request_id
    other = api_queue.enqueue("s", "w", "j2").request_id
    now = db_now(clean_db)
    [claim] = api_queue.claim_next("default", "a", lease_seconds=10, max_runtime=15, now=now)
    ref = ClaimRef(rid, claim.token)
    beat = api_queue.heartbeat(ref, now=now + timedelta(seconds=8))
    assert beat.lease_expires_at == now + timedelta(seconds=15)  # claim time + max_runtime
    with pytest.raises(LeaseLost):  # past the deadline the lease lapsed: nothing extends it
        api_queue.heartbeat(ref, now=now + timedelta(seconds=16))
    # The same by id (claim): the deadline is on the row, whoever beats.
    by_id = api_queue.claim(other, "a", lease_seconds=10, max_runtime=12, now=now)
    assert by_id is not None
    beat = api_queue.heartbeat(ClaimRef(other, by_id.token), now=now + timedelta(seconds=5))
    assert beat.lease_expires_at == now + timedelta(seconds=12)


def test_complete_hand_off_and_fail_by_ref(api_queue: Queue, clean_db: Engine) -> None:
    for job in ("a", "b", "c"):
        api_queue.enqueue("s", "w", job)
    ca, cb, cc = api_queue.claim_next("default", "pw", limit=3)
    done = api_queue.complete(ClaimRef(ca.request_id, ca.token), {"ok": 1})
    assert (done.status, done.result, done.claimed_by) == (Status.SUCCEEDED, {"ok": 1}, "pw")
    row, [made] = api_queue.hand_off(
        ClaimRef(cb.request_id, cb.token), {"ok": 2}, then=[NewRequest("w", "b", "next")]
    )
    assert row.status is Status.SUCCEEDED and made.created
    now = db_now(clean_db)
    failed = api_queue.fail(ClaimRef(cc.request_id, cc.token), {"type": "Boom"}, now=now)
    assert (failed.status, failed.error) == (Status.QUEUED, {"type": "Boom"})
    delay = (failed.run_after - now).total_seconds()
    base = api_queue.settings.backoff_base_seconds  # attempt 1, read from the row
    assert base / 2 <= delay <= base
    # A repeat of a write that landed (its answer lost on the way to a pull worker) is
    # recognised by the token alone, and changes nothing.
    assert api_queue.complete(ClaimRef(ca.request_id, ca.token), {"ok": 1}) == done
    again = api_queue.fail(ClaimRef(cc.request_id, cc.token), {"type": "Boom"}, now=now)
    assert again == failed


def test_a_wrong_token_by_ref_is_lease_lost_and_changes_nothing(
    api_queue: Queue, clean_db: Engine
) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    before = table_snapshot(clean_db)
    wrong = ClaimRef(rid, "0" * 32)
    with pytest.raises(LeaseLost):
        api_queue.heartbeat(wrong)
    with pytest.raises(LeaseLost):
        api_queue.complete(wrong, {"zombie": True})
    with pytest.raises(LeaseLost):
        api_queue.fail(wrong, {"zombie": True})
    assert table_snapshot(clean_db) == before
    with pytest.raises(InvalidRequest):
        api_queue.heartbeat(ClaimRef(rid, ""))
    # A run that ended is not taken for another's: the old token of a requeued and rerun
    # row, repeating its completion, is a zombie.
    api_queue.complete(claim, {"v": 1})
    api_queue.requeue(rid)
    rerun = api_queue.claim(rid, "b")
    assert rerun is not None
    api_queue.complete(rerun, {"v": 2})
    with pytest.raises(LeaseLost):
        api_queue.complete(claim.ref, {"v": 1})
    assert api_queue.get(rid).result == {"v": 2}


def test_a_ref_scoped_to_other_worker_classes_is_fenced_off(
    api_queue: Queue, clean_db: Engine
) -> None:
    """An HTTP worker key's reference carries its worker classes: a token of a request of
    another class changes nothing (the scope is in the fenced statement, nothing is read)."""
    rid = api_queue.enqueue("s", "w", "j", worker_class="llm").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    before = table_snapshot(clean_db)
    other = ClaimRef(rid, claim.token, ("tabs", "maps"))
    with pytest.raises(LeaseLost):
        api_queue.heartbeat(other)
    with pytest.raises(LeaseLost):
        api_queue.complete(other, {"zombie": True})
    with pytest.raises(LeaseLost):
        api_queue.fail(other, {"zombie": True})
    assert api_queue.live_claim(rid, claim.token, worker_classes=["tabs"]) is None
    assert table_snapshot(clean_db) == before
    mine = ClaimRef(rid, claim.token, ("tabs", "llm"))
    assert api_queue.live_claim(rid, claim.token, worker_classes=["llm"]) is not None
    api_queue.heartbeat(mine)
    assert api_queue.complete(mine, {"ok": 1}).status is Status.SUCCEEDED


def test_a_retry_by_a_ref_of_another_class_is_not_taken_for_its_landed_write(
    api_queue: Queue,
) -> None:
    """A completion whose answer was lost is recognised by its token (``ended_run``), within
    the reference's worker classes: a key of another class holding the token learns nothing."""
    rid = api_queue.enqueue("s", "w", "j", worker_class="llm").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    api_queue.complete(ClaimRef(rid, claim.token, ("llm",)), {"ok": 1})
    with pytest.raises(LeaseLost):
        api_queue.complete(ClaimRef(rid, claim.token, ("tabs",)), {"ok": 1})
    assert api_queue.complete(ClaimRef(rid, claim.token, ("llm",)), {"ok": 1}).result == {"ok": 1}


def test_claim_parent_is_the_live_claim_or_the_run_its_token_completed(api_queue: Queue) -> None:
    """What names a hand-off's follow-ups: the claimed request while the claim lives, and
    still after that claim's own completion (a retry whose answer was lost); never after
    a failure report, nor for another token or another class's reference."""
    rid = api_queue.enqueue("s", "w", "j", "b", worker_class="llm").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    ref = ClaimRef(rid, claim.token, ("llm",))
    refused = (ClaimRef(rid, claim.token, ("tabs",)), ClaimRef(rid, "0" * 32))
    live = api_queue.claim_parent(ref)
    assert live is not None and (live.status, live.branch_path) == (Status.RUNNING, "b")
    assert [api_queue.claim_parent(r) for r in refused] == [None, None]
    api_queue.complete(ref, {"ok": 1})
    ended = api_queue.claim_parent(ref)
    assert ended is not None and ended.status is Status.SUCCEEDED
    assert [api_queue.claim_parent(r) for r in refused] == [None, None]
    other = api_queue.enqueue("s", "w", "j2", worker_class="llm").request_id
    failed = api_queue.claim(other, "a")
    assert failed is not None
    api_queue.fail(failed.ref, {"e": 1})
    assert api_queue.claim_parent(failed.ref) is None
    with pytest.raises(InvalidRequest):
        api_queue.claim_parent(ClaimRef(rid, ""))


def test_the_fence_check_by_ref_inside_a_transaction(api_queue: Queue, queue: Queue) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    with raw_connection(queue.engine) as raw, raw.transaction():
        Queue.fence_check(raw, claim.ref)
    with pytest.raises(LeaseLost), raw_connection(queue.engine) as raw, raw.transaction():
        Queue.fence_check(raw, ClaimRef(rid, "0" * 32))
    # As steps, for an operation's Transaction (what the op log's apply does).

    def fenced(ref: ClaimRef) -> Steps[None]:
        yield Transaction(fence_steps(ref))

    run(queue.connector, fenced(claim.ref))
    with pytest.raises(LeaseLost):
        run(queue.connector, fenced(ClaimRef(rid, "0" * 32)))


def test_fenced_retry_takes_steps_or_values_and_retries_a_blip(api_queue: Queue) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    tries: list[int] = []

    def attempt() -> Steps[Any]:
        tries.append(1)
        if len(tries) < 3:  # a blip: retried (after a Sleep step) while the lease may hold
            raise DatabaseUnavailable("a blip")
        by_id = {"request_id": rid, "workspace_id": None}  # the row found by its id alone
        unscoped = {"worker_classes": None, "ws_exact": None, "ws_prefixes": None}
        row = yield FetchOne(
            sql.LIVE_CLAIM, {**by_id, "token": claim.token, "now": None, **unscoped}
        )
        return row["request_id"]

    assert api_queue.fenced_retry(claim.ref, attempt) == rid
    assert len(tries) == 3

    def refused() -> Any:
        raise LeaseLost(rid, "refused")

    def landed() -> Steps[str]:
        row = yield FetchOne(sql.GET, {"request_id": rid, "workspace_id": "w"})
        return str(row["status"])

    assert api_queue.fenced_retry(claim, refused, landed) == "running"  # asked on LeaseLost only
    with pytest.raises(LeaseLost):
        api_queue.fenced_retry(claim, refused)
    with pytest.raises(DatabaseUnavailable):  # the budget bounds the trying, nothing more
        api_queue.fenced_retry(claim, _blip, budget=0.2)


def _blip() -> Any:
    raise DatabaseUnavailable("a long blip")


def test_retry_backoff_then_dead_with_error_kept(api_queue: Queue, clean_db: Engine) -> None:
    rid = api_queue.enqueue("s", "w", "j", max_attempts=3).request_id
    now = db_now(clean_db)
    for attempt in (1, 2):
        claim = api_queue.claim(rid, "a", now=now)
        assert claim is not None and claim.attempt == attempt
        failed = api_queue.fail(claim, {"type": "Boom", "attempt": attempt}, now=now)
        assert failed.status is Status.QUEUED
        delay = (failed.run_after - now).total_seconds()
        base = api_queue.settings.backoff_base_seconds * 2 ** (attempt - 1)
        assert base / 2 <= delay <= base  # exponential, with equal jitter
        # Not due before run_after: neither by id nor by class.
        assert api_queue.claim(rid, "a", now=now) is None
        assert api_queue.claim_next("default", "a", now=now) == []
        now = failed.run_after
    claim = api_queue.claim(rid, "a", now=now)
    assert claim is not None and claim.attempt == 3
    dead = api_queue.fail(claim, {"type": "Boom", "attempt": 3}, now=now)
    assert dead.status is Status.DEAD
    assert dead.error == {"type": "Boom", "attempt": 3}
    assert dead.finished_at is not None
    assert api_queue.claim(rid, "a", now=now + timedelta(days=1)) is None


def test_non_retryable_failure_is_dead_at_once(api_queue: Queue) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    assert api_queue.fail(claim, ValueError("bad input"), retryable=False).status is Status.DEAD
    assert api_queue.get(rid).error == {"type": "ValueError", "message": "bad input"}


def test_cancel_queued_and_running(api_queue: Queue) -> None:
    queued = api_queue.enqueue("s", "w", "j1").request_id
    assert api_queue.cancel(queued).status is Status.CANCELLED
    assert api_queue.claim(queued, "a") is None
    running = api_queue.enqueue("s", "w", "j2").request_id
    claim = api_queue.claim(running, "a")
    assert claim is not None
    after = api_queue.cancel(running)
    assert (after.status, after.cancel_requested) == (Status.RUNNING, True)
    # Finished requests are returned unchanged; unknown ones are NotFound.
    api_queue.complete(claim, {"done": True})
    assert api_queue.cancel(running).status is Status.SUCCEEDED
    with pytest.raises(NotFound):
        api_queue.cancel("no-such-request")


def test_requeue_refused_while_running_allowed_when_finished(api_queue: Queue) -> None:
    rid = api_queue.enqueue("s", "w", "j").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    with pytest.raises(InvalidTransition):
        api_queue.requeue(rid)
    api_queue.complete(claim, {"v": 1})
    again = api_queue.requeue(rid)
    assert (again.status, again.attempts, again.result) == (Status.QUEUED, 0, None)
    assert api_queue.claim(rid, "b") is not None


def test_complete_then_hands_off_in_one_transaction(api_queue: Queue) -> None:
    rid = api_queue.enqueue("evaluate", "w", "j", "main").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    api_queue.complete(claim, {"ok": 1}, then=[NewRequest("w", "j", "tailor", "main")])
    nxt = api_queue.get(request_id_for("w", "j", "main", "tailor"))
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
    api_queue: Queue, clean_db: Engine
) -> None:
    rid = api_queue.enqueue("evaluate", "w", "j", "main").request_id
    claim = api_queue.claim(rid, "a", lease_seconds=1)
    assert claim is not None
    then = [NewRequest("w", "then-test", "tailor", "main")]
    with hand_off_killer(clean_db, kills=1000), pytest.raises(DatabaseUnavailable):
        # Every attempt dies between its two writes; retried for one lease, then raised.
        api_queue.complete(claim, {"ok": 1}, then=then)
    # Each attempt rolled back with its hand-off: still running, no follow-up row.
    assert api_queue.get(rid).status is Status.RUNNING
    with pytest.raises(NotFound):
        api_queue.get(request_id_for("w", "then-test", "main", "tailor"))
    # The pool dropped the dead connections: once the lease lapsed, a new claim completes.
    again = wait_for(lambda: api_queue.claim(rid, "b"), what="the lapsed lease reclaimed")
    assert again is not None
    api_queue.complete(again, {"ok": 2}, then=then)
    assert api_queue.get(request_id_for("w", "then-test", "main", "tailor")).status is Status.QUEUED


def test_hand_off_killed_once_is_retried_and_lands_once(api_queue: Queue, clean_db: Engine) -> None:
    rid = api_queue.enqueue("evaluate", "w", "j", "main").request_id
    claim = api_queue.claim(rid, "a")
    assert claim is not None
    then = [NewRequest("w", "then-test", "tailor", "main", dedupe=False)]
    with hand_off_killer(clean_db, kills=1):
        row, [made] = api_queue.hand_off(claim, {"ok": 1}, then=then)
    assert row.status is Status.SUCCEEDED and row.result == {"ok": 1}
    assert made.created  # the retry inserted it: the killed attempt left nothing
    # A random (non-dedupe) id is minted once: the retry did not add a second row.
    assert [r.request_id for r in api_queue.list(job_id="then-test")] == [made.request_id]


LOST_APP = "onceflow-lost-answer"


class LoseFirstAnswer:
    """A queue whose first completion or failure report commits, then loses its answer: every
    backend of the queue is killed (a restart, a failover) and a real dead connection says so.
    """

    lost: list[str]

    def _lose(self) -> Steps[None]:
        if not self.lost:
            self.lost.append("lost")
            kill_backends(ADMIN[0], "application_name = %s", LOST_APP)
            yield FetchOne(Query("test.probe", "SELECT 1 AS one"), {})  # raises ConnectionLost

    def _complete_once(self, *args: Any) -> Steps[Any]:
        out = yield from super()._complete_once(*args)  # type: ignore[misc]
        yield from self._lose()
        return out

    def _fail_once(self, params: Any) -> Steps[Any]:
        out = yield from super()._fail_once(params)  # type: ignore[misc]
        yield from self._lose()
        return out


class LostSync(LoseFirstAnswer, Queue):
    pass


class LostAsync(LoseFirstAnswer, AsyncQueue):
    pass


ADMIN: list[str] = []


@pytest.fixture()
def losing_queue(
    request: pytest.FixtureRequest, clean_db: Engine, services: tuple[str, str]
) -> Iterator[Any]:
    """A LoseFirstAnswer queue of each API, its connections named LOST_APP (to kill only them)."""
    ADMIN[:] = [services[0]]
    url = clean_db.url.update_query_dict({"application_name": LOST_APP})
    engine = own_engine(clean_db, LOST_APP, pool_size=2)
    sync, asyn = LostSync(engine), LostAsync(url.render_as_string(hide_password=False))
    sync.lost, asyn.lost = [], []
    try:
        yield from both(lambda: sync, lambda: asyn, request.param)
    finally:
        engine.dispose()


@pytest.mark.parametrize("losing_queue", ["sync", "async"], indirect=True)
@pytest.mark.parametrize("write", ["hand_off", "finish", "fail"])
def test_a_write_by_ref_whose_answer_was_lost_is_recognised_on_retry(
    losing_queue: Any, write: str
) -> None:
    rid = losing_queue.enqueue("s", "w", "j").request_id
    claim = losing_queue.claim(rid, "pw")
    assert claim is not None
    ref = ClaimRef(rid, claim.token)
    labels = {"worker_class": "default", "stage": "s", "outcome": "succeeded"}
    succeeded = REGISTRY.get_sample_value("onceflow_attempts_total", labels) or 0.0
    if write in ("hand_off", "finish"):
        then = [NewRequest("w", "lost-next", "next", dedupe=False)]  # a random id, minted once
        if write == "hand_off":
            row, [made] = losing_queue.hand_off(ref, {"ok": 1}, then=then)
        else:
            [made] = losing_queue.finish(ref, {"ok": 1}, then=then)
            row = losing_queue.get(rid)
        assert (row.status, row.result) == (Status.SUCCEEDED, {"ok": 1})
        # The lost attempt created it: one row, reported created (before: False, so a caller
        # acting only on what it created skipped it), left for the sweeper's wake-up.
        [nxt] = losing_queue.list(job_id="lost-next")
        assert (nxt.request_id, made.created, nxt.dispatched_at) == (made.request_id, True, None)
        # The run counted once, from the landed row (the lost attempt counted nothing).
        after = REGISTRY.get_sample_value("onceflow_attempts_total", labels) or 0.0
        assert after - succeeded == 1
    else:
        row = losing_queue.fail(ref, {"type": "Boom"}, retryable=False)
        assert (row.status, row.error) == (Status.DEAD, {"type": "Boom"})
    assert losing_queue.lost == ["lost"]  # the first answer really was lost
    assert losing_queue.get(rid) == row


@pytest.mark.parametrize("losing_queue", ["sync", "async"], indirect=True)
def test_a_follow_up_that_existed_before_a_lost_hand_off_is_not_reported_created(
    losing_queue: Any,
) -> None:
    # The follow-up was enqueued by another path first: the lost attempt's insert was a
    # no-op, so the retry that finds the landed hand-off must not claim it was created there.
    then = [NewRequest("w", "pre-next", "next")]  # deterministic id: the same row
    [early] = losing_queue.enqueue_many(then)
    assert early.created
    rid = losing_queue.enqueue("s", "w", "pre").request_id
    claim = losing_queue.claim(rid, "pw")
    assert claim is not None
    row, [made] = losing_queue.hand_off(ClaimRef(rid, claim.token), {"ok": 1}, then=then)
    assert losing_queue.lost == ["lost"]
    assert row.status is Status.SUCCEEDED
    assert (made.request_id, made.created) == (early.request_id, False)


class LoseClaimInFlight:
    """A queue whose first claim's answer is lost while its commit is still in flight: that
    attempt runs on a backend of its own, whose transaction commits only once another
    statement waits on the row lock it holds; meanwhile every backend of the queue is killed
    (LOST_APP) and a real dead connection says so."""

    url: str  # the test database, for the in-flight attempt (not LOST_APP: not killed)
    lost: list[str]  # the token of the attempt whose answer was lost
    waited: list[bool]  # whether a statement waited on its row lock before it committed
    committer: list[threading.Thread]

    def _claim_once(self, params: dict[str, Any]) -> Steps[Any]:
        if self.lost:
            return (yield from super()._claim_once(params))  # type: ignore[misc]
        self.lost.append(params["token"])
        probe = FetchOne(Query("test.probe", "SELECT 1 AS one"), {})
        yield probe  # this call's connection, as the claim would have used it
        first = psycopg.connect(self.url)
        first.execute(sql.CLAIM.sql_for(params), params)  # the claim made, its commit not yet
        committer = threading.Thread(target=self._commit_once_waited_on, args=(first,))
        committer.start()
        self.committer.append(committer)
        kill_backends(ADMIN[0], "application_name = %s", LOST_APP)
        yield probe  # raises ConnectionLost
        raise AssertionError("the probe on a killed backend answered")

    def _commit_once_waited_on(self, first: psycopg.Connection[Any]) -> None:
        pid = first.info.backend_pid
        sql = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
        try:
            with psycopg.connect(self.url, autocommit=True) as watch:
                wait_for(lambda: watch.execute(sql, (pid,)).fetchone()[0], timeout=30)  # type: ignore[index]
            self.waited.append(True)
        except AssertionError:
            self.waited.append(False)
        finally:
            first.commit()
            first.close()


class LostClaimSync(LoseClaimInFlight, Queue):
    pass


class LostClaimAsync(LoseClaimInFlight, AsyncQueue):
    pass


@pytest.fixture()
def losing_claimer(
    request: pytest.FixtureRequest, clean_db: Engine, services: tuple[str, str]
) -> Iterator[Any]:
    """A LoseClaimInFlight queue of each API, its connections named LOST_APP."""
    ADMIN[:] = [services[0]]
    url = clean_db.url.update_query_dict({"application_name": LOST_APP})
    engine = own_engine(clean_db, LOST_APP, pool_size=2)
    sync, asyn = LostClaimSync(engine), LostClaimAsync(url.render_as_string(hide_password=False))
    for q in (sync, asyn):
        q.url = libpq(clean_db.url.render_as_string(hide_password=False))
        q.lost, q.waited, q.committer = [], [], []
    try:
        yield from both(lambda: sync, lambda: asyn, request.param)
    finally:
        for thread in sync.committer + asyn.committer:
            thread.join(timeout=60)
        engine.dispose()


@pytest.mark.parametrize("losing_claimer", ["sync", "async"], indirect=True)
def test_a_claim_whose_answer_was_lost_while_it_committed_is_taken_up(
    losing_claimer: Any, queue: Queue
) -> None:
    """The retry reads its own claim (nothing yet: the lost attempt has not committed), claims
    again, waits on the lost attempt's row lock and, once that committed, matches nothing: the
    row runs under this call's token, which claim() must return, not None."""
    rid = queue.enqueue("s", "w", "in-flight").request_id
    claim = losing_claimer.claim(rid, "pw", lease_seconds=60)
    assert losing_claimer.waited == [True]  # the retried claim waited on the lost one's lock
    assert claim is not None and claim.token == losing_claimer.lost[0]
    row = queue.get(rid)
    assert (row.status, row.claimed_by, row.attempts, row.crash_attempts) == (
        Status.RUNNING, "pw", 1, 0,
    )  # fmt: skip
    assert claim.request == row
    queue.heartbeat(claim)  # the claim holds the live lease
    assert queue.complete(claim, {"ok": 1}).status is Status.SUCCEEDED


def test_finish_writes_what_hand_off_writes_and_returns_only_the_follow_ups(
    api_queue: Queue,
) -> None:
    """finish is hand_off's write without the row read back: by a Claim and by a ref, the
    rows end as hand_off leaves its twins (all but the clock and the token's digest), the
    follow-ups are enqueued in its transaction, and a fenced-off finish writes nothing."""
    nxt = {"input": {"n": 1}, "dedupe": False}
    for job in ("fin-claim", "fin-ref", "ho-claim", "ho-ref"):
        api_queue.enqueue("s", "w", job, input={"job": job})
    claims = {c.request.job_id: c for c in api_queue.claim_next("default", "pw", limit=4)}
    assert sorted(claims) == ["fin-claim", "fin-ref", "ho-claim", "ho-ref"]

    def ref(job: str) -> ClaimRef:
        return ClaimRef(claims[job].request_id, claims[job].token)

    def then(job: str) -> list[NewRequest]:
        return [NewRequest("w", f"{job}-next", "next", **nxt)]  # type: ignore[arg-type]

    done = {
        "fin-claim": api_queue.finish(claims["fin-claim"], {"ok": 1}, then=then("fin-claim")),
        "fin-ref": api_queue.finish(ref("fin-ref"), {"ok": 1}, then=then("fin-ref")),
        "ho-claim": api_queue.hand_off(claims["ho-claim"], {"ok": 1}, then=then("ho-claim"))[1],
        "ho-ref": api_queue.hand_off(ref("ho-ref"), {"ok": 1}, then=then("ho-ref"))[1],
    }
    varies = {"request_id", "job_id", "input", "input_hash", "claimed_at", "heartbeat_at",
              "run_after", "created_at", "dispatched_at", "updated_at", "finished_at"}  # fmt: skip
    rows = {job: api_queue.get(claims[job].request_id).as_json() for job in claims}
    for job, row in rows.items():
        assert row["status"] == "succeeded" and row["result"] == {"ok": 1}
        assert row["finished_at"] is not None and row["lease_expires_at"] is None
        assert {k: v for k, v in row.items() if k not in varies} == {
            k: v for k, v in rows["ho-claim"].items() if k not in varies
        }
        [made] = done[job]
        assert made.created and made.stage == "next" and made.workspace_id == "w"
        assert api_queue.get(made.request_id).job_id == f"{job}-next"
    # Fenced: a finish by a claim that no longer holds the row is refused, writes nothing.
    api_queue.enqueue("s", "w", "fin-late")
    [late] = api_queue.claim_next("default", "pw")
    api_queue.fail(late, {"type": "Boom"}, retryable=True, retry_in=0)
    with pytest.raises(LeaseLost):
        api_queue.finish(late, {"ok": 2}, then=then("fin-late"))
    assert api_queue.get(late.request_id).status is Status.QUEUED
    assert api_queue.list(job_id="fin-late-next") == []


def test_rescue_expired_requeues_then_quarantines(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    rid = api_queue.enqueue("s", "w", "j", max_crash_attempts=2).request_id
    now = db_now(clean_db)
    assert api_queue.claim(rid, "a", lease_seconds=5, now=now) is not None
    # Two sweepers at once: the compare-and-set lets only one act on the row.
    first = queue.rescue_expired(now=now + timedelta(seconds=6))
    second = queue.rescue_expired(now=now + timedelta(seconds=6))
    assert first.rescued == [rid] and second.rescued == []
    assert first.to_dispatch == [Dispatch(rid, "s", "default", "w")]
    assert api_queue.get(rid).crash_attempts == 1
    # Crash again: the budget of 2 lapsed leases is spent, the request is quarantined (dead).
    assert api_queue.claim(rid, "b", lease_seconds=5, now=now + timedelta(seconds=7)) is not None
    swept = queue.rescue_expired(now=now + timedelta(seconds=13))
    assert swept.quarantined == [rid]
    dead = api_queue.get(rid)
    assert (dead.status, dead.crash_attempts, dead.error["type"]) == (Status.DEAD, 2, "LeaseLapsed")


def test_fail_refuses_a_retryable_that_is_not_a_bool(api_queue: Queue) -> None:
    # Before: bool("no") is True: a caller's "no" retried the request.
    api_queue.enqueue("s", "w", "retryable-str")
    [claim] = api_queue.claim_next("default", "a")
    for bad in ("no", 0, None, "false"):
        with pytest.raises(InvalidRequest, match="retryable"):
            api_queue.fail(claim, {"type": "E"}, retryable=bad)  # type: ignore[arg-type]
    row = api_queue.get(claim.request_id)
    assert (row.status, row.error, row.attempts) == (Status.RUNNING, None, 1)


def _sweeping(engine: Engine) -> bool:
    """Whether a rescue statement is running (pg_stat_activity, read afresh: a new
    transaction each time; its query text is cut at track_activity_query_size)."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                    " AND query LIKE '%w.status = ''running'' AND w.lease_expires_at <= n.now%'"
                    " AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        )


def test_a_cancel_committed_during_a_sweep_is_not_lost(queue: Queue, clean_db: Engine) -> None:
    """A cancel that commits after a sweep's statement began, before it locked the row:
    the sweep's rescue must see it (cancelled), not requeue the row as if it never came."""
    fillers = 30_000  # lapsed rows swept ahead of the target: the window the cancel lands in
    with clean_db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO workspace_process_requests (request_id, workspace_id, job_id,"
                " branch_path, stage, dedupe, input, input_hash, worker_class, status,"
                " claim_token, claimed_by, lease_expires_at, attempts, max_attempts,"
                " max_crash_attempts)"
                " SELECT 'fill-' || g, 'wf', 'fill-' || g, '', 's', false, '{}', 'h', 'wf',"
                " 'running', 't' || g, 'x', now() - interval '2 hours' + g * interval '1 ms',"
                " 1, 5, 3 FROM generate_series(1, :n) g"
            ),
            {"n": fillers},
        )
    rid = queue.enqueue("s", "w", "cancel-in-sweep").request_id
    now = db_now(clean_db)
    assert queue.claim(rid, "a", lease_seconds=5, now=now) is not None
    with ThreadPoolExecutor(1) as pool:
        sweep = pool.submit(queue.rescue_expired, limit=fillers + 1, now=now + timedelta(seconds=6))
        wait_for(lambda: _sweeping(clean_db), timeout=30, interval=0.002)  # its snapshot taken
        cancelled = queue.cancel(rid)
        assert not sweep.done(), "the cancel must land while the sweep runs (more fillers)"
        assert cancelled.status is Status.RUNNING and cancelled.cancel_requested
        swept = sweep.result(timeout=60)
    assert rid in swept.quarantined and rid not in swept.rescued
    assert queue.get(rid).status is Status.CANCELLED
    assert queue.claim(rid, "b") is None


def test_rescue_never_touches_a_live_or_finished_claim(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    live = api_queue.enqueue("s", "w", "live").request_id
    done = api_queue.enqueue("s", "w", "done").request_id
    claim_live = api_queue.claim(live, "a", lease_seconds=60)
    claim_done = api_queue.claim(done, "a", lease_seconds=1)
    assert claim_live is not None and claim_done is not None
    api_queue.complete(claim_done, {"v": 1})
    swept = queue.rescue_expired(now=db_now(clean_db) + timedelta(seconds=30))
    assert swept.rescued == [] and swept.quarantined == []
    assert api_queue.get(done).status is Status.SUCCEEDED
    api_queue.heartbeat(claim_live)


def test_due_for_dispatch_resends_only_stale_wakeups(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    now = db_now(clean_db)
    assert queue.due_for_dispatch(redispatch_after=30, now=now) == []
    later = now + timedelta(seconds=31)
    assert queue.due_for_dispatch(redispatch_after=30, now=later) == [
        Dispatch(rid, "s", "default", "w")
    ]
    assert queue.due_for_dispatch(redispatch_after=30, now=later) == []


def test_database_down_is_a_clear_error() -> None:
    q = Queue("postgresql+psycopg://127.0.0.1:1/nothing")
    with pytest.raises(DatabaseUnavailable):
        q.get("x")
    assert os.environ.get("ONCEFLOW_DATABASE_URL") != "postgresql+psycopg://127.0.0.1:1/nothing"


def test_a_completion_returns_the_whole_request_by_claim_and_by_ref(api_queue: Queue) -> None:
    """By a Claim only what a run may change is read back (the claim holds the rest); the
    request returned is the row as a read gets it, also after a heartbeat and a cancel
    changed it under the claim, and the same as what a reference gets."""
    for job in ("a", "b"):
        api_queue.enqueue("s", "w", job, input={"doc": job, "n": [1, 2]})
    ca, cb = api_queue.claim_next("default", "pw", limit=2)
    api_queue.heartbeat(ca)
    assert api_queue.cancel(ca.request_id).cancel_requested
    moved = api_queue.get(ca.request_id)
    assert moved.heartbeat_at != ca.request.heartbeat_at
    assert moved.updated_at != ca.request.updated_at
    by_claim = api_queue.complete(ca, {"ok": 1})
    assert by_claim.cancel_requested and by_claim.lease_expires_at is None
    assert by_claim.heartbeat_at == moved.heartbeat_at and by_claim.result == {"ok": 1}
    by_ref = api_queue.complete(ClaimRef(cb.request_id, cb.token), {"ok": 1})
    assert by_claim.input == {"doc": ca.request.input["doc"], "n": [1, 2]}
    assert by_ref.input == {"doc": cb.request.input["doc"], "n": [1, 2]}
    assert by_claim == api_queue.get(ca.request_id)
    assert by_ref == api_queue.get(cb.request_id)
