"""Postgres split by workspace, asyncio side: :class:`~onceflow.AsyncQueue` and
:class:`~onceflow.AsyncOpLog` over N databases of this server, and the HTTP API (``onceflow
api``, which serves every request and claim route on them) over 2.

The databases come from the fixtures of ``test_shards.py`` (one migrated template, cloned
per test; 2 and 4 shards). What is checked, as for the sync router: every row lands on
its workspace's shard and nowhere else; a request is addressed by its key on its shard or
found by id alone; claims by class and batches run per shard; a transaction never spans
two shards (it rolls back, its after-commit callbacks never run); ``aclose`` closes the
pool of every shard.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import redis as redis_lib
from sqlalchemy import make_url

from onceflow import AsyncOpLog, AsyncQueue, ClaimRef, NewRequest, Queue, Status
from onceflow.connector import (
    AfterCommit,
    Execute,
    FetchAll,
    FetchOne,
    Query,
    Steps,
    Transaction,
    arun,
)
from onceflow.connector.sharded import (
    AsyncShardedConnector,
    CrossShardTransaction,
    UnroutedStatement,
)
from onceflow.db import fetch_all, get_engine, raw_connection
from onceflow.errors import InvalidRequest, LeaseLost
from onceflow.integrations.fastapi import hash_key
from onceflow.keys import queue_name
from onceflow.oplog import OpLog, new_op_id
from onceflow.queue import sql
from onceflow.settings import get_settings
from onceflow.shards import ShardMap
from tests.conftest import libpq
from tests.integration.test_shards import (  # noqa: F401 - fixtures: template, shards
    drop_shards,
    make_shards,
    rows_of,
    shards,
    spread_workspaces,
    template,
)

PRIORITY = Query(
    "test.priority",
    "UPDATE workspace_process_requests SET priority = %(priority)s"
    " WHERE workspace_id = %(workspace_id)s AND request_id = %(request_id)s",
)


def items_for(spaces: list[str], job: str = "j") -> list[NewRequest]:
    return [
        NewRequest(workspace_id=ws, job_id=f"{job}{i}", stage="s") for i, ws in enumerate(spaces)
    ]


def held_by_shard(shard_map: ShardMap, urls: list[str], spaces: list[str]) -> None:
    """Each database holds exactly its workspaces' rows."""
    for k, url in enumerate(urls):
        held = {r["workspace_id"] for r in rows_of(url)}
        assert held == {ws for ws in spaces if shard_map.shard_of(ws) == k}, f"shard {k}"


def test_enqueue_many_lands_on_each_shard_and_is_addressed_by_key_or_id(
    shards: list[str],  # noqa: F811 - the fixture
) -> None:
    shard_map = ShardMap.from_urls(shards)
    spaces = spread_workspaces(shard_map)

    async def go() -> None:
        aq = AsyncQueue(shard_map=shard_map)
        assert isinstance(aq.aconnector, AsyncShardedConnector) and aq.shard_map == shard_map
        try:
            made = await aq.enqueue_many(items_for(spaces))  # one statement per shard
            assert [r.workspace_id for r in made] == spaces and all(r.created for r in made)
            again = await aq.enqueue_many(items_for(spaces))
            assert not any(r.created for r in again)  # duplicates collapse on their shard
            assert [r.request_id for r in again] == [r.request_id for r in made]
            held_by_shard(shard_map, shards, spaces)
            assert all(len(rows_of(url)) == 2 for url in shards)
            router = aq.aconnector
            assert isinstance(router, AsyncShardedConnector)

            # By key: routed by the workspace, no look-up.
            last = made[-1]
            located = router.located
            claim = await aq.claim(last.request_id, "w1", workspace_id=last.workspace_id)
            assert claim is not None and router.located == located
            # By id alone (an old wake-up, a client without the workspace): looked up.
            first = made[0]
            by_id = await aq.claim(first.request_id, "w1")
            assert by_id is not None and by_id.request.workspace_id == spaces[0]
            assert router.located == located + 1
            assert (await aq.get(first.request_id)).status is Status.RUNNING
            assert router.located == located + 2  # the second look-up hits the cache
            assert await aq.claim(made[1].request_id, "w1", workspace_id=spaces[-1]) is None
            with pytest.raises(LeaseLost):  # the key of another shard's workspace
                await aq.complete(ClaimRef(first.request_id, by_id.token, None, spaces[-1]), {})
            done = await aq.complete(ClaimRef(first.request_id, by_id.token), {"ok": 1})
            assert done.status is Status.SUCCEEDED
            assert (await aq.complete(claim, {"ok": 2})).status is Status.SUCCEEDED
            unknown = await aq.claim("0" * 32, "w1")  # on no shard: nothing, as on one database
            assert unknown is None

            # Reads over every workspace merge the shards.
            counts = (await aq.counts())["default"]
            assert (counts["queued"], counts["succeeded"]) == (len(spaces) - 2, 2)
            listed = await aq.list(limit=1000)
            assert sorted(r.request_id for r in listed) == sorted(r.request_id for r in made)
            per_ws = await aq.counts(workspace_id=spaces[0])
            assert per_ws["default"]["succeeded"] == 1
        finally:
            await aq.aclose()

    asyncio.run(go())
    for k, url in enumerate(shards):  # the completions landed on their own shards
        statuses = {r["workspace_id"]: r["status"] for r in rows_of(url)}
        for ws in (spaces[0], spaces[-1]):
            if shard_map.shard_of(ws) == k:
                assert statuses[ws] == "succeeded"


