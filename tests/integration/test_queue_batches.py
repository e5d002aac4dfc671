"""Batches of fenced writes, release and depth (onceflow.queue.batch) on a real Postgres.

Database time is moved with ``now=`` (never slept); the concurrent test runs real processes.
The batch calls run on both APIs (``api_queue``: Queue and AsyncQueue); the setup (enqueue,
claims, cancels, reads) on the sync ``queue``, and the many-process drain on Queue alone.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from datetime import datetime, timedelta

import psycopg
import pytest
from sqlalchemy import Engine, text

from onceflow import InvalidRequest, LeaseLost, NewRequest, Queue, Request, Status
from onceflow.models import Claim, Heartbeat
from onceflow.queue import Depth, Failure
from onceflow.settings import get_settings
from tests.conftest import libpq, table_snapshot


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value = conn.execute(text("SELECT now()")).scalar_one()
    assert isinstance(value, datetime)
    return value


def _claims(
    queue: Queue, n: int, *, wc: str = "default", lease: float = 10, **kw: object
) -> list[Claim]:
    queue.enqueue_many([NewRequest("w", f"{wc}-{i}", "s", worker_class=wc) for i in range(n)])
    claims = queue.claim_next(wc, "a", limit=n, lease_seconds=lease, **kw)  # type: ignore[arg-type]
    assert len(claims) == n
    return claims


def _steal(queue: Queue, claim: Claim, later: datetime) -> Claim:
    """Re-claim ``claim``'s row after its lease lapsed (at ``later``): ``claim`` is a zombie."""
    thief = queue.claim(claim.request_id, "thief", lease_seconds=60, now=later)
    assert thief is not None
    return thief


# ------------------------------------------------------------------------- complete_many


def test_complete_many_lands_every_row_in_input_order(api_queue: Queue, queue: Queue) -> None:
    claims = _claims(queue, 5)
    order = list(reversed(claims))
    out = api_queue.complete_many([(c, {"n": i}) for i, c in enumerate(order)])
    assert [r.request_id for r in out if isinstance(r, Request)] == [c.request_id for c in order]
    for i, (r, c) in enumerate(zip(out, order, strict=True)):
        assert isinstance(r, Request)
        assert r.status is Status.SUCCEEDED and r.result == {"n": i}
        assert queue.get(c.request_id).status is Status.SUCCEEDED
    assert api_queue.complete_many([]) == []


def test_complete_many_returns_each_whole_request_as_a_read_gets_it(
    api_queue: Queue, queue: Queue
) -> None:
    """Only what a run may change is read back (each claim holds the rest): the requests
    returned are the rows as a read gets them, also after a heartbeat and a cancel changed
    one under its claim."""
    queue.enqueue_many(
        [NewRequest("w", f"whole-{i}", "s", input={"doc": i, "n": [1, 2]}) for i in range(3)]
    )
    claims = queue.claim_next("default", "a", limit=3)
    moved = claims[1]
    queue.heartbeat(moved)
    assert queue.cancel(moved.request_id).cancel_requested
    assert queue.get(moved.request_id).updated_at != moved.request.updated_at
    out = api_queue.complete_many([(c, {"ok": i}) for i, c in enumerate(claims)])
    for i, (done, claim) in enumerate(zip(out, claims, strict=True)):
        assert isinstance(done, Request)
        assert done == queue.get(claim.request_id)
        assert done.result == {"ok": i} and done.input == {
            "doc": claim.request.input["doc"],
            "n": [1, 2],
        }
    assert out[1].cancel_requested and out[1].heartbeat_at != claims[1].request.heartbeat_at


def test_complete_many_stores_every_kind_of_result_as_sent(api_queue: Queue, queue: Queue) -> None:
    """The results travel as a binary array (no text-array quoting): quotes, backslashes,
    braces, commas, non-ASCII, JSON null, scalars and nesting land as they were sent."""
    results = [
        {"q": 'a"b\\c', "braces": "{x,y}", "u": "é ✓ \u2028"},
        None,
        [1, "two", {"three": [None, True]}],
        "a plain string, with a comma",
        0.5,
    ]
    claims = _claims(queue, len(results), wc="kinds")
    out = api_queue.complete_many(list(zip(claims, results, strict=True)))
    for done, claim, sent in zip(out, claims, results, strict=True):
        assert isinstance(done, Request) and done.result == sent
        assert queue.get(claim.request_id).result == sent


