"""Claims and heartbeats commit lazily (``synchronous_commit = off`` for their own
transaction only); completions and a caller's transaction never do.

Whether a commit waited for the WAL flush cannot be seen after it; what the statement set
can: the observing connector below is the pooled connector with each statement run in an
explicit transaction, reading ``synchronous_commit`` just before that transaction commits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine, text

from onceflow import NewRequest, Queue
from onceflow.connector import PsycopgConnector, Query
from onceflow.db import fetch_all, raw_connection
from onceflow.settings import get_settings


class Observing(PsycopgConnector):
    """The pooled connector; records (statement name, synchronous_commit at its commit)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.seen: list[tuple[str, str]] = []

    def _observed(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        with raw_connection(self.engine) as raw, raw.transaction():
            rows = fetch_all(raw, query.sql_for(params), dict(params))
            mode = raw.execute("SELECT current_setting('synchronous_commit')").fetchone()
            assert mode is not None
            self.seen.append((query.name, str(mode[0])))
        return rows

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        rows = self._observed(query, params)
        return rows[0] if rows else None

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self._observed(query, params)


def _observed_queue(engine: Engine, *, lazy: bool) -> tuple[Queue, Observing]:
    settings = get_settings().model_copy(update={"lazy_claim_commits": lazy})
    queue = Queue(engine, settings=settings)
    observer = Observing(engine)
    queue.connector = observer
    return queue, observer


def test_claims_and_heartbeats_commit_lazily_completions_durably(clean_db: Engine) -> None:
    queue, seen = _observed_queue(clean_db, lazy=True)
    queue.enqueue_many([NewRequest("w1", f"j{i}", "evaluate") for i in range(3)])
    claim = queue.claim_next("default", "w-1")[0]
    queue.heartbeat(claim)
    queue.heartbeat_many([claim])
    queue.complete(claim, {"ok": True})  # by Claim: queue.complete_changed
    queue.finish(queue.claim_next("default", "w-1")[0], {"ok": True})  # a Celery stage's
    by_id = queue.list(workspace_id="w1", status="queued")[0].request_id
    other = queue.claim(by_id, "w-1")
    assert other is not None
    queue.fail(other, {"type": "Boom"}, retryable=False)
    modes = dict(seen.seen)
    assert modes["queue.claim_next"] == "off"
    assert modes["queue.heartbeat"] == "off"
    assert modes["queue.heartbeat_many"] == "off"
    assert modes["queue.claim"] == "off"
    # Completions, failures and enqueues keep the server's durable default.
    assert modes["queue.complete_changed"] == "on"
    assert modes["queue.finish"] == "on"
    assert modes["queue.fail"] == "on"
    assert modes["queue.enqueue"] == "on"


def test_the_setting_off_keeps_every_commit_durable(clean_db: Engine) -> None:
    queue, seen = _observed_queue(clean_db, lazy=False)
    queue.enqueue("evaluate", "w1", "j1")
    claim = queue.claim_next("default", "w-1")[0]
    queue.heartbeat(claim)
    assert {mode for _, mode in seen.seen} == {"on"}


def test_a_claim_in_the_callers_transaction_leaves_its_commit_durable(clean_db: Engine) -> None:
    """On a caller's connection the claim's statement must not make the caller's whole
    transaction lazy: it sets the setting to what it already is."""
    from onceflow.connector import SQLAlchemyConnector, run
    from onceflow.queue.claims import ClaimOps

    queue = Queue(clean_db)
    queue.enqueue("evaluate", "w1", "j1")
    with clean_db.begin() as conn:
        steps = ClaimOps.claim_next.steps(queue, "default", "w-1")  # type: ignore[attr-defined]
        claims = run(SQLAlchemyConnector(conn), steps)
        assert len(claims) == 1
        mode = conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar()
    assert mode == "on"
