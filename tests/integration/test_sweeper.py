"""The sweeper's building blocks on a real Postgres: concurrent sweeps, retention, tombstones.

The sweeps run on both APIs (``api_queue``: Queue and AsyncQueue) but for the concurrent
processes (Queue); the setup (enqueue, claims, reads) runs on the sync ``queue``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from onceflow import InvalidRequest, NewRequest, Queue, Settings, Status
from onceflow.models import Dispatch
from tests.both_apis import Blocking
from tests.conftest import table_snapshot
from tests.integration.test_claims import db_now


def _sweep(database_url: str, when: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    from datetime import datetime

    from onceflow.queue import Queue as Q

    q = Q(database_url)
    now = datetime.fromisoformat(when)
    rescued: list[str] = []
    while True:
        result = q.sweep_once(now=now, limit=50)
        if not result.rescued:
            break
        rescued += result.rescued
    out.put(rescued)


def test_two_sweepers_at_once_split_the_work(queue: Queue, clean_db: Engine, database_url: str):
    queue.enqueue_many([NewRequest("w", f"j{i}", "s") for i in range(400)])
    now = db_now(clean_db)
    claims = queue.claim_next("default", "crashing-worker", limit=400, lease_seconds=5, now=now)
    assert len(claims) == 400
    later = (now + timedelta(seconds=6)).isoformat()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_sweep, args=(database_url, later, out)) for _ in range(2)]
    for p in procs:
        p.start()
    lists = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    seen = Counter(rid for lst in lists for rid in lst)
    assert len(seen) == 400 and set(seen.values()) == {1}
    assert queue.counts()["default"]["queued"] == 400
    assert {r.crash_attempts for r in queue.list(limit=1000)} == {1}


def test_retention_keeps_tombstones_then_deletes_but_never_dead(
    api_queue: Queue, clean_db: Engine, database_url: str
) -> None:
    settings = Settings(
        database_url=database_url, payload_retention_seconds=60, retention_seconds=3600
    )
    queue = Queue(clean_db, settings=settings)
    sweeper = getattr(api_queue, "target", api_queue)  # the Queue, or the AsyncQueue behind it
    sweeper.settings = settings
    done = queue.enqueue("s", "w", "done", "", {"big": "payload"}).request_id
    dead = queue.enqueue("s", "w", "dead", "", {"x": 1}).request_id
    now = db_now(clean_db)
    c1 = queue.claim(done, "a", now=now)
    c2 = queue.claim(dead, "a", now=now)
    assert c1 is not None and c2 is not None
    queue.complete(c1, {"answer": 42}, now=now)
    queue.fail(c2, {"type": "Boom"}, retryable=False, now=now)

    assert api_queue.sweep_once(now=now + timedelta(seconds=30)).pruned == 0  # nothing is due
    assert api_queue.sweep_once(now=now + timedelta(seconds=61)).pruned == 1
    tomb = queue.get(done)
    assert (tomb.status, tomb.input, tomb.result) == (Status.SUCCEEDED, None, None)
    # The tombstone still collapses duplicates and still knows the input's fingerprint.
    again = queue.enqueue("s", "w", "done", "", {"big": "payload"})
    assert (again.created, again.input_mismatch) == (False, False)
    assert queue.enqueue("s", "w", "done", "", {"other": 1}).input_mismatch

    assert api_queue.sweep_once(now=now + timedelta(seconds=3601)).pruned == 1
    assert queue.enqueue("s", "w", "done", "", {"big": "payload"}).created  # window passed
    dead_row = queue.get(dead)
    assert (dead_row.status, dead_row.error) == (Status.DEAD, {"type": "Boom"})


def test_no_retention_configured_prunes_nothing(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    claim = queue.claim(rid, "a")
    assert claim is not None
    queue.complete(claim, {"v": 1})
    swept = api_queue.sweep_once(now=db_now(clean_db) + timedelta(days=3650))
    assert swept.pruned == 0
    assert queue.get(rid).result == {"v": 1}


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_sweep_callbacks_run_off_the_event_loop_each_batch_after_its_statement(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    # send and backlog do broker I/O: on AsyncQueue they run in a worker thread, never on
    # the loop; on both APIs each batch is handed over once its marks are committed.
    ids = sorted(r.request_id for r in queue.enqueue_many([NewRequest("w", f"c{i}", "s")
                                                           for i in range(3)]))  # fmt: skip
    t0 = db_now(clean_db)
    assert queue.claim(ids[0], "crashed", lease_seconds=5, now=t0) is not None
    for rid in ids[1:]:
        queue.mark_undispatched(rid)  # their wake-ups failed to send
    batches: list[list[str]] = []
    asked: list[list[str]] = []

    def send(batch: Sequence[Dispatch]) -> None:
        assert not _on_a_loop(), "send ran on the event loop"
        got = sorted(d.request_id for d in batch)
        with clean_db.connect() as conn:  # another connection: the marks are committed
            marked = conn.execute(
                text(
                    "SELECT count(*) FROM workspace_process_requests"
                    " WHERE request_id = ANY(:ids) AND dispatched_at IS NOT NULL"
                ),
                {"ids": got},
            ).scalar_one()
        assert marked == len(got)
        batches.append(got)

    def backlog(classes: Sequence[str]) -> dict[str, int]:
        assert not _on_a_loop(), "backlog ran on the event loop"
        asked.append(list(classes))
        return {wc: 0 for wc in classes}

    first = api_queue.sweep_once(now=t0 + timedelta(seconds=6), send=send, backlog=backlog)
    assert first.rescued == [ids[0]]
    assert batches == [[ids[0]], ids[1:]]  # the rescued row's wake-up, then the never-sent
    assert asked == []  # nothing stale: the broker is not asked
    later = t0 + timedelta(seconds=60)
    again = api_queue.sweep_once(redispatch_after=10, now=later, send=send, backlog=backlog)
    assert asked == [["default"]]  # stale, none waiting in the broker: all three re-sent
    assert sorted(d.request_id for d in again.to_dispatch) == ids
    assert batches[2:] == [ids]


def test_an_async_send_is_awaited_by_asyncqueue_and_refused_by_queue(
    api_queue: Queue, queue: Queue
) -> None:
    ids = sorted(r.request_id for r in queue.enqueue_many([NewRequest("w", "a1", "s")]))
    queue.mark_undispatched(ids[0])  # its wake-up failed to send: the sweep sends it
    sent: list[str] = []

    async def send(batch: Sequence[Dispatch]) -> None:
        await asyncio.sleep(0)
        sent.extend(d.request_id for d in batch)

    if isinstance(api_queue, Blocking):
        assert [d.request_id for d in api_queue.sweep_once(send=send).to_dispatch] == ids
        assert sent == ids
    else:  # nothing could await it: refused, not silently dropped
        with pytest.raises(TypeError, match="async"):
            api_queue.sweep_once(send=send)
        assert sent == []


#: Ages a retention step must refuse: each would prune what the policy keeps (a negative or
#: zero age takes a row finished just now: the dedup tombstone), or is no age at all.
BAD_AGES: list[object] = [
    -3600, -0.5, 0, 0.0, float("nan"), float("inf"), float("-inf"), True, False, "3600", [60],
]  # fmt: skip
BAD_LIMITS: list[object] = [0, -1, True, 1.5, "10", 100_001, None]


def test_prune_refuses_bad_ages_and_limits_and_changes_nothing(
    api_queue: Queue, queue: Queue, clean_db: Engine
) -> None:
    done = queue.enqueue("s", "w", "done", input={"big": 1}).request_id
    claim = queue.claim(done, "a")
    assert claim is not None
    queue.complete(claim, {"ok": 1})  # finished just now: its row is the dedup tombstone
    queue.cancel(queue.enqueue("s", "w", "cancelled").request_id)
    later = db_now(clean_db) + timedelta(seconds=5)
    snapshot = table_snapshot(clean_db)
    calls: list[dict[str, object]] = []
    for bad in BAD_AGES:
        # The other age is valid and due: nothing may run before the bad one is refused.
        calls.append({"retention_seconds": bad, "payload_retention_seconds": 1})
        calls.append({"retention_seconds": 1, "payload_retention_seconds": bad})
    for bad in BAD_LIMITS:
        calls.append({"retention_seconds": 1, "payload_retention_seconds": 1, "limit": bad})
    for kwargs in calls:
        with pytest.raises(InvalidRequest):
            api_queue.prune(**kwargs, now=later)
        assert table_snapshot(clean_db) == snapshot, kwargs
    # The same prune with sound values does apply (what the refusals held back).
    assert api_queue.prune(retention_seconds=None, payload_retention_seconds=1, now=later) == 1
    assert api_queue.prune(retention_seconds=1, payload_retention_seconds=None, now=later) == 2
    assert queue.list(workspace_id="w") == []