def test_claim_next_over_every_shard_and_batches(
    shards: list[str],  # noqa: F811 - the fixture
) -> None:
    shard_map = ShardMap.from_urls(shards)
    spaces = spread_workspaces(shard_map)
    half = len(spaces) // 2

    async def go() -> None:
        aq = AsyncQueue(shard_map=shard_map)
        try:
            await aq.enqueue_many(items_for(spaces))
            claims = await aq.claim_next("default", "w1", limit=len(spaces))
            assert sorted(c.request.workspace_id for c in claims) == sorted(spaces)
            assert await aq.claim_next("default", "w2") == []
            beats = await aq.heartbeat_many(claims)
            assert all(not isinstance(b, Exception) for b in beats)
            assert len(claims) == len(spaces)
            wrong = claims[0]
            forged = type(wrong)(
                wrong.request, "not-the-token", wrong.lease_expires_at, wrong.lease_seconds
            )
            done = await aq.complete_many(
                [(c, {"n": i}) for i, c in enumerate(claims[1:half])] + [(forged, {})]
            )
            assert [getattr(d, "status", None) for d in done[:-1]] == [Status.SUCCEEDED] * (
                half - 1
            )
            assert isinstance(done[-1], LeaseLost)  # in input order, from its own shard
            released = await aq.release([*claims[half:], claims[0]])
            assert all(getattr(r, "status", None) is Status.QUEUED for r in released)
            depth = (await aq.depth())["default"]
            assert depth.queued_due == len(spaces) - half + 1
        finally:
            await aq.aclose()

    asyncio.run(go())
    total = [r for url in shards for r in rows_of(url)]
    assert sorted(r["status"] for r in total) == sorted(
        ["succeeded"] * (half - 1) + ["queued"] * (len(spaces) - half + 1)
    )
    held_by_shard(shard_map, shards, spaces)