def test_complete_many_fences_each_row_a_zombie_row_is_lease_lost_and_unchanged(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 3, lease=30)
    t0 = db_now(clean_db)
    # Rows 0 and 2 heartbeat in time; row 1's holder pauses, its lease lapses, it is re-claimed.
    assert all(
        isinstance(b, Heartbeat)
        for b in api_queue.heartbeat_many([claims[0], claims[2]], now=t0 + timedelta(seconds=25))
    )
    thief = _steal(queue, claims[1], t0 + timedelta(seconds=31))
    before = queue.get(claims[1].request_id)
    out = api_queue.complete_many([(c, "done") for c in claims], now=t0 + timedelta(seconds=32))
    assert isinstance(out[0], Request) and out[0].status is Status.SUCCEEDED
    assert isinstance(out[2], Request) and out[2].status is Status.SUCCEEDED
    assert isinstance(out[1], LeaseLost) and out[1].request_id == claims[1].request_id
    assert queue.get(claims[1].request_id) == before  # the zombie wrote nothing
    mine = api_queue.complete_many([(thief, "mine")], now=t0 + timedelta(seconds=33))[0]
    assert isinstance(mine, Request) and mine.result == "mine"


def test_complete_many_bad_input_raises_and_changes_nothing(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 3)
    snapshot = table_snapshot(clean_db)
    huge = "x" * (get_settings().payload_limit_bytes + 1)
    deep: object = []
    for _ in range(get_settings().max_payload_depth + 2):
        deep = [deep]
    bad_batches: list[object] = [
        [(claims[0], 1), (claims[1], huge)],  # one result too big
        [(claims[0], 1), (claims[1], deep)],  # one result too deep
        [(claims[0], 1), (claims[0], 2)],  # the same request twice
        [(claims[0], 1), (claims[1].request_id, 2)],  # not a Claim
        [(claims[0], 1), claims[1]],  # not a pair
        [(claims[0], {1, 2})],  # not JSON
        "abc",  # not a sequence of pairs
    ]
    for batch in bad_batches:
        with pytest.raises(InvalidRequest):
            api_queue.complete_many(batch)  # type: ignore[arg-type]
    assert table_snapshot(clean_db) == snapshot


# ----------------------------------------------------------------------------- fail_many


def test_fail_many_next_status_per_row_and_error_kept(api_queue: Queue, queue: Queue) -> None:
    claims = _claims(queue, 3)
    queue.enqueue("s", "w", "once", max_attempts=1)
    once = queue.claim_next("default", "a", lease_seconds=10)[0]
    queue.cancel(claims[2].request_id)  # cancel requested while running
    out = api_queue.fail_many(
        [
            Failure(claims[0], {"why": "flaky"}, retry_in=0),  # queued, due at once
            Failure(claims[1], ValueError("bad row"), retryable=False),  # dead
            Failure(claims[2], {"why": "x"}),  # cancelled
            Failure(once, {"why": "last"}),  # retryable, but no attempts left: dead
        ]
    )
    statuses = [r.status for r in out if isinstance(r, Request)]
    assert statuses == [Status.QUEUED, Status.DEAD, Status.CANCELLED, Status.DEAD]
    assert [r.error for r in out if isinstance(r, Request)] == [
        {"why": "flaky"},
        {"type": "ValueError", "message": "bad row"},
        {"why": "x"},
        {"why": "last"},
    ]
    again = queue.claim(claims[0].request_id, "b")
    assert again is not None and again.attempt == 2


def test_fail_many_default_backoff_and_a_zombie_row(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 2, lease=30)
    t0 = db_now(clean_db)
    queue.heartbeat(claims[0], now=t0 + timedelta(seconds=25))
    _steal(queue, claims[1], t0 + timedelta(seconds=31))
    before = queue.get(claims[1].request_id)
    t = t0 + timedelta(seconds=32)
    out = api_queue.fail_many([Failure(c, "boom") for c in claims], now=t)
    assert isinstance(out[0], Request) and out[0].status is Status.QUEUED
    assert out[0].run_after > t  # backed off (backoff(1) > 0)
    assert isinstance(out[1], LeaseLost)
    assert queue.get(claims[1].request_id) == before
    snapshot = table_snapshot(clean_db)
    for bad in (
        [Failure(claims[0], "x", retry_in=-1)],
        [Failure(claims[0], "x", retryable="yes")],  # type: ignore[arg-type]
        [(claims[0], "x")],
        [Failure(claims[0], "x" * (get_settings().payload_limit_bytes + 1))],
    ):
        with pytest.raises(InvalidRequest):
            api_queue.fail_many(bad)  # type: ignore[arg-type]
    assert table_snapshot(clean_db) == snapshot


