"""Claims scoped to workspaces on real Postgres: the filter is in the claim's SKIP LOCKED
select (another workspace's row is never locked), every fenced write checks the reference's
workspaces, a scoped wait does not count other workspaces' work as due, and a scoped claim
works over every shard of a database split by workspace."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from onceflow import AsyncQueue, ClaimRef, LeaseLost, NewRequest, Queue
from onceflow.models import WorkspaceScope
from onceflow.queue.sql import claim_next_sql
from onceflow.shards import ShardMap
from tests.conftest import libpq
from tests.integration.test_shards import (  # noqa: F401 - fixtures: template, shards
    rows_of,
    shards,
    spread_workspaces,
    template,
)

ACME = WorkspaceScope.parse(["acme-*"])
CLAIM_COLUMNS = (
    "status, attempts, crash_attempts, claim_token, claimed_by, claimed_at, lease_expires_at,"
    " heartbeat_at, updated_at"
)


def row(engine: Engine, ws: str) -> tuple[Any, ...]:
    with engine.connect() as conn:
        return tuple(
            conn.execute(
                text(
                    f"SELECT {CLAIM_COLUMNS} FROM workspace_process_requests"  # noqa: S608
                    " WHERE workspace_id = :ws"
                ),
                {"ws": ws},
            ).one()
        )


def enqueue(queue: Any, ws: str, priority: int = 0) -> str:
    item = NewRequest(workspace_id=ws, job_id="j", stage="s", priority=priority)
    (made,) = queue.enqueue_many([item])
    return str(made.request_id)


def test_a_scoped_claim_takes_only_its_workspaces(api_queue: Any, clean_db: Engine) -> None:
    # Another tenant's row first in line (higher priority): an unscoped claim would take it.
    enqueue(api_queue, "globex", priority=10)
    for ws in ("acme-1", "acme-2", "acmeco"):
        enqueue(api_queue, ws)
    before = row(clean_db, "globex")
    claims = api_queue.claim_next("default", "w", limit=10, workspaces=["acme-*"])
    assert sorted(c.request.workspace_id for c in claims) == ["acme-1", "acme-2"]
    exact = api_queue.claim_next("default", "w", limit=10, workspaces=["acmeco"])
    assert [c.request.workspace_id for c in exact] == ["acmeco"]
    assert api_queue.claim_next("default", "w", workspaces=["acme-*", "acmeco"]) == []
    assert row(clean_db, "globex") == before and before[0] == "queued"
    with pytest.raises(Exception, match="only at the end"):
        api_queue.claim_next("default", "w", workspaces=["ac*me"])
    (taken,) = api_queue.claim_next("default", "w", workspaces=["*"])
    assert taken.request.workspace_id == "globex"


def test_a_scoped_claim_never_locks_another_workspaces_row(queue: Queue, clean_db: Engine) -> None:
    enqueue(queue, "globex", priority=10)
    enqueue(queue, "acme-1")
    params = {
        "worker_class": "default", "worker_id": "w", "tokens": "t" * 32, "lease_seconds": 30.0,
        "max_runtime": None, "now": None, "lazy": False, "terms": None,
        "ws_exact": [], "ws_prefixes": ["acme-"],
    }  # fmt: skip
    url = libpq(clean_db.url.render_as_string(hide_password=False))
    with (
        psycopg.connect(url) as claimer,
        psycopg.connect(url, autocommit=True) as other,
        claimer.transaction(),
    ):
        claimed = claimer.execute(claim_next_sql(1, True), params).fetchall()
        assert len(claimed) == 1  # acme-1, its lock held until this transaction ends
        # The globex row, scanned first (higher priority), was filtered before locking.
        free = other.execute(
            "SELECT workspace_id FROM workspace_process_requests"
            " WHERE workspace_id = 'globex' FOR UPDATE NOWAIT"
        ).fetchall()
        assert free == [("globex",)]
        with pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute(
                "SELECT 1 FROM workspace_process_requests"
                " WHERE workspace_id = 'acme-1' FOR UPDATE NOWAIT"
            )


def test_fenced_writes_refuse_a_reference_outside_its_workspaces(
    api_queue: Any, clean_db: Engine
) -> None:
    rid = enqueue(api_queue, "globex")
    (claim,) = api_queue.claim_next("default", "w")
    before = row(clean_db, "globex")
    for ws in (None, "globex"):
        ref = ClaimRef(rid, claim.token, None, ws, ACME)
        with pytest.raises(LeaseLost):
            api_queue.heartbeat(ref, lease_seconds=600)
        with pytest.raises(LeaseLost):
            api_queue.complete(ref, {"stolen": True})
        with pytest.raises(LeaseLost):
            api_queue.fail(ref, "x")
        assert api_queue.live_claim(rid, claim.token, workspaces=ACME) is None
        assert api_queue.claim_parent(ref) is None
    assert row(clean_db, "globex") == before
    own = ClaimRef(rid, claim.token, None, None, WorkspaceScope.parse(["globex"]))
    api_queue.heartbeat(own)  # its own workspace: the same fence passes


def test_a_scoped_wait_does_not_count_other_workspaces_work(queue: Queue) -> None:
    enqueue(queue, "globex")
    assert queue.wait_for_work("default", 0) is True  # unscoped: due now
    assert queue.wait_for_work("default", 0, workspaces=ACME) is False  # not ours: no spin

    async def scoped_async() -> bool:
        aq = AsyncQueue.from_queue(queue)
        try:
            return await aq.wait_for_work("default", 0, workspaces=ACME)
        finally:
            await aq.aclose()

    assert asyncio.run(scoped_async()) is False
    enqueue(queue, "acme-1")
    assert queue.wait_for_work("default", 0, workspaces=ACME) is True
    assert asyncio.run(scoped_async()) is True


def test_a_scoped_claim_over_every_shard(shards: list[str]) -> None:  # noqa: F811
    shard_map = ShardMap.from_urls(shards)
    spaces = spread_workspaces(shard_map)  # ws-<n>, each shard twice
    mine = spaces[::2]  # one of each shard's two
    assert {shard_map.shard_of(ws) for ws in mine} == set(range(len(shards)))

    async def go() -> list[str]:
        aq = AsyncQueue(shard_map=shard_map)
        try:
            await aq.enqueue_many(
                [NewRequest(workspace_id=ws, job_id="j", stage="s") for ws in spaces]
            )
            claims = await aq.claim_next("default", "w", limit=len(spaces), workspaces=mine)
            assert await aq.claim_next("default", "w", workspaces=mine) == []
            assert await aq.wait_for_work("default", 0, workspaces=mine) is False
            return [c.request.workspace_id for c in claims]
        finally:
            await aq.aclose()

    assert sorted(asyncio.run(go())) == sorted(mine)
    rows = [r for url in shards for r in rows_of(url)]
    assert {r["workspace_id"] for r in rows if r["status"] == "running"} == set(mine)
    others = [r for r in rows if r["workspace_id"] not in mine]
    assert others and all(r["status"] == "queued" for r in others)