def test_a_transaction_stays_on_one_shard(shards: list[str]) -> None:  # noqa: F811
    shard_map = ShardMap.from_urls(shards)
    a, b = spread_workspaces(shard_map, 1)[:2]
    assert shard_map.shard_of(a) != shard_map.shard_of(b)
    called: list[str] = []

    async def go() -> None:
        aq = AsyncQueue(shard_map=shard_map)
        try:
            with pytest.raises(InvalidRequest, match="strict batch"):
                await aq.enqueue_many(items_for([a, b]), strict=True)
            assert all(rows_of(url) == [] for url in shards)  # refused before any write
            ra = (await aq.enqueue("s", a, "j")).request_id
            rb = (await aq.enqueue("s", b, "j")).request_id

            def on(ws: str, rid: str, priority: int) -> dict[str, Any]:
                return {"workspace_id": ws, "request_id": rid, "priority": priority}

            def both() -> Steps[Any]:  # a write on a's shard, then a statement on b's
                yield Execute(PRIORITY, on(a, ra, 7))
                yield AfterCommit(lambda: called.append("both"))
                yield FetchOne(sql.GET, {"request_id": rb, "workspace_id": b})

            def one() -> Steps[Any]:  # two statements of a's shard, a savepoint among them
                yield Execute(PRIORITY, on(a, ra, 5))
                yield Transaction(savepoint())
                yield AfterCommit(lambda: called.append("one"))
                return (yield FetchOne(sql.GET, {"request_id": ra, "workspace_id": a}))

            def savepoint() -> Steps[Any]:
                return (yield Execute(PRIORITY, on(a, ra, 6)))

            def in_transaction(body: Steps[Any]) -> Steps[Any]:
                return (yield Transaction(body))

            with pytest.raises(CrossShardTransaction):
                await arun(aq.aconnector, in_transaction(both()))
            assert called == [] and (await aq.get(ra, workspace_id=a)).priority == 0  # rolled back
            row = await arun(aq.aconnector, in_transaction(one()))
            assert row["priority"] == 6 and called == ["one"]  # committed, then called back

            def nested_first() -> Steps[Any]:  # a savepoint before its shard is known
                return (yield Transaction(savepoint()))

            with pytest.raises(CrossShardTransaction, match="not known"):
                await arun(aq.aconnector, in_transaction(nested_first()))

            def unrouted() -> Steps[Any]:  # a read over every workspace, not told which shard
                return (yield FetchAll(sql.COUNTS, {}))

            with pytest.raises(UnroutedStatement):
                await arun(aq.aconnector, unrouted())
            claim = await aq.claim(ra, "w", workspace_id=a)
            assert claim is not None
            with pytest.raises(InvalidRequest, match="workspace"):  # a hand-off into b: refused
                await aq.hand_off(
                    claim, {}, then=[NewRequest(workspace_id=b, job_id="j", stage="t")]
                )
            assert (await aq.get(ra, workspace_id=a)).status is Status.RUNNING
        finally:
            await aq.aclose()

    asyncio.run(go())


def backends(url: str) -> set[int]:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        ).fetchall()
    return {r[0] for r in rows}


def test_from_queue_env_op_log_and_aclose_of_every_shard(
    shards: list[str],  # noqa: F811 - the fixture
    redis_url: str,
) -> None:
    shard_map = ShardMap.from_urls(shards)
    spaces = spread_workspaces(shard_map, 1)
    os.environ["ONCEFLOW_DATABASE_URLS"] = ",".join(shards)
    get_settings.cache_clear()
    pids: list[int] = []
    try:
        queue = Queue()
        assert queue.shard_map == shard_map

        async def go() -> None:
            # The configured map: an AsyncQueue routes over it.
            for aq in (AsyncQueue(), AsyncQueue.from_queue(queue)):
                assert isinstance(aq.aconnector, AsyncShardedConnector)
                assert aq.shard_map == shard_map
                await aq.aclose()
            aq = AsyncQueue.from_queue(queue)
            for oplog in (AsyncOpLog(), AsyncOpLog.from_oplog(OpLog())):
                assert oplog.shard_map == shard_map
                await oplog.aclose()
            oplog = AsyncOpLog(settings=queue.settings, connector=aq.aconnector)
            assert oplog.shard_map == shard_map
            try:
                for ws in spaces:
                    made = await aq.enqueue("s", ws, "j")
                    op = {"type": "cell.set", "column": "a", "value": ws}
                    assert (await oplog.apply_op(ws, "cells", op, new_op_id())).clock == 1
                    # Fenced by a claim named by id alone: the fence's shard is looked up.
                    claim = await aq.claim(made.request_id, "w", workspace_id=ws)
                    assert claim is not None
                    fenced = await oplog.apply_op(
                        None, "cells", op, new_op_id(), fence=ClaimRef(made.request_id, claim.token)
                    )
                    assert fenced.workspace_id == ws and fenced.clock == 2
                    assert [r.clock for r in await oplog.ops_since(ws, "cells", 0)] == [1, 2]
                router = aq.aconnector
                assert isinstance(router, AsyncShardedConnector)
                probe = Query("test.pid", "SELECT pg_backend_pid() AS pid")
                for shard in router.shard_connectors:
                    pids.append((await shard.fetch_one(probe, {}))["pid"])
            finally:
                await oplog.aclose()  # the shared pools: closed once, the second is a no-op
                await aq.aclose()

        asyncio.run(go())
    finally:
        os.environ.pop("ONCEFLOW_DATABASE_URLS", None)
        get_settings.cache_clear()
    for k, url in enumerate(shards):
        with raw_connection(get_engine(url)) as raw:
            held = fetch_all(raw, "SELECT workspace_id FROM workspace_sub_doc_ops", {})
        assert {r["workspace_id"] for r in held} == {
            ws for ws in spaces if shard_map.shard_of(ws) == k
        }
        # aclose closed this shard's pool: its connection leaves the server.
        deadline = time.monotonic() + 10
        while pids[k] in backends(url):
            assert time.monotonic() < deadline, f"shard {k}'s pool connection stayed open"
            time.sleep(0.05)