# ------------------------------------------------------------------------ heartbeat_many


def test_heartbeat_many_extends_live_leases_never_past_the_deadline(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 3, lease=10)
    queue.enqueue("s", "w", "capped")
    short = queue.claim_next("default", "a", lease_seconds=10, max_runtime=12)[0]
    assert short.run_deadline is not None
    t = db_now(clean_db) + timedelta(seconds=8)
    first = api_queue.heartbeat_many([claims[0], short, claims[2]], now=t)
    assert isinstance(first[0], Heartbeat) and first[0].lease_expires_at == t + timedelta(
        seconds=10
    )
    assert isinstance(first[1], Heartbeat)
    assert first[1].lease_expires_at == short.run_deadline  # capped: claim time + 12 s
    _steal(queue, claims[1], t + timedelta(seconds=3))  # claims[1] lapsed and was re-claimed
    out = api_queue.heartbeat_many(claims, now=t + timedelta(seconds=4))
    assert isinstance(out[0], Heartbeat) and out[0].lease_expires_at == t + timedelta(seconds=14)
    assert isinstance(out[1], LeaseLost) and out[1].request_id == claims[1].request_id
    assert isinstance(out[2], Heartbeat) and not out[2].cancel_requested
    assert queue.get(claims[1].request_id).claimed_by == "thief"
    assert api_queue.heartbeat_many([]) == []
    with pytest.raises(InvalidRequest):
        api_queue.heartbeat_many([claims[0], claims[0]])


# ------------------------------------------------------------------------------- release


def test_release_does_not_count_the_attempt_and_is_claimable_at_once(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 2)
    queue.cancel(claims[1].request_id)
    out = api_queue.release(claims)
    first, second = out
    assert isinstance(first, Request) and first.status is Status.QUEUED
    assert first.attempts == 0 and first.claimed_by is None and first.dispatched_at is None
    assert first.heartbeat_at is None and first.lease_expires_at is None
    assert first.run_after <= db_now(clean_db)
    assert isinstance(second, Request) and second.status is Status.CANCELLED
    assert second.finished_at is not None
    # The history: the release to cancelled is recorded as a cancel is (no claim ended, the
    # claim undone); the release to queued leaves no trace.
    with clean_db.connect() as conn:
        history = conn.execute(text(
            "SELECT request_id, event, next_status, attempt, claimed_by, ended_at "
            "FROM workspace_request_attempts ORDER BY seq"
        )).all()  # fmt: skip
    assert [tuple(h[:5]) for h in history] == [
        (claims[1].request_id, "cancel_requested", "running", None, None),
        (claims[1].request_id, "cancelled", "cancelled", None, None),
    ]
    assert history[1].ended_at == second.finished_at
    again = queue.claim_next("default", "b", lease_seconds=10)
    assert [c.request_id for c in again] == [claims[0].request_id]
    assert again[0].attempt == 1  # the released claim's attempt was not counted
    # The old claim is spent: releasing (or completing) it again is LeaseLost.
    assert isinstance(api_queue.release([claims[0]])[0], LeaseLost)
    assert queue.get(claims[0].request_id).claimed_by == "b"


def test_release_of_a_lapsed_or_reclaimed_claim_is_lease_lost_and_unchanged(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 2, lease=5)
    later = db_now(clean_db) + timedelta(seconds=6)
    before = queue.get(claims[0].request_id)
    out = api_queue.release([claims[0]], now=later)  # lapsed, not re-claimed
    assert isinstance(out[0], LeaseLost)
    assert queue.get(claims[0].request_id) == before
    thief = _steal(queue, claims[1], later)
    assert thief.request.crash_attempts == 1
    out = api_queue.release([claims[1]], now=later)
    assert isinstance(out[0], LeaseLost)
    assert queue.get(claims[1].request_id).claimed_by == "thief"
    # The thief's release takes back its attempt but keeps the crash it counted.
    released = api_queue.release([thief], now=later)[0]
    assert isinstance(released, Request) and released.status is Status.QUEUED
    assert released.attempts == 1 and released.crash_attempts == 1


