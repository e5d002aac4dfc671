"""Writing many runs' outcomes at once (``onceflow.lifecycle.record.record_many``): the
standalone worker's completer. Real Postgres; each row ends as ``record`` would end it,
in one statement per kind of outcome.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow.context import StageContext
from onceflow.errors import PermanentError, RetryLater
from onceflow.lifecycle import decide, succeeded
from onceflow.lifecycle.record import record_many
from onceflow.models import NewRequest, Status
from onceflow.queue import Queue
from onceflow.settings import get_settings


@pytest.fixture()
def queue(clean_db: Engine) -> Iterator[Queue]:
    settings = get_settings().model_copy(update={"payload_limit_bytes": 10_000})
    made = Queue(clean_db, settings)
    yield made
    made.close()


def claimed(queue: Queue, n: int) -> list[StageContext]:
    items = [NewRequest("ws", f"job-{i}", "s", worker_class="w") for i in range(n)]
    queue.enqueue_many(items)
    claims = queue.claim_next("w", "host:1", n, lease_seconds=30)
    assert len(claims) == n
    return [StageContext(queue, c, "host:1") for c in claims]


def counted(queue: Queue, calls: Counter[str], *names: str) -> None:
    """Count the calls of ``queue``'s write methods ``names`` (the real ones run)."""
    for name in names:
        real: Callable[..., Any] = getattr(queue, name)

        def spy(*args: Any, _real: Callable[..., Any] = real, _name: str = name,
                **kwargs: Any) -> Any:  # fmt: skip
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(queue, name, spy)


def test_each_kind_is_written_in_one_statement_and_ends_as_record_would(
    queue: Queue, clean_db: Engine
) -> None:
    ctxs = claimed(queue, 6)
    # One run's lease is gone (its row taken back by the database's clock).
    with clean_db.begin() as conn:
        conn.execute(
            text("UPDATE workspace_process_requests SET lease_expires_at = now()"
                 " - interval '1 second' WHERE request_id = :r"),
            {"r": ctxs[5].claim.request_id},
        )  # fmt: skip
    outcomes = [
        succeeded({"n": 0}),
        succeeded({"n": 1}),
        decide(RetryLater(120, "busy"), max_delay=600.0),
        decide(PermanentError("bad data"), max_delay=600.0),
        decide(LookupError("no"), retry_on=(KeyError,), max_delay=600.0),
        succeeded({"n": 5}),
    ]
    calls: Counter[str] = Counter()
    counted(queue, calls, "complete_many", "fail_many", "finish", "fail")
    recorded = record_many(queue, list(zip(ctxs, outcomes, strict=True)))
    assert [r["outcome"] for r in recorded] == [
        "succeeded", "succeeded", "retry", "dead", "dead", "lease_lost",
    ]  # fmt: skip
    assert calls == Counter({"complete_many": 1, "fail_many": 1})  # no write per row
    rows = [queue.get(c.claim.request_id) for c in ctxs]
    assert [r.status for r in rows] == [
        Status.SUCCEEDED, Status.SUCCEEDED, Status.QUEUED, Status.DEAD, Status.DEAD,
        Status.RUNNING,
    ]  # fmt: skip
    assert rows[0].result == {"n": 0} and rows[5].result is None
    assert rows[2].error["type"] == "RetryLater"
    assert round((rows[2].run_after - rows[2].updated_at).total_seconds()) == 120


def test_a_batch_the_store_refuses_is_written_row_by_row(queue: Queue) -> None:
    ctxs = claimed(queue, 3)
    too_large = {"blob": "x" * 20_000}  # over the 10 kB payload limit: refuses the batch
    outcomes = [succeeded({"n": 0}), succeeded(too_large), succeeded({"n": 2})]
    recorded = record_many(queue, list(zip(ctxs, outcomes, strict=True)))
    # As record: the refused result fails its own run for good, the others complete.
    assert [r["outcome"] for r in recorded] == ["succeeded", "dead", "succeeded"]
    big = queue.get(ctxs[1].claim.request_id)
    assert big.status is Status.DEAD and big.error["type"] == "PayloadTooLarge"
    assert queue.get(ctxs[2].claim.request_id).result == {"n": 2}