# ------------------------------------------------------------------ the HTTP API

API_KEY = "of_test_api_key_shards_0123456789ab"
WORKER_KEY = "of_test_worker_key_shards_01234567"
OPERATOR_KEY = "of_test_operator_key_shards_012345"
PULL = "t-pull"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def two_shards(services: tuple[str, str], template: str) -> Iterator[list[str]]:  # noqa: F811
    urls = make_shards(services[0], template, 2)
    try:
        yield urls
    finally:
        drop_shards(services[0], urls)


@pytest.fixture(scope="module")
def sharded_api(
    tmp_path_factory: pytest.TempPathFactory, two_shards: list[str], redis_url: str
) -> Iterator[str]:
    """A real ``onceflow api`` over two databases (ONCEFLOW_DATABASE_URLS): its base URL."""
    from tests.acceptance.conftest import TEST_ENV
    from tests.acceptance.procs import api_server

    spaces = spread_workspaces(ShardMap.from_urls(two_shards), 2)
    env = {
        **TEST_ENV,
        "ONCEFLOW_DATABASE_URLS": ",".join(two_shards),
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): spaces}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
        "ONCEFLOW_OPERATOR_KEYS": json.dumps({hash_key(OPERATOR_KEY): ["viewer"]}),
    }
    try:
        with api_server(tmp_path_factory.mktemp("sharded-api"), env) as (url, _proc):
            yield url
    finally:
        redis_lib.Redis.from_url(redis_url).delete(queue_name(PULL))


