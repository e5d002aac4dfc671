"""Postgres split by workspace: the router over N databases of this server.

Each test gets N fresh databases (one migrated, the others cloned from it), a shard map over
them, and a :class:`~onceflow.Queue` routing by workspace. What is checked: every row lives
on its workspace's shard and nowhere else; a request is addressed by its key on its shard
(or found by id alone); batches, claims by class, reads over every workspace, the sweeper
and the op log work per shard; nothing ever spans two shards in one transaction; a shard
that cannot be reached stalls only its own workspaces.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import make_url

from onceflow import ClaimRef, NewRequest, Queue, Status
from onceflow.connector import FetchAll, FetchOne, Steps, Transaction, run
from onceflow.connector.sharded import CrossShardTransaction, ShardedConnector, UnroutedStatement
from onceflow.db import dispose_engines, fetch_all, fetch_one, get_engine, raw_connection
from onceflow.errors import DatabaseUnavailable, InvalidRequest
from onceflow.health import head_revisions
from onceflow.migrate import migrate, register_shard
from onceflow.oplog import OpLog, new_op_id
from onceflow.queue import sql
from onceflow.shards import ShardMap
from tests.conftest import libpq


def _admin(conninfo: str, sql: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="module")
def template(services: tuple[str, str]) -> Iterator[str]:
    """A database migrated to head, cloned for each test's shards."""
    admin = services[0]
    name = f"onceflow_shtpl_{os.getpid()}_{secrets.token_hex(3)}"
    _admin(libpq(admin), f'CREATE DATABASE "{name}"')
    url = make_url(admin).set(database=name).render_as_string(hide_password=False)
    try:
        migrate(url)
        dispose_engines()  # no connection may stay open on a template
        yield name
    finally:
        _admin(libpq(admin), f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def make_shards(admin: str, template: str, n: int) -> list[str]:
    urls = []
    for k in range(n):
        name = f"onceflow_shard_{os.getpid()}_{secrets.token_hex(3)}_s{k}"
        _admin(libpq(admin), f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        urls.append(make_url(admin).set(database=name).render_as_string(hide_password=False))
    register(urls)
    return urls


def register(urls: list[str]) -> None:
    """What `onceflow migrate` does under this map: each database learns its shard index."""
    shard_map = ShardMap.from_urls(urls)
    for index, url in enumerate(urls):
        register_shard(url, index, shard_map)


def drop_shards(admin: str, urls: list[str]) -> None:
    dispose_engines()
    for url in urls:
        name = make_url(url).database
        _admin(libpq(admin), f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        _admin(libpq(admin), f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}shards")
def shards(request: Any, services: tuple[str, str], template: str) -> Iterator[list[str]]:
    urls = make_shards(services[0], template, request.param)
    try:
        yield urls
    finally:
        drop_shards(services[0], urls)


def spread_workspaces(shard_map: ShardMap, per_shard: int = 2) -> list[str]:
    """Workspace ids covering every shard ``per_shard`` times (asserted, like the Redis
    Cluster tests assert slots per node)."""
    found: dict[int, list[str]] = {k: [] for k in range(len(shard_map))}
    i = 0
    while any(len(v) < per_shard for v in found.values()):
        ws = f"ws-{i}"
        k = shard_map.shard_of(ws)
        if len(found[k]) < per_shard:
            found[k].append(ws)
        i += 1
    return [ws for k in sorted(found) for ws in found[k]]


def rows_of(url: str) -> list[dict[str, Any]]:
    with raw_connection(get_engine(url)) as raw:
        return fetch_all(
            raw,
            "SELECT workspace_id, request_id, status FROM workspace_process_requests"
            " ORDER BY workspace_id, request_id",
            {},
        )


def test_each_row_lives_on_its_workspaces_shard_and_is_addressed_there(
    shards: list[str],
) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    assert isinstance(queue.connector, ShardedConnector)
    spaces = spread_workspaces(shard_map)
    items = [NewRequest(workspace_id=ws, job_id=f"j{i}", stage="s") for i, ws in enumerate(spaces)]
    made = queue.enqueue_many(items)  # one statement per shard, answers in input order
    assert [r.workspace_id for r in made] == spaces and all(r.created for r in made)
    assert not any(r.created for r in queue.enqueue_many(items))  # duplicates collapse
    for k, url in enumerate(shards):
        held = rows_of(url)
        assert {r["workspace_id"] for r in held} == {
            ws for ws in spaces if shard_map.shard_of(ws) == k
        }
        assert len(held) == 2
    # By key on its shard; by id alone (an old wake-up): found by looking on the shards.
    first = made[-1]
    claim = queue.claim(first.request_id, "w1", workspace_id=first.workspace_id)
    assert claim is not None
    located = queue.connector.located
    assert queue.get(made[0].request_id).workspace_id == spaces[0]
    assert queue.connector.located == located + 1
    assert queue.claim(made[0].request_id, "w1", workspace_id=spaces[1]) is None  # wrong key
    assert (
        queue.complete(ClaimRef(first.request_id, claim.token), {"ok": 1}).status
        is Status.SUCCEEDED
    )
    # Reads over every workspace merge the shards.
    counts = queue.counts()["default"]
    assert (counts["queued"], counts["succeeded"]) == (len(spaces) - 1, 1)
    listed = queue.list(limit=1000)
    assert sorted(r.request_id for r in listed) == sorted(r.request_id for r in made)
    assert queue.depth()["default"].queued_due == len(spaces) - 1


def test_claims_by_class_and_batches_work_per_shard(shards: list[str]) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    spaces = spread_workspaces(shard_map)
    queue.enqueue_many([NewRequest(workspace_id=ws, job_id="j", stage="s") for ws in spaces])
    claims = queue.claim_next("default", "w1", limit=len(spaces))
    assert sorted(c.request.workspace_id for c in claims) == sorted(spaces)  # every shard
    assert queue.claim_next("default", "w2") == []
    beats = queue.heartbeat_many(claims)
    assert all(not isinstance(b, Exception) for b in beats)
    half = len(claims) // 2
    wrong = claims[0]
    forged = type(wrong)(
        wrong.request, "not-the-token", wrong.lease_expires_at, wrong.lease_seconds
    )
    done = queue.complete_many(
        [(c, {"n": i}) for i, c in enumerate(claims[1:half])] + [(forged, {})]
    )
    assert [getattr(d, "status", None) for d in done[:-1]] == [Status.SUCCEEDED] * (half - 1)
    assert type(done[-1]).__name__ == "LeaseLost"  # in input order, on its own shard
    released = queue.release([*claims[half:], claims[0]])
    assert all(getattr(r, "status", None) is Status.QUEUED for r in released)
    total = [r for url in shards for r in rows_of(url)]
    assert sorted(r["status"] for r in total) == sorted(
        ["succeeded"] * (half - 1) + ["queued"] * (len(spaces) - half + 1)
    )


def test_nothing_spans_two_shards_in_one_transaction(shards: list[str]) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    a, b = spread_workspaces(shard_map, 1)[:2]
    assert shard_map.shard_of(a) != shard_map.shard_of(b)
    items = [NewRequest(workspace_id=ws, job_id="j", stage="s") for ws in (a, b)]
    with pytest.raises(InvalidRequest, match="strict batch"):
        queue.enqueue_many(items, strict=True)
    assert all(rows_of(url) == [] for url in shards)  # refused before anything was written
    # A hand-off into another workspace is refused (one workspace per transaction); the
    # pinned transaction is the router's own guard against the rest.
    rid = queue.enqueue("s", a, "j").request_id
    claim = queue.claim(rid, "w", workspace_id=a)
    assert claim is not None
    with pytest.raises(InvalidRequest, match="workspace"):
        queue.hand_off(claim, {}, then=[NewRequest(workspace_id=b, job_id="j", stage="t")])
    assert queue.get(rid, workspace_id=a).status is Status.RUNNING

    def both() -> Steps[Any]:  # one transaction reading a row of each shard
        yield FetchOne(sql.GET, {"request_id": rid, "workspace_id": a})
        yield FetchOne(sql.GET, {"request_id": rid, "workspace_id": b})

    def in_transaction() -> Steps[Any]:
        return (yield Transaction(both()))

    with pytest.raises(CrossShardTransaction):
        run(queue.connector, in_transaction())

    def unrouted() -> Steps[Any]:  # a read over every workspace, not told which shard
        return (yield FetchAll(sql.COUNTS, {}))

    with pytest.raises(UnroutedStatement):
        run(queue.connector, unrouted())


class Empty(BaseModel):
    pass


def test_the_sweeper_and_the_op_log_work_per_shard(shards: list[str], redis_url: str) -> None:
    from onceflow.tasks import Flow

    shard_map = ShardMap.from_urls(shards)
    os.environ["ONCEFLOW_DATABASE_URLS"] = ",".join(shards)
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    try:
        flow = Flow(name=f"shard-sweep-{secrets.token_hex(2)}")
        flow.stage("s", input=Empty, worker_class="sh-default")(lambda ctx, data: {})
        queue = flow.queue
        assert queue.shard_map is not None and len(queue.shards()) == len(shards)
        spaces = spread_workspaces(shard_map, 1)
        rids = [flow.enqueue("s", ws, "j", "main", {}).request_id for ws in spaces]
        claims = [
            queue.claim(r, "w", workspace_id=ws, lease_seconds=1)
            for r, ws in zip(rids, spaces, strict=True)
        ]
        assert all(claims)
        with raw_connection(get_engine(shards[0])) as raw:
            later = fetch_one(raw, "SELECT now() + interval '5 seconds' AS t", {})["t"]
        swept = flow.sweep_once(now=later)
        assert sorted(swept.rescued) == sorted(rids)  # each shard rescued its own
        assert sorted(d.workspace_id for d in swept.to_dispatch) == sorted(spaces)
        for url in shards:  # one election per shard
            with raw_connection(get_engine(url)) as raw:
                assert fetch_one(raw, "SELECT count(*) AS n FROM onceflow_sweeps", {})["n"] == 1
        # The op log routes by workspace too: each sub-doc's ops on its workspace's shard.
        oplog = OpLog(shard_map=shard_map)
        for ws in spaces:
            op = {"type": "cell.set", "column": "a", "value": ws}
            assert oplog.apply_op(ws, "cells", op, new_op_id()).clock == 1
        for k, url in enumerate(shards):
            with raw_connection(get_engine(url)) as raw:
                held = fetch_all(raw, "SELECT workspace_id FROM workspace_sub_doc_ops", {})
            assert {r["workspace_id"] for r in held} == {
                ws for ws in spaces if shard_map.shard_of(ws) == k
            }
        assert oplog.prune(older_than_seconds=3600) == 0  # every shard pruned (none old)
    finally:
        os.environ.pop("ONCEFLOW_DATABASE_URLS", None)
        get_settings.cache_clear()


def test_a_shard_that_cannot_be_reached_stalls_only_its_workspaces(
    shards: list[str], services: tuple[str, str]
) -> None:
    """The shard's database is closed to connections (its server, shared, is untouched):
    work of the other shards' workspaces goes on; the closed one's fails clearly and
    resumes, nothing lost, once it is open again."""
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    spaces = spread_workspaces(shard_map, 1)
    down = make_url(shards[0]).database
    _admin(libpq(services[0]), f'ALTER DATABASE "{down}" ALLOW_CONNECTIONS false')
    _admin(
        libpq(services[0]),
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{down}'",  # noqa: S608
    )
    try:
        for ws in spaces:
            if shard_map.shard_of(ws) == 0:
                with pytest.raises(DatabaseUnavailable):
                    queue.enqueue("s", ws, "j")
            else:
                made = queue.enqueue("s", ws, "j")
                claim = queue.claim(made.request_id, "w", workspace_id=ws)
                assert claim is not None
                assert queue.complete(claim, {}).status is Status.SUCCEEDED
        # claims by class skip nothing that is reachable: the closed shard is retried later
        with pytest.raises(DatabaseUnavailable):
            queue.counts()
    finally:
        _admin(libpq(services[0]), f'ALTER DATABASE "{down}" ALLOW_CONNECTIONS true')
    for ws in spaces:
        if shard_map.shard_of(ws) == 0:
            assert queue.enqueue("s", ws, "j").created
    counts = queue.counts()["default"]
    assert (counts["succeeded"], counts["queued"]) == (len(spaces) - 1, 1)


def test_onceflow_migrate_migrates_every_shard(services: tuple[str, str]) -> None:
    import subprocess
    import sys

    admin = services[0]
    urls = []
    for k in range(2):
        name = f"onceflow_shmig_{os.getpid()}_{secrets.token_hex(3)}_s{k}"
        _admin(libpq(admin), f'CREATE DATABASE "{name}"')
        urls.append(make_url(admin).set(database=name).render_as_string(hide_password=False))
    try:
        env = {**os.environ, "ONCEFLOW_DATABASE_URLS": ",".join(urls)}
        env.pop("ONCEFLOW_DATABASE_URL", None)
        cli = [sys.executable, "-m", "onceflow.cli", "migrate"]
        done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "shard 0" in done.stderr and "shard 1" in done.stderr
        assert "every shard is at the latest migration" in done.stderr
        for url in urls:
            with psycopg.connect(libpq(url)) as conn:
                row = conn.execute("SELECT version_num FROM onceflow_alembic_version").fetchone()
                assert row is not None and frozenset(row) == head_revisions()
                # ... and registered each database as its shard of the map
                who = conn.execute("SELECT shard_index, shard_count FROM onceflow_shard").fetchone()
                assert who == (urls.index(url), 2)
    finally:
        drop_shards(admin, urls)


def test_a_database_that_is_not_the_shard_the_map_names_is_refused(
    services: tuple[str, str], template: str
) -> None:
    """Each shard's database knows which shard it is (`onceflow migrate` writes it); a
    process whose map names the databases in another order, or under another map, or one
    never registered, is refused at its first statement there — nothing is written to the
    wrong database (the rows of a workspace would land where no other process looks)."""
    from onceflow.errors import ShardMismatch

    urls = make_shards(services[0], template, 2)  # registered as shards 0 and 1
    try:
        swapped = Queue(shard_map=ShardMap.from_urls(list(reversed(urls))))
        ws = spread_workspaces(ShardMap.from_urls(urls), 1)[0]
        swapped_shard = r"is shard (0|1) of 2, but this map names it shard (1|0) of 2"
        with pytest.raises(ShardMismatch, match=swapped_shard):
            swapped.enqueue("s", ws, "j")
        with pytest.raises(ShardMismatch):
            swapped.counts()
        assert all(rows_of(url) == [] for url in urls)  # nothing written anywhere
        moved = ShardMap.from_json(
            {"shards": urls, "overrides": {ws: 1 - ShardMap.from_urls(urls).shard_of(ws)}}
        )
        with pytest.raises(ShardMismatch, match="registered under another map"):
            Queue(shard_map=moved).enqueue("s", ws, "j")
        # migrate never moves a database to another index; a changed map of the same order
        # (the override) is recorded, and then routes.
        with pytest.raises(ShardMismatch, match="is shard 0"):
            register_shard(urls[0], 1, ShardMap.from_urls(list(reversed(urls))))
        for index, url in enumerate(urls):
            register_shard(url, index, moved)
        made = Queue(shard_map=moved).enqueue("s", ws, "j")
        assert made.created and [r["workspace_id"] for r in rows_of(urls[moved.shard_of(ws)])] == [
            ws
        ]
    finally:
        drop_shards(services[0], urls)
    # A database migrated alone, never registered: refused with the fix in the message.
    lone = make_shards(services[0], template, 1)
    extra = make_shards(services[0], template, 1)
    try:
        with psycopg.connect(libpq(lone[0]), autocommit=True) as conn:
            conn.execute("DELETE FROM onceflow_shard")
        pair = Queue(shard_map=ShardMap.from_urls([lone[0], extra[0]]))
        with pytest.raises(
            ShardMismatch, match="not registered as shard 0: run `onceflow migrate`"
        ):
            pair.counts()
    finally:
        drop_shards(services[0], lone + extra)


def test_an_id_on_two_shards_is_ambiguous_and_claims_are_handed_back_on_a_bad_shard(
    shards: list[str], services: tuple[str, str]
) -> None:
    """An id callers chose may name requests of two workspaces on two shards: by the id
    alone it names neither (`AmbiguousRequestId`), by its key each. And a claim by class
    that meets a database which is not the shard the map names hands back the claims it
    already took on the other shards, instead of leaving them to lapse (each lapse would
    count against the crash budget)."""
    from onceflow.connector.sharded import AmbiguousRequestId
    from onceflow.errors import ShardMismatch

    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    a, b = spread_workspaces(shard_map, 1)[:2]
    queue.enqueue_many(
        [NewRequest(workspace_id=ws, job_id="j", stage="s", request_id="chosen-1") for ws in (a, b)]
    )
    with pytest.raises(AmbiguousRequestId):
        queue.get("chosen-1")
    assert queue.get("chosen-1", workspace_id=b).workspace_id == b
    # The last shard forgets who it is: claims by class must not strand the others' rows.
    last = shards[-1]
    with psycopg.connect(libpq(last), autocommit=True) as conn:
        conn.execute("DELETE FROM onceflow_shard")
    fresh = Queue(shard_map=shard_map)
    for _ in range(len(shards)):  # every starting shard of the rotation
        with pytest.raises(ShardMismatch):
            fresh.claim_next("default", "w", limit=10)
    for url in shards[:-1]:
        for row in rows_of(url):
            assert row["status"] == "queued", row
        with raw_connection(get_engine(url)) as raw:
            counts = fetch_one(
                raw, "SELECT max(attempts) AS a, max(crash_attempts) AS c"
                " FROM workspace_process_requests", {},
            )  # fmt: skip
        assert (counts["a"] or 0, counts["c"] or 0) == (0, 0)


def _listening_on(url: str) -> int:
    """How many backends of ``url``'s database last ran LISTEN onceflow_done (waiters)."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = 'LISTEN onceflow_done' AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_wait_listens_on_its_workspaces_shard(shards: list[str], api: str) -> None:
    import asyncio
    import threading
    import time

    from onceflow import AsyncQueue, Request

    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    last = spread_workspaces(shard_map, per_shard=1)[-1]  # on the last shard
    rid = queue.enqueue("s", last, "j").request_id
    claim = queue.claim(rid, "w1", workspace_id=last)
    assert claim is not None
    answer: list[Request] = []

    def wait(workspace_id: str | None) -> None:
        if api == "sync":
            answer.append(queue.wait(rid, timeout=60, workspace_id=workspace_id))
            return

        async def go() -> Request:
            aq = AsyncQueue(shard_map=shard_map)
            try:
                return await aq.wait(rid, timeout=60, workspace_id=workspace_id)
            finally:
                await aq.aclose()

        answer.append(asyncio.run(go()))

    # Found by its id alone (looked up on the shards), then waited for on its own shard.
    waiter = threading.Thread(target=wait, args=(None,), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while _listening_on(shards[-1]) == 0:
        assert waiter.is_alive() and time.monotonic() < deadline, "the waiter never listened"
        time.sleep(0.02)
    assert all(_listening_on(url) == 0 for url in shards[:-1])
    queue.complete(claim, {"ok": 1})
    waiter.join(70)
    assert not waiter.is_alive()
    assert [(r.request_id, r.status, r.result) for r in answer] == [
        (rid, Status.SUCCEEDED, {"ok": 1})
    ]
    # By its key: it has ended, so the answer is at once.
    assert queue.wait(rid, timeout=60, workspace_id=last).status is Status.SUCCEEDED
