"""Locks, broadcasts and counters on a real local Redis Cluster (``redis+cluster://``).

A fixture starts three cluster primaries of this run's own on free ports
(:mod:`tests.integration.redis_cluster`) and stops them at the end; ``ONCEFLOW_REDIS_URL``
style ``redis+cluster://…`` URLs reach them through onceflow's client factory
(:mod:`onceflow.redis_clients`). The workspaces of a test are chosen so that their slots
sit on different nodes, and each test asserts that they do. The stand-in provider counts
every paid call (:mod:`tests.integration.standin`). The module is skipped, saying why,
only when no ``redis-server``/``valkey-server`` binary exists.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from functools import partial
from multiprocessing.context import BaseContext
from typing import Any

import pytest
from redis.crc import key_slot
from sqlalchemy import Engine

from onceflow.errors import LockUnavailable
from onceflow.integrations.fastapi.event_hub import EventHub
from onceflow.keys import counters_key, counters_workspaces_key, lock_key, workspace_channel
from onceflow.locks import AsyncRedisLockBackend, Path, RedisLockBackend, calls_saved
from onceflow.locks.base import SUBSCRIPTION_ENDED
from onceflow.oplog import AsyncOpLog, OpLog
from onceflow.redis_clients import sync_client
from onceflow.settings import Settings
from tests.integration import lock_callers
from tests.integration.lock_callers import Fleet, call, cell_name, outcomes, run_compute_once
from tests.integration.redis_cluster import LocalCluster, server_binary
from tests.integration.standin import StandIn

BINARY = server_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no redis-server or valkey-server binary (nor the embedded extra's) to run a "
    "local Redis Cluster",
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    assert BINARY is not None
    local = LocalCluster(BINARY).start()
    yield local
    local.stop()


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ctx() -> BaseContext:
    return lock_callers.context()


def workspaces_on(cluster: LocalCluster, per_node: int) -> dict[int, list[str]]:
    """``per_node`` fresh workspaces whose slot is on each node: {port: [workspace, …]}."""
    found: dict[int, list[str]] = {port: [] for port in cluster.ports}
    while any(len(v) < per_node for v in found.values()):
        ws = f"ws-{secrets.token_hex(4)}"
        port = cluster.port_of(lock_key(ws, "j", "t"))
        if len(found[port]) < per_node:
            found[port].append(ws)
    return found


def test_a_workspace_keys_and_channel_share_one_slot(cluster: LocalCluster) -> None:
    ws = "ws-slot"
    ports = {
        cluster.port_of(k)
        for k in (lock_key(ws, "job-1", "eval:a"), workspace_channel(ws), counters_key(ws))
    }
    assert len(ports) == 1


@pytest.mark.slow
def test_processes_over_workspaces_on_three_nodes_pay_once_per_cell(
    cluster: LocalCluster, standin: StandIn, ctx: BaseContext
) -> None:
    spread = workspaces_on(cluster, per_node=2)
    cells = [("job-1", "eval:score"), ("job-2", "commute")]
    plans = []
    for names in spread.values():
        for ws in names:
            for p in range(3):  # 3 processes per workspace, each racing both cells
                plans.append(
                    {"kind": "redis", "url": cluster.url, "standin": standin.url,
                     "workspace_id": ws, "cells": cells, "hold": 0.2,
                     "api": ("sync", "async")[p % 2]}
                )  # fmt: skip
    fleet = Fleet(ctx, plans)
    try:
        reports = fleet.collect()
    finally:
        fleet.stop()
    results = outcomes(reports)
    every_ws = [ws for names in spread.values() for ws in names]
    # The workspaces' locks live on every node of the cluster, not on one.
    assert {cluster.port_of(lock_key(ws, *cells[0])) for ws in every_ws} == set(cluster.ports)
    assert len(results) == len(every_ws) * 3 * len(cells)
    assert {r["api"] for r in results} == {"sync", "async"}
    backend = RedisLockBackend(sync_client(cluster.url, timeout=5))
    for ws in every_ws:
        for cell in cells:
            name = cell_name(ws, *cell)
            assert standin.calls[name] == 1, name  # the provider's own count
            mine = [r for r in results if r["cell"] == name]
            assert {r["value"] for r in mine} == {f"answer-{name}-1"}
            assert Counter(r["path"] for r in mine)["computed"] == 1
        counts = backend.workspace_counters(ws)  # HINCRBY of 3 processes, on the ws's node
        assert counts["computes"] == len(cells)
        assert calls_saved(counts) == 3 * len(cells) - len(cells), counts
    listed = sync_client(cluster.url, timeout=5).smembers(counters_workspaces_key())
    assert {m.decode() for m in listed} >= set(every_ws)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_waiters_are_woken_by_the_sharded_broadcast_of_their_shard(
    api: str, cluster: LocalCluster, standin: StandIn, ctx: BaseContext
) -> None:
    ws = workspaces_on(cluster, per_node=1)[cluster.ports[1]][0]
    cell = ("job-b", "eval:fit")
    name = cell_name(ws, *cell)
    channel = workspace_channel(ws)
    standin.block_next(name)
    one = {"kind": "redis", "url": cluster.url, "standin": standin.url, "workspace_id": ws,
           "cells": [cell], "ttl": 60}  # fmt: skip
    leader = Fleet(ctx, [one], barrier=False)
    waiters: Fleet | None = None
    try:
        lock_callers_wait(lambda: standin.calls[name] == 1, "the leader's provider call")
        waiters = Fleet(ctx, [{**one, "api": api}] * 3, barrier=False)
        lock_callers_wait(lambda: standin.marks[name] >= 3, "3 callers waiting")
        # They listen on the shard of the workspace's slot, with sharded pub/sub only.
        owner = cluster.node(cluster.port_of(channel))
        lock_callers_wait(
            lambda: _shard_subscribers(owner, channel) >= 3, "3 SSUBSCRIBEs on the owner"
        )
        for port in cluster.ports:
            node = cluster.node(port)
            assert node.pubsub_numsub(channel) == [(channel.encode(), 0)]  # no cluster-bus channel
            if port != cluster.port_of(channel):
                assert _shard_subscribers(node, channel) == 0
        standin.unblock(name)
        reports = waiters.collect(timeout=60) + leader.collect(timeout=60)
    finally:
        standin.unblock(name)
        leader.stop()
        if waiters is not None:
            waiters.stop()
    served = [r for r in outcomes(reports) if r["path"] == "waited"]
    assert len(served) == 3
    assert all(r["served_by"] == "broadcast" for r in served), served
    assert standin.calls[name] == 1


def _shard_subscribers(node: Any, channel: str) -> int:
    reply = node.execute_command("PUBSUB", "SHARDNUMSUB", channel)
    return int(reply[1])


def lock_callers_wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    from tests.integration.redis_cluster import _wait

    _wait(condition, what, timeout)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_the_op_logs_commit_broadcast_reaches_its_subscriber(
    api: str, cluster: LocalCluster, clean_db: Engine, database_url: str
) -> None:
    settings = Settings(redis_url=cluster.url, database_url=database_url)
    spread = workspaces_on(cluster, per_node=1)
    wss = [spread[port][0] for port in cluster.ports]
    subscriber = RedisLockBackend(cluster.url, settings=settings)  # its client made lazily
    subs = {ws: subscriber.subscribe(ws) for ws in wss}
    op = {"type": "cell.set", "column": "x", "value": 1}
    try:
        if api == "sync":
            oplog = OpLog(clean_db, settings)
            for ws in wss:
                oplog.apply_op(ws, "cells", op, f"op-{ws}-0123456789abcdef")
        else:

            async def main() -> None:
                aoplog = AsyncOpLog(database_url, settings)
                try:
                    for ws in wss:
                        await aoplog.apply_op(ws, "cells", op, f"op-{ws}-0123456789abcdef")
                finally:
                    await aoplog.aclose()

            asyncio.run(main())
        for ws in wss:
            message = subs[ws].wait(10)
            assert message is not None, ws
            assert (message["kind"], message["workspace_id"], message["clock"]) == (
                "commit", ws, 1
            )  # fmt: skip
            assert subs[ws].wait(0.2) is None  # its own workspace's commit only
    finally:
        for sub in subs.values():
            sub.close()


def test_the_event_hub_streams_commits_of_workspaces_on_different_nodes(
    cluster: LocalCluster, clean_db: Engine, database_url: str
) -> None:
    settings = Settings(redis_url=cluster.url, database_url=database_url)
    spread = workspaces_on(cluster, per_node=1)
    wss = [spread[port][0] for port in cluster.ports]
    oplog = OpLog(clean_db, settings)

    async def main() -> dict[str, Any]:
        hub = EventHub(cluster.url)
        try:
            listeners = {ws: await hub.open(workspace_channel(ws), "key") for ws in wss}
            # One subscribed connection per node, each with its own workspace's channel.
            for ws in wss:
                owner = cluster.node(cluster.port_of(workspace_channel(ws)))
                assert _shard_subscribers(owner, workspace_channel(ws)) == 1
            op = {"type": "cell.set", "column": "x", "value": 2}
            for ws in wss:
                await asyncio.to_thread(oplog.apply_op, ws, "cells", op)
            got = {}
            for ws, listener in listeners.items():
                data = await listener.next(10)
                got[ws] = json.loads(data) if data is not None else None
                await hub.close(listener)
            return got
        finally:
            await hub.aclose()

    got = asyncio.run(main())
    for ws in wss:
        assert got[ws] is not None and got[ws]["workspace_id"] == ws and got[ws]["clock"] == 1


def test_a_stopped_node_fails_only_its_own_workspaces(standin: StandIn) -> None:
    assert BINARY is not None
    local = LocalCluster(BINARY).start()
    try:
        spread = workspaces_on(local, per_node=1)
        # The node to stop also holds the deployment-wide set of workspaces with counters:
        # a live workspace's release broadcast must not fail with that node's SADD.
        dead_port = local.port_of(counters_workspaces_key())
        dead_ws = spread[dead_port][0]
        live = [spread[p][0] for p in local.ports if p != dead_port]
        backend = RedisLockBackend(sync_client(local.url, timeout=2, retries=1))
        for ws in [*live, dead_ws]:  # everything works before the fault
            assert call(backend, standin.url, ws, ("job-0", "t"))["path"] == "computed"
        local.kill(dead_port)
        for api in ("sync", "async"):
            cell = (f"job-{api}", "t")
            for ws in live:
                result = _within(partial(call, backend, standin.url, ws, cell, api=api), 60)
                assert result["path"] == "computed"
                assert standin.calls[cell_name(ws, *cell)] == 1
            with pytest.raises(LockUnavailable):
                _within(partial(call, backend, standin.url, dead_ws, cell, api=api), 60)
            assert standin.calls[cell_name(dead_ws, *cell)] == 0  # nothing paid without a lock
        # A waiter on a live workspace is still woken by its shard's broadcast.
        ws = live[0]
        holder = backend.acquire(ws, "job-w", "t", ttl=60)
        assert holder is not None
        box: dict[str, Any] = {}
        waiting = threading.Event()

        def waiter() -> None:
            box["out"] = run_compute_once(
                "sync", ws, "job-w", "t", check=lambda: box.get("stored"), compute=lambda: "y",
                store=lambda v: None, backend=backend, on_wait=waiting.set,
            )  # fmt: skip

        t = threading.Thread(target=waiter)
        t.start()
        assert waiting.wait(30)
        box["stored"] = "x"
        holder.release()
        backend.announce(holder, ok=True)
        t.join(30)
        assert box["out"].path is Path.WAITED and box["out"].value == "x"
        # The live workspaces' counters reached their nodes; the SADD waits for its node.
        for ws in live:
            assert backend.workspace_counters(ws)["computes"] == 3
    finally:
        local.stop()


def test_a_stopped_node_ends_only_its_own_event_streams() -> None:
    assert BINARY is not None
    local = LocalCluster(BINARY).start()
    try:
        spread = workspaces_on(local, per_node=1)
        dead_port = local.ports[0]
        dead_ws, live_ws = spread[dead_port][0], spread[local.ports[1]][0]
        backend = RedisLockBackend(sync_client(local.url, timeout=2))

        async def main() -> tuple[str | None, bytes | None]:
            hub = EventHub(local.url, subscribe_timeout=2)
            try:
                dead = await hub.open(workspace_channel(dead_ws), "key")
                live = await hub.open(workspace_channel(live_ws), "key")
                local.kill(dead_port)
                with pytest.raises(EOFError):  # the lost node's stream ends (its client resyncs)
                    while True:
                        await dead.next(10)
                handle = backend.acquire(live_ws, "job-e", "t")
                assert handle is not None and handle.release()
                await asyncio.to_thread(backend.announce, handle, ok=True)
                return dead.ended, await live.next(10)
            finally:
                await hub.aclose()

        ended, message = asyncio.run(main())
        assert ended == "redis"
        assert message is not None and json.loads(message)["kind"] == "lock_released"
    finally:
        local.stop()


def test_a_slot_moved_to_another_node_ends_its_subscriptions_and_they_follow_it() -> None:
    assert BINARY is not None
    local = LocalCluster(BINARY).start()
    try:
        ws = workspaces_on(local, per_node=1)[local.ports[0]][0]  # nothing written: empty slot
        channel = workspace_channel(ws)
        slot = key_slot(channel.encode())
        backend = RedisLockBackend(sync_client(local.url, timeout=2))
        sub = backend.subscribe(ws)
        target = local.node(local.ports[1])
        target_id = target.execute_command("CLUSTER", "MYID")

        async def main() -> tuple[str | None, bytes | None]:
            hub = EventHub(local.url, subscribe_timeout=5)
            try:
                listener = await hub.open(channel, "key")
                for port in local.ports:  # the slot now belongs to the second node
                    local.node(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
                with pytest.raises(EOFError):  # Redis ended the subscription: the stream ends
                    while True:
                        await listener.next(600)
                ended = listener.ended
                again = await hub.open(channel, "key")  # re-read slots: on the new owner
                assert _shard_subscribers(target, channel) == 1
                await asyncio.to_thread(target.spublish, channel, b'{"kind": "x"}')
                return ended, await again.next(10)
            finally:
                await hub.aclose()

        ended, message = _within(lambda: asyncio.run(main()), 60)  # no wait runs to its end
        assert ended == "redis" and message == b'{"kind": "x"}'
        # The lock waiter's subscription ends too: the protocol subscribes anew at once.
        assert _within(lambda: sub.wait(600), 60) is SUBSCRIPTION_ENDED
        sub.close()
    finally:
        local.stop()


def test_the_apis_rate_limits_can_count_on_the_cluster(cluster: LocalCluster) -> None:
    from types import SimpleNamespace

    from limits import parse

    from onceflow.integrations.fastapi.auth import Principal
    from onceflow.integrations.fastapi.ratelimit import RateLimited, RateLimits

    limits = RateLimits([parse("3/minute")], [], cluster.url)  # ONCEFLOW_REDIS_URL's form
    assert limits.storage.startswith("async+redis+cluster://")
    key = f"key-{secrets.token_hex(4)}"
    principal = Principal(key, frozenset({"*"}), frozenset())
    request: Any = SimpleNamespace(client=SimpleNamespace(host="192.0.2.1"))

    async def main() -> list[bool]:
        served = []
        for _ in range(5):
            try:
                await limits.authorize(request, lambda: principal, lambda _: None)
                served.append(True)
            except RateLimited:
                served.append(False)
        return served

    assert asyncio.run(main()) == [True, True, True, False, False]
    keys = [k.decode() for p in cluster.ports for k in cluster.node(p).keys("onceflow:ratelimit*")]
    assert any(key in k for k in keys)  # counted on the cluster


def test_an_async_backend_on_a_cluster_counts_and_releases(cluster: LocalCluster) -> None:
    ws = workspaces_on(cluster, per_node=1)[cluster.ports[2]][0]

    async def main() -> tuple[Any, dict[str, int]]:
        async with AsyncRedisLockBackend(cluster.url) as be:
            out = await run_in_loop(be, ws)
            await be.flush_counters()
            return out, await be.workspace_counters(ws)

    out, counts = asyncio.run(main())
    assert out.path is Path.COMPUTED
    assert counts["computes"] == 1


async def run_in_loop(be: AsyncRedisLockBackend, ws: str) -> Any:
    from onceflow.locks import acompute_once

    return await acompute_once(
        ws, "job-a", "t", check=lambda: None, compute=lambda: "v", store=lambda v: None, backend=be
    )


def _within(fn: Any, seconds: float) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")