@pytest.mark.slow
def test_http_api_enqueues_claims_and_completes_on_each_shard(
    sharded_api: str, two_shards: list[str]
) -> None:
    shard_map = ShardMap.from_urls(two_shards)
    spaces = spread_workspaces(shard_map, 2)
    assert {shard_map.shard_of(ws) for ws in spaces} == {0, 1}
    with httpx.Client(base_url=sharded_api, timeout=30) as http:
        made: dict[str, str] = {}
        for ws in spaces:
            body = {"stage": "noop", "job_id": "j", "input": {"value": 1}, "worker_class": PULL}
            answer = http.post(f"/v1/workspaces/{ws}/requests", json=body, headers=auth(API_KEY))
            assert answer.status_code == 201, answer.text
            made[answer.json()["request_id"]] = ws
            again = http.post(f"/v1/workspaces/{ws}/requests", json=body, headers=auth(API_KEY))
            assert again.status_code == 200 and again.json()["created"] is False
        for rid, ws in made.items():
            got = http.get(f"/v1/workspaces/{ws}/requests/{rid}", headers=auth(API_KEY))
            assert got.status_code == 200 and got.json()["workspace_id"] == ws
        other = spaces[-1]  # a request of another workspace, asked for under this one: 404
        rid0 = next(iter(made))
        assert (
            http.get(f"/v1/workspaces/{other}/requests/{rid0}", headers=auth(API_KEY)).status_code
            == 404
        )

        # Claims by class: every shard is visited; completed by key or by id alone.
        claimed: dict[str, dict[str, Any]] = {}
        for _ in spaces:
            answer = http.post(
                f"/v1/worker-classes/{PULL}/claims",
                json={"worker_id": "pw"},
                headers=auth(WORKER_KEY),
            )
            assert answer.status_code == 201, answer.text
            claimed[answer.json()["request_id"]] = answer.json()
        assert set(claimed) == set(made)
        none_left = http.post(
            f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "pw"}, headers=auth(WORKER_KEY)
        )
        assert none_left.status_code == 204
        # A long poll over the shards ends with 204 once its wait is used up.
        polled = http.post(
            f"/v1/worker-classes/{PULL}/claims",
            json={"worker_id": "pw", "wait": 0.5},
            headers=auth(WORKER_KEY),
        )
        assert polled.status_code == 204, polled.text
        for i, (rid, claim) in enumerate(claimed.items()):
            ws = made[rid]
            keyed = {"claim_token": claim["claim_token"]}
            if i % 2 == 0:
                keyed["workspace_id"] = ws  # by key; the others by id alone (looked up)
            beat = http.post(f"/v1/claims/{rid}/heartbeat", json=keyed, headers=auth(WORKER_KEY))
            assert beat.status_code == 200, beat.text
            op = {"op_id": new_op_id(), "op": {"type": "cell.set", "column": "a", "value": i}}
            applied = http.post(
                f"/v1/claims/{rid}/ops", json={**keyed, "sub_doc": "doc-cells", **op},
                headers=auth(WORKER_KEY),
            )  # fmt: skip
            assert applied.status_code == 201, applied.text
            assert applied.json()["workspace_id"] == ws
            if i == 1:
                failed = http.post(
                    f"/v1/claims/{rid}/fail", json={**keyed, "error": {"e": 1}, "retryable": False},
                    headers=auth(WORKER_KEY),
                )  # fmt: skip
                assert failed.status_code == 200 and failed.json()["status"] == "dead", failed.text
                continue
            done = http.post(
                f"/v1/claims/{rid}/complete", json={**keyed, "result": {"i": i}},
                headers=auth(WORKER_KEY),
            )  # fmt: skip
            assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
            late = http.post(f"/v1/claims/{rid}/heartbeat", json=keyed, headers=auth(WORKER_KEY))
            assert late.status_code == 409  # fenced on its own shard

        # The op routes and per-workspace reads, routed by the workspace in the path.
        for ws in spaces:
            op = {"op_id": new_op_id(), "op": {"type": "cell.set", "column": "b", "value": ws}}
            put = http.post(
                f"/v1/workspaces/{ws}/sub-docs/doc-cells/ops", json=op, headers=auth(API_KEY)
            )
            assert put.status_code == 201, put.text
            doc = http.get(f"/v1/workspaces/{ws}/sub-docs/doc-cells", headers=auth(API_KEY)).json()
            assert doc["workspace_id"] == ws and doc["clock"] == put.json()["clock"] == 2
            counts = http.get(f"/v1/workspaces/{ws}/counts", headers=auth(API_KEY)).json()
            assert counts["total"] == 1
            listed = http.get(f"/v1/workspaces/{ws}/requests", headers=auth(API_KEY)).json()
            assert [r["workspace_id"] for r in listed["requests"]] == [ws]

        # Reads over every workspace read every shard: the dashboard's snapshot and the
        # database metrics (one up/down sample per shard).
        snapshot = http.get("/dashboard/api/snapshot", headers=auth(OPERATOR_KEY))
        assert snapshot.status_code == 200, snapshot.text
        assert snapshot.json()["shards_unavailable"] == []
        metrics = http.get("/metrics", headers=auth(OPERATOR_KEY))
        assert metrics.status_code == 200, metrics.text
        for k in range(len(two_shards)):
            assert f'onceflow_database_up{{shard="{k}"}} 1.0' in metrics.text

    # Each database holds its own workspaces' rows (requests, sub-docs, ops) and no other.
    for k, url in enumerate(two_shards):
        mine = {ws for ws in spaces if shard_map.shard_of(ws) == k}
        with psycopg.connect(libpq(url)) as conn:
            for table in (
                "workspace_process_requests",
                "workspace_sub_docs",
                "workspace_sub_doc_ops",
            ):
                found = {r[0] for r in conn.execute(f"SELECT DISTINCT workspace_id FROM {table}")}  # noqa: S608
                assert found == mine, (k, table)
            statuses = sorted(
                r[0] for r in conn.execute("SELECT status FROM workspace_process_requests")
            )
        assert len(statuses) == len(mine)
    assert make_url(two_shards[0]).database != make_url(two_shards[1]).database