def test_release_and_requeueing_failure_notify_listeners(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    url = libpq(clean_db.url.render_as_string(hide_password=False))
    quiet = Queue(clean_db, settings=get_settings().model_copy(update={"notify": False}))
    # Claimed before LISTEN: the enqueues' own NOTIFYs are not what this test is about.
    silent, gpu, cpu = (
        _claims(queue, 1, wc="silent"),
        _claims(queue, 2, wc="gpu"),
        _claims(queue, 1, wc="cpu"),
    )
    late, end = _claims(queue, 1, wc="late"), _claims(queue, 1, wc="end")
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN onceflow_work")
        quiet.release(silent)  # notify off: nothing sent
        api_queue.release(gpu)  # one NOTIFY per class, not per row
        api_queue.fail_many([Failure(c, "x", retry_in=0) for c in cpu])
        api_queue.fail_many([Failure(c, "x", retry_in=60) for c in late])
        api_queue.release(end)
        got: list[str] = []
        for note in listener.notifies(timeout=10):
            got.append(note.payload)
            if note.payload == "end":
                break
    assert got == ["gpu", "cpu", "end"]


# --------------------------------------------------------------------------------- depth


def test_depth_matches_the_truth(api_queue: Queue, queue: Queue, clean_db: Engine) -> None:
    assert api_queue.depth() == {}
    queue.enqueue_many([NewRequest("w", f"a{i}", "s", worker_class="a") for i in range(6)])
    queue.enqueue_many(
        [NewRequest("w", f"l{i}", "s", worker_class="a", run_after_seconds=600) for i in range(2)]
    )
    queue.enqueue_many([NewRequest("w", f"b{i}", "s", worker_class="b") for i in range(3)])
    done = queue.claim_next("a", "x", limit=2)
    running = queue.claim_next("a", "x", limit=1)
    api_queue.complete_many([(c, None) for c in done])
    queue.claim_next("b", "x", limit=3)
    t = db_now(clean_db) + timedelta(seconds=5)
    depth = api_queue.depth(now=t)
    assert set(depth) == {"a", "b"}
    a, b = depth["a"], depth["b"]
    assert (a.queued_due, a.queued_later, a.running) == (3, 2, 1)
    assert (b.queued_due, b.queued_later, b.running) == (0, 0, 3)
    assert b.oldest_due_age_seconds is None
    oldest = min(r.run_after for r in queue.list(worker_class="a", status="queued"))
    assert a.oldest_due_age_seconds == pytest.approx((t - oldest).total_seconds(), abs=1e-3)
    assert running  # still counted as running until completed
    assert api_queue.depth(["b", "none"], now=t) == {"b": b, "none": Depth(0, 0, 0, None)}
    assert api_queue.depth("a", now=t) == {"a": a}
    with pytest.raises(InvalidRequest):
        api_queue.depth("bad class!")


# ------------------------------------------------------------------ concurrent processes


def _drain(database_url: str, worker: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from onceflow.queue import Queue as Q

    q = Q(database_url)
    done: list[str] = []
    while True:
        claims = q.claim_next("default", worker, limit=25)
        if not claims:
            break
        for r in q.complete_many([(c, {"by": worker}) for c in claims]):
            assert isinstance(r, Request), r
            done.append(r.request_id)
    out.put(done)


def test_processes_drain_with_complete_many_each_row_exactly_once(
    queue: Queue, database_url: str, clean_db: Engine
) -> None:
    queue.enqueue_many([NewRequest("w", f"j{i}", "s") for i in range(600)])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_drain, args=(database_url, f"p{i}", out)) for i in range(4)]
    for p in procs:
        p.start()
    lists = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    seen = Counter(rid for lst in lists for rid in lst)
    assert len(seen) == 600 and set(seen.values()) == {1}
    with clean_db.connect() as conn:
        rows = conn.execute(
            text("SELECT status, attempts, count(*) FROM workspace_process_requests GROUP BY 1, 2")
        ).all()
    assert [tuple(r) for r in rows] == [("succeeded", 1, 600)]


# ------------------------------------------------------------------------------ blips

KILL_ONCE = """
CREATE SEQUENCE batch_kills;
CREATE FUNCTION kill_batch_backend() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- nextval is not rolled back: the first completion dies, the retry lands.
    IF nextval('batch_kills') <= 1 THEN
        PERFORM pg_terminate_backend(pg_backend_pid());
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER kill_batch BEFORE UPDATE ON workspace_process_requests
FOR EACH ROW WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION kill_batch_backend();
"""


