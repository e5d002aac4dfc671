"""The sweeper's building blocks on a real Postgres: concurrent sweeps, retention, tombstones."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from datetime import timedelta

from sqlalchemy import Engine

from onceflow import NewRequest, Queue, Settings, Status
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
    clean_db: Engine, database_url: str
) -> None:
    settings = Settings(
        database_url=database_url, payload_retention_seconds=60, retention_seconds=3600
    )
    queue = Queue(clean_db, settings=settings)
    done = queue.enqueue("s", "w", "done", "", {"big": "payload"}).request_id
    dead = queue.enqueue("s", "w", "dead", "", {"x": 1}).request_id
    now = db_now(clean_db)
    c1 = queue.claim(done, "a", now=now)
    c2 = queue.claim(dead, "a", now=now)
    assert c1 is not None and c2 is not None
    queue.complete(c1, {"answer": 42}, now=now)
    queue.fail(c2, {"type": "Boom"}, retryable=False, now=now)

    assert queue.sweep_once(now=now + timedelta(seconds=30)).pruned == 0  # nothing is due
    assert queue.sweep_once(now=now + timedelta(seconds=61)).pruned == 1
    tomb = queue.get(done)
    assert (tomb.status, tomb.input, tomb.result) == (Status.SUCCEEDED, None, None)
    # The tombstone still collapses duplicates and still knows the input's fingerprint.
    again = queue.enqueue("s", "w", "done", "", {"big": "payload"})
    assert (again.created, again.input_mismatch) == (False, False)
    assert queue.enqueue("s", "w", "done", "", {"other": 1}).input_mismatch

    assert queue.sweep_once(now=now + timedelta(seconds=3601)).pruned == 1
    assert queue.enqueue("s", "w", "done", "", {"big": "payload"}).created  # window passed
    dead_row = queue.get(dead)
    assert (dead_row.status, dead_row.error) == (Status.DEAD, {"type": "Boom"})


def test_no_retention_configured_prunes_nothing(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "w", "j").request_id
    claim = queue.claim(rid, "a")
    assert claim is not None
    queue.complete(claim, {"v": 1})
    swept = queue.sweep_once(now=db_now(clean_db) + timedelta(days=3650))
    assert swept.pruned == 0
    assert queue.get(rid).result == {"v": 1}