def test_complete_many_killed_once_is_retried_and_lands_once(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    claims = _claims(queue, 3)
    with clean_db.begin() as conn:
        conn.execute(text(KILL_ONCE))
    try:
        out = api_queue.complete_many([(c, {"i": i}) for i, c in enumerate(claims)])
    finally:
        with clean_db.begin() as conn:
            conn.execute(text("DROP TRIGGER kill_batch ON workspace_process_requests"))
            killed = conn.execute(text("SELECT last_value FROM batch_kills")).scalar_one()
            conn.execute(text("DROP FUNCTION kill_batch_backend(); DROP SEQUENCE batch_kills"))
    assert killed >= 2  # the first attempt was killed, a second one ran
    assert [r.result for r in out if isinstance(r, Request)] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_repeated_batch_whose_answer_was_lost_recognises_its_own_writes(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    # A caller that lost the answer of a batch that committed sends it again: its own rows
    # come back as they landed, not as LeaseLost; a row someone else moved stays LeaseLost.
    claims = _claims(queue, 3, lease=30)
    t0 = db_now(clean_db)
    first = api_queue.complete_many([(c, "ok") for c in claims[:2]])
    again = api_queue.complete_many([(c, "ok") for c in claims[:2]])
    assert again == first
    failed = api_queue.fail_many([Failure(claims[2], "x", retry_in=0)])
    assert api_queue.fail_many([Failure(claims[2], "x", retry_in=0)]) == failed
    retry = queue.claim(claims[2].request_id, "b", lease_seconds=30)
    assert retry is not None
    released = api_queue.release([retry])
    assert api_queue.release([retry]) == released
    # Someone else's later claim of the row makes our repeat a LeaseLost.
    queue.claim(claims[2].request_id, "c", lease_seconds=30, now=t0 + timedelta(seconds=1))
    assert isinstance(api_queue.release([retry])[0], LeaseLost)
    assert isinstance(api_queue.fail_many([Failure(claims[2], "x")])[0], LeaseLost)


@pytest.mark.parametrize("write", ["complete_many", "fail_many", "release"])
def test_a_lapsed_claims_batch_write_is_not_taken_for_another_runs(
    api_queue: Queue, queue: Queue, clean_db: Engine, write: str
) -> None:
    """A batch row refused by its fence is recognised as the claim's own landed write by its
    token alone (``ended_run``), never by claimant and counts: an operator's requeue resets
    the counts and a worker id is stable, so a later run of the same worker can end the row
    with exactly the claimant, attempts and crash count the lapsed claim had."""
    rid = queue.enqueue("s", "w", "lapsed-batch", max_attempts=1).request_id
    t0 = db_now(clean_db)
    old = queue.claim(rid, "worker-1", lease_seconds=5, now=t0)
    assert old is not None
    later = t0 + timedelta(seconds=6)
    assert queue.rescue_expired(now=later).quarantined == [rid]  # hung past its lease: dead
    queue.requeue(rid, now=later)  # an operator runs it again
    new = queue.claim(rid, "worker-1", lease_seconds=60, now=later)  # same worker id
    assert new is not None
    assert (new.attempt, new.request.crash_attempts) == (old.attempt, old.request.crash_attempts)

    def batch(claim: Claim, what: str) -> Request | LeaseLost:
        if write == "complete_many":
            return api_queue.complete_many([(claim, {"by": what})], now=later)[0]
        if write == "fail_many":
            failure = Failure(claim, {"by": what}, retryable=False)
            return api_queue.fail_many([failure], now=later)[0]
        return api_queue.release([claim], now=later)[0]

    ended = batch(new, "new")  # the new run's write lands
    assert isinstance(ended, Request)
    assert ended.claimed_by == ("worker-1" if write != "release" else None)
    before = queue.get(rid)
    late = batch(old, "old")  # the lapsed claim's write comes back at last
    assert isinstance(late, LeaseLost) and late.request_id == rid
    assert queue.get(rid) == before  # and wrote nothing
    assert batch(new, "new") == ended  # the new run's own repeat is still recognised


def test_a_release_and_a_failure_of_one_claim_are_not_taken_for_each_other(
    api_queue: Queue, queue: Queue
) -> None:
    """Both leave a row queued (or cancelled); a retry recognises only its own kind of write."""
    released, failed = _claims(queue, 2)
    assert isinstance(api_queue.release([released])[0], Request)
    assert isinstance(api_queue.fail_many([Failure(released, "x", retry_in=0)])[0], LeaseLost)
    with pytest.raises(LeaseLost):
        api_queue.fail(released, "x", retry_in=0)
    assert isinstance(api_queue.fail_many([Failure(failed, "x", retry_in=0)])[0], Request)
    assert isinstance(api_queue.release([failed])[0], LeaseLost)
