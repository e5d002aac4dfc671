"""Layer 3 on a real Postgres and Redis: each write applied once, gapless clocks, fencing.

The ``oplog`` fixture is both APIs (:class:`OpLog`, and :class:`AsyncOpLog` behind
``tests.both_apis.Blocking``); :func:`workspace_client` makes the matching SDK client
(:class:`WorkspaceClient` / :class:`AsyncWorkspaceClient` on the same event loop).
"""

from __future__ import annotations

import inspect
import json
import multiprocessing as mp
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Literal, NamedTuple, cast

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow import ClaimRef, LeaseLost, Queue
from onceflow.errors import InvalidRequest, OpIdConflict, ReplayTooOld
from onceflow.keys import workspace_channel
from onceflow.models.ops import NodeInsert, NodeMove, OpModel, apply, parse_op, register_op
from onceflow.oplog import (
    ApplyResult,
    AsyncInProcessTransport,
    AsyncOpLog,
    AsyncWorkspaceClient,
    InProcessTransport,
    OpLog,
    TransportError,
    WorkspaceClient,
    new_op_id,
)
from onceflow.settings import get_settings
from tests.both_apis import Blocking
from tests.conftest import table_snapshot
from tests.integration.test_claims import db_now


@pytest.fixture()
def oplog(api_oplog: Any) -> Any:
    """The op log, on both APIs."""
    return api_oplog


def workspace_client(
    oplog: Any, workspace_id: str, wrap: Callable[[Any], Any] = lambda t: t, **kw: Any
) -> Any:
    """The SDK client of ``oplog``'s API, in process; ``wrap`` wraps its transport."""
    if isinstance(oplog, Blocking):
        transport = wrap(AsyncInProcessTransport(oplog.target))
        return oplog.beside(AsyncWorkspaceClient(transport, workspace_id, **kw))
    return WorkspaceClient(wrap(InProcessTransport(oplog)), workspace_id, **kw)


class DropResponses:
    """A flaky network: the server commits, then the response is lost.

    Wraps a sync or an async transport (an awaitable answer is awaited, then dropped)."""

    def __init__(self, inner: Any, drops: int) -> None:
        self.inner = inner
        self.drops = drops
        self.seen: list[ApplyResult] = []

    def apply(self, *args: Any) -> Any:
        result = self.inner.apply(*args)
        if inspect.isawaitable(result):
            return self._later(result)
        return self._answer(result)

    async def _later(self, pending: Awaitable[ApplyResult]) -> ApplyResult:
        return self._answer(await pending)

    def _answer(self, result: ApplyResult) -> ApplyResult:
        self.seen.append(result)
        if self.drops > 0:
            self.drops -= 1
            raise TransportError("connection reset after the server committed")
        return result


def seed_order(oplog: OpLog, ws: str, sub_doc: str, nodes: list[str]) -> None:
    after = None
    for node in nodes:
        oplog.apply_op(ws, sub_doc, NodeInsert(node=node, after=after))
        after = node


def test_flaky_network_node_move_applied_once_same_clock(oplog: OpLog) -> None:
    seed_order(oplog, "w1", "board", ["a", "b", "c", "d"])
    client = workspace_client(oplog, "w1", lambda t: DropResponses(t, 5), backoff_base=0.001)
    flaky = client.transport
    result = client.apply("board", NodeMove(node="a", after="c"))
    assert result is not None
    assert client.retries == 5
    assert len(flaky.seen) == 6
    assert {r.clock for r in flaky.seen} == {5}  # every retry got the original clock
    assert [r.duplicate for r in flaky.seen] == [False] + [True] * 5
    doc = oplog.get_sub_doc("w1", "board")
    assert doc.state["order"] == ["b", "c", "a", "d"]
    assert doc.clock == 5
    moves = [o for o in oplog.ops_since("w1", "board") if o.op_type == "node.move"]
    assert len(moves) == 1
    assert client.pending() == []


def test_16_threads_same_op_id_applied_once(oplog: OpLog) -> None:
    op_id = new_op_id()
    barrier = threading.Barrier(16)
    results: list[ApplyResult] = []

    def send() -> None:
        barrier.wait()
        results.append(oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "fit",
                                                      "value": 0.9}, op_id))  # fmt: skip

    threads = [threading.Thread(target=send) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16
    assert {r.clock for r in results} == {1}
    assert sum(not r.duplicate for r in results) == 1
    assert oplog.get_sub_doc("w1", "cells").clock == 1
    assert len(oplog.ops_since("w1", "cells")) == 1


def test_attempts_waiting_on_the_sub_doc_lock_join_the_first(
    oplog: OpLog, clean_db: Engine
) -> None:
    from sqlalchemy import text

    from onceflow.demo.procs import wait_for

    oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 0})
    op_id = new_op_id()
    results: list[ApplyResult] = []

    def send() -> None:
        results.append(oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a",
                                                      "value": 1}, op_id))  # fmt: skip

    def waiting() -> int:
        with clean_db.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )).scalar_one())  # fmt: skip

    with clean_db.connect() as blocker:  # every attempt passes the replay lookup, then waits
        blocker.execute(text("SELECT 1 FROM workspace_sub_docs WHERE sub_doc = 'cells' FOR UPDATE"))
        threads = [threading.Thread(target=send) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: waiting() == 3, what="three attempts waiting on the sub-doc lock")
        blocker.rollback()
    for t in threads:
        t.join(timeout=30)
    # The first commits; the two others meet its op id's key and join it (not applied twice).
    assert sorted((r.clock, r.duplicate) for r in results) == [(2, False), (2, True), (2, True)]
    assert [o.clock for o in oplog.ops_since("w1", "cells")] == [1, 2]


#: Ops per writer process. The property is gapless clocks under concurrent writers, not
#: volume: the eight processes wait at a barrier once imported and connected, so their
#: writes overlap from the first op (500 each, started one by one, mostly did not).
OPS_PER_WRITER = 150


def _writer(
    database_url: str,
    redis_url: str,
    n: int,
    start: Any,
    out: mp.Queue,  # type: ignore[type-arg]
) -> None:
    import os

    os.environ["ONCEFLOW_REDIS_URL"] = redis_url
    from onceflow.oplog import OpLog as Log

    log = Log(database_url)
    log.get_sub_doc("w1", "hot")  # connected before the barrier: the first writes race
    start.wait(timeout=120)
    clocks = []
    for i in range(OPS_PER_WRITER):
        op = {"type": "cell.set", "column": f"c{i % 7}", "value": [n, i]}
        clocks.append(log.apply_op("w1", "hot", op, new_op_id()).clock)
    out.put(clocks)


@pytest.mark.slow
def test_8_writers_gapless_clocks_and_replayable(
    clean_db: Engine, database_url: str, redis_url: str
) -> None:
    oplog = OpLog(clean_db, get_settings())  # sync only: the writers are processes
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(8)
    procs = [
        ctx.Process(target=_writer, args=(database_url, redis_url, n, start, out)) for n in range(8)
    ]
    for p in procs:
        p.start()
    clocks = [c for _ in procs for c in out.get(timeout=300)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    total = 8 * OPS_PER_WRITER
    assert sorted(clocks) == list(range(1, total + 1))
    ops = oplog.ops_since("w1", "hot", 0, limit=10_000)
    assert [o.clock for o in ops] == list(range(1, total + 1))
    state: dict[str, Any] = {}
    for o in ops:
        state, _ = apply(state, parse_op(o.payload))
    doc = oplog.get_sub_doc("w1", "hot")
    assert (doc.clock, doc.state) == (total, state)


def test_same_op_id_other_payload_conflicts_other_scopes_independent(
    oplog: OpLog, clean_db: Engine
) -> None:
    op_id = new_op_id()
    first = oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1}, op_id)
    before = table_snapshot_ops(clean_db)
    with pytest.raises(OpIdConflict):
        oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 2}, op_id)
    assert table_snapshot_ops(clean_db) == before
    assert oplog.get_sub_doc("w1", "cells").state == {"cells": {"a": 1}}
    other_doc = oplog.apply_op(
        "w1", "other", {"type": "cell.set", "column": "a", "value": 2}, op_id
    )
    other_ws = oplog.apply_op("w2", "cells", {"type": "cell.set", "column": "a", "value": 3}, op_id)
    assert (first.clock, other_doc.clock, other_ws.clock) == (1, 1, 1)
    assert not other_doc.duplicate and not other_ws.duplicate


def table_snapshot_ops(engine: Engine) -> list[Any]:
    from sqlalchemy import text

    with engine.connect() as conn:
        ops = conn.execute(text("SELECT * FROM workspace_sub_doc_ops ORDER BY 1, 2, 3")).all()
        docs = conn.execute(text("SELECT * FROM workspace_sub_docs ORDER BY 1, 2")).all()
    return [tuple(r) for r in ops] + [tuple(r) for r in docs]


def test_rejected_op_is_recorded_and_its_retry_gets_the_same_answer(oplog: OpLog) -> None:
    seed_order(oplog, "w1", "board", ["a"])
    op_id = new_op_id()
    bad = NodeMove(node="ghost", after="a")
    first = oplog.apply_op("w1", "board", bad, op_id)
    assert (first.applied, first.clock) == (False, None)
    assert "ghost" in first.error["message"]
    seed_order(oplog, "w1", "board2", [])
    oplog.apply_op("w1", "board", NodeInsert(node="ghost", after="a"))  # now it could apply...
    again = oplog.apply_op("w1", "board", bad, op_id)
    assert (again.duplicate, again.applied, again.error) == (True, False, first.error)  # ...but no
    assert oplog.get_sub_doc("w1", "board").clock == 2  # the rejection took no clock


# A merge op may give the state any shape: the built-ins' "cells" / "order" included.
BAD_SHAPES = [{"cells": "x", "order": "abc"}, {"cells": [1], "order": {"a": 1, "b": 2}}]
SHAPE_OPS: list[dict[str, Any]] = [
    {"type": "cell.set", "column": "fit", "value": 1},
    {"type": "cell.clear", "column": "x"},
    {"type": "node.insert", "node": "b", "after": "a"},
    {"type": "node.move", "node": "a"},
    {"type": "node.delete", "node": "a"},
]


@pytest.mark.parametrize("shape", BAD_SHAPES, ids=["strings", "list-and-object"])
@pytest.mark.parametrize("op", SHAPE_OPS, ids=[o["type"] for o in SHAPE_OPS])
def test_a_builtin_op_on_a_shape_a_merge_made_is_rejected_and_recorded(
    oplog: OpLog, shape: dict[str, Any], op: dict[str, Any]
) -> None:
    """Was: a raw TypeError / AttributeError (a rolled-back transaction, an HTTP 500), or for
    ``node.insert`` into the string "abc" a wrong answer ("'b' is already in the order")."""
    assert oplog.apply_op("w1", "doc", {"type": "merge", "patch": shape}, new_op_id()).clock == 1
    op_id = new_op_id()
    first = oplog.apply_op("w1", "doc", op, op_id)
    assert (first.applied, first.clock, first.error["type"]) == (False, None, "OpRejected")
    field = "cells" if op["type"].startswith("cell.") else "order"
    assert f"'{field}'" in first.error["message"], first.error
    again = oplog.apply_op("w1", "doc", op, op_id)  # its retry gets the same answer
    assert (again.duplicate, again.applied, again.error) == (True, False, first.error)
    assert oplog.get_sub_doc("w1", "doc").clock == 1  # the rejection took no clock
    repair = {"type": "merge", "patch": {"cells": {"x": 1}, "order": ["a"]}}
    assert oplog.apply_op("w1", "doc", repair, new_op_id()).clock == 2
    fresh = oplog.apply_op("w1", "doc", op, new_op_id())  # the same op, repaired state
    assert (fresh.applied, fresh.clock, fresh.error) == (True, 3, None)


class Buggy(OpModel):
    """A user's op whose apply function fails on some states (a pure function's bug)."""

    type: Literal["test.buggy"] = "test.buggy"
    key: str


def _buggy(state: dict[str, Any], op: Buggy) -> tuple[dict[str, Any], Any]:
    state["picked"] = state["table"][op.key]  # KeyError / TypeError on some states
    return state, None


register_op("test.buggy", Buggy, _buggy)


def test_a_registered_ops_error_on_the_state_is_a_recorded_rejection(oplog: OpLog) -> None:
    op_id = new_op_id()
    first = oplog.apply_op("w1", "doc", Buggy(key="k"), op_id)  # no "table": KeyError
    assert (first.applied, first.clock, first.error["type"]) == (False, None, "OpRejected")
    assert "KeyError" in first.error["message"]
    again = oplog.apply_op("w1", "doc", Buggy(key="k"), op_id)
    assert (again.duplicate, again.error) == (True, first.error)
    oplog.apply_op("w1", "doc", {"type": "merge", "patch": {"table": {"k": 7}}}, new_op_id())
    done = oplog.apply_op("w1", "doc", Buggy(key="k"), new_op_id())
    assert (done.applied, done.clock) == (True, 2)
    assert oplog.get_sub_doc("w1", "doc").state == {"table": {"k": 7}, "picked": 7}


def test_over_http_a_shape_rejection_is_an_answer_and_the_sdk_goes_on(clean_db: Engine) -> None:
    """Was: HTTP 500, which the SDK takes for "outcome unknown": its outbox stuck at that op."""
    import httpx
    from fastapi.testclient import TestClient

    from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
    from onceflow.oplog.http import HttpTransport
    from onceflow.tasks import Flow

    oplog = OpLog(clean_db, get_settings())
    oplog.apply_op("w1", "doc", {"type": "merge", "patch": {"cells": "x"}}, new_op_id())
    key = "of_test_shape_key_0123456789abcdef"
    app = create_app(
        Flow(settings=oplog.settings),
        auth=KeyAuth({hash_key(key): ["w1"]}),
        settings=oplog.settings,
    )
    set_fit = {"type": "cell.set", "column": "fit", "value": 1}
    with TestClient(app, raise_server_exceptions=False) as http:
        answer = http.post("/v1/workspaces/w1/sub-docs/doc/ops", json={"op_id": new_op_id(),
                           "op": set_fit}, headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert answer.status_code == 201, answer.text
        body = answer.json()
        assert (body["applied"], body["clock"], body["error"]["type"]) == (
            False,
            None,
            "OpRejected",
        )
        transport = HttpTransport("http://testserver", key, client=cast(httpx.Client, http))
        client = WorkspaceClient(transport, "w1", max_attempts=2, backoff_base=0.01)
        rejected = client.apply("doc", set_fit)
        assert rejected is not None and rejected.error is not None
        repair = client.apply("doc", {"type": "merge", "patch": {"cells": {}}})
        assert repair is not None and repair.clock == 2
        again = client.apply("doc", set_fit)
        assert again is not None and again.clock == 3 and client.pending() == []
    assert oplog.get_sub_doc("w1", "doc").state == {"cells": {"fit": 1}}


@pytest.mark.parametrize(
    "op",
    [
        {"type": "node.teleport", "node": "a"},
        {"type": "cell.set"},
        {"type": "cell.set", "column": "", "value": 1},
        {"type": "cell.set", "column": "a", "value": 1, "extra": True},
        {"type": "merge", "patch": []},
        ["not", "an", "object"],
    ],
)
def test_unknown_or_invalid_ops_write_nothing(oplog: OpLog, clean_db: Engine, op: Any) -> None:
    before = table_snapshot_ops(clean_db)
    with pytest.raises(InvalidRequest):
        oplog.apply_op("w1", "cells", op, new_op_id())
    assert table_snapshot_ops(clean_db) == before


@pytest.mark.parametrize(
    "op_id", ["", "short", "x" * 65, "has space in it!!", "ünïcödé-but-long-enough"]
)
def test_op_ids_must_look_real(oplog: OpLog, op_id: str) -> None:
    with pytest.raises(InvalidRequest, match="op_id"):
        oplog.apply_op("w1", "cells", {"type": "cell.clear", "column": "a"}, op_id)


def test_stage_write_with_a_lapsed_fence_changes_nothing(oplog: OpLog, clean_db: Engine) -> None:
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", "w1", "j1", "main").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=1)
    assert claim is not None
    live = oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1},
                          new_op_id(), fence=claim)  # fmt: skip
    assert live.clock == 1
    # Another worker takes the request once the lease lapses (database clock moved on).
    later = db_now(clean_db) + timedelta(seconds=2)
    assert queue.claim(rid, "worker-b", now=later) is not None
    before = table_snapshot_ops(clean_db)
    with pytest.raises(LeaseLost):
        oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 2},
                       new_op_id(), fence=claim)  # fmt: skip
    assert table_snapshot_ops(clean_db) == before
    assert table_snapshot(clean_db)[0] is not None


def test_a_fenced_op_in_another_workspace_is_refused_and_writes_nothing(
    oplog: OpLog, clean_db: Engine
) -> None:
    """A stage's fence holds in its own workspace only: an op the caller addresses to
    another workspace (the Python API takes both) would make one transaction span two
    workspaces — two shards once the database is split by workspace. It is refused, not
    applied to the other workspace under this fence."""
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", "w1", "j1", "main").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=600)
    assert claim is not None
    before = table_snapshot_ops(clean_db)
    op = {"type": "cell.set", "column": "a", "value": 1}
    for fence in (claim, FenceRef(rid, claim.token)):
        with pytest.raises(InvalidRequest, match="fence's workspace 'w1', not 'w2'"):
            oplog.apply_op("w2", "cells", op, new_op_id(), fence=fence)
    assert table_snapshot_ops(clean_db) == before
    assert oplog.ops_since("w2", "cells") == []
    # In its own workspace the same fence writes.
    assert oplog.apply_op("w1", "cells", op, new_op_id(), fence=claim).clock == 1


class FenceRef(NamedTuple):
    """A fence that is not a Claim: the request id and claim token a remote worker holds."""

    request_id: str
    token: str


def zombie_ops() -> float:
    from prometheus_client import REGISTRY

    sample = REGISTRY.get_sample_value("onceflow_zombie_writes_rejected_total", {"operation": "op"})
    return sample or 0.0


def test_fenced_op_by_reference_live_retried_lost(oplog: OpLog, clean_db: Engine) -> None:
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", "w1", "j1", "main").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=600)
    assert claim is not None
    op_id = new_op_id()
    first = oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1},
                           op_id, fence=FenceRef(rid, claim.token))  # fmt: skip
    assert (first.clock, first.duplicate) == (1, False)
    assert [o.fence for o in oplog.ops_since("w1", "cells")] == [rid]
    again = oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1},
                           op_id, fence=claim)  # fmt: skip
    assert (again.clock, again.duplicate, again.committed_at) == (1, True, first.committed_at)

    queue.claim(rid, "worker-b", now=db_now(clean_db) + timedelta(seconds=601))  # lease lapsed
    before = table_snapshot_ops(clean_db)
    zombies = zombie_ops()
    for fence in (claim, FenceRef(rid, "not-the-claim-token")):
        with pytest.raises(LeaseLost):
            oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "b", "value": 2},
                           new_op_id(), fence=fence)  # fmt: skip
    assert table_snapshot_ops(clean_db) == before
    assert zombie_ops() == zombies + 2
    # The committed write's retry still learns its answer: it was fenced when it applied.
    late = oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1},
                          op_id, fence=claim)  # fmt: skip
    assert (late.clock, late.duplicate) == (1, True)
    assert table_snapshot_ops(clean_db) == before


def test_async_oplog_from_a_sync_one_publishes_on_its_loop(
    clean_db: Engine, redis_url: str
) -> None:
    import asyncio

    sync = OpLog(clean_db, get_settings())
    pubsub = redis_lib.Redis.from_url(redis_url).pubsub()
    pubsub.subscribe(workspace_channel("w-async"))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]

    async def main() -> tuple[ApplyResult, ApplyResult]:
        aoplog = AsyncOpLog.from_oplog(sync)
        try:
            op = {"type": "cell.set", "column": "x", "value": 1}
            first = await aoplog.apply_op("w-async", "cells", op, "async-op-id-0123456789")
            replay = await aoplog.apply_op("w-async", "cells", op, "async-op-id-0123456789")
            return first, replay
        finally:
            await aoplog.aclose()

    first, replay = asyncio.run(main())
    assert (first.clock, replay.clock, replay.duplicate) == (1, 1, True)
    msg = pubsub.get_message(timeout=5)
    assert msg is not None and json.loads(msg["data"])["op_id"] == "async-op-id-0123456789"
    assert pubsub.get_message(timeout=0.2) is None  # the replay is not broadcast again
    pubsub.close()
    assert sync.get_sub_doc("w-async", "cells").clock == 1


def test_broadcast_comes_after_commit(oplog: OpLog, clean_db: Engine, redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(workspace_channel("w-bc"))
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    seen: list[tuple[int, int]] = []
    messages: list[dict[str, Any]] = []
    reader = OpLog(clean_db, get_settings())

    def listen() -> None:
        while len(seen) < 20:
            msg = pubsub.get_message(timeout=10)
            if msg is None:
                return
            if msg["type"] == "message":
                data = json.loads(msg["data"])
                messages.append(data)
                # Read the sub-doc the moment the broadcast arrives: the commit must be visible.
                seen.append((data["clock"], reader.get_sub_doc("w-bc", "cells").clock))

    listener = threading.Thread(target=listen)
    listener.start()
    for i in range(20):
        oplog.apply_op("w-bc", "cells", {"type": "cell.set", "column": "x", "value": i})
    listener.join(timeout=30)
    pubsub.close()
    assert [c for c, _ in seen] == list(range(1, 21))
    assert all(visible >= clock for clock, visible in seen)
    # The message the SSE streams forward as `event: commit` (the same from both APIs).
    first = {"kind": "commit", "workspace_id": "w-bc", "sub_doc": "cells", "clock": 1}
    assert messages[0] == {**first, "op_id": messages[0]["op_id"], "type": "cell.set"}
    assert list(messages[0]) == ["kind", "workspace_id", "sub_doc", "clock", "op_id", "type"]


def test_replay_older_than_retention_is_refused(oplog: OpLog, clean_db: Engine) -> None:
    old = oplog.apply_op(
        "w1", "cells", {"type": "cell.set", "column": "a", "value": 1}, new_op_id(), base_clock=0
    )
    assert oplog.prune(older_than_seconds=3600, now=db_now(clean_db) + timedelta(hours=2)) == 1
    # The pruned op's id is forgotten: a replay of it (based on clock 0, as first sent) must
    # not be applied a second time. (Without base_clock the server cannot tell a replay from
    # a new op: tests/integration/test_op_retention.py.)
    with pytest.raises(ReplayTooOld):
        oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1}, old.op_id,
                       base_clock=0)  # fmt: skip
    with pytest.raises(ReplayTooOld):
        oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "a", "value": 1},
                       new_op_id(), base_clock=0)  # fmt: skip
    fresh = oplog.apply_op("w1", "cells", {"type": "cell.set", "column": "b", "value": 2},
                           new_op_id(), base_clock=1)  # fmt: skip
    assert fresh.clock == 2
    assert oplog.get_sub_doc("w1", "cells").state["cells"] == {"a": 1, "b": 2}


@pytest.mark.slow
def test_client_killed_with_ops_in_its_outbox_new_client_replays_them_once(
    oplog: OpLog, database_url: str, tmp_path: Any
) -> None:
    import signal
    import subprocess
    import sys

    from tests.acceptance.procs import ROOT

    seed_order(oplog, "w1", "board", ["a", "b", "c", "d"])
    outbox = tmp_path / "outbox.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.oplog_client_proc", database_url, str(outbox)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "QUEUED"
    committed = proc.stdout.readline().split()  # the first op reached the server ...
    assert committed[0] == "COMMITTED"
    proc.send_signal(signal.SIGKILL)  # ... and the client died before hearing back
    proc.wait(timeout=10)

    client = workspace_client(oplog, "w1", outbox=outbox)  # "tab reload" (either API)
    pending = client.pending()
    assert len(pending) == 5 and pending[0]["op_id"] == committed[1]
    results = client.replay()
    assert [r.op_id for r in results] == [p["op_id"] for p in pending]
    assert results[0].duplicate and results[0].clock == int(committed[2])
    assert [r.clock for r in results] == [5, 6, 7, 8, 9]
    assert client.pending() == []
    ops = oplog.ops_since("w1", "board")
    assert [o.op_id for o in ops[4:]] == [p["op_id"] for p in pending]  # once each, in order
    # a b c d -> d a b c -> d a e b c -> d a e b c (b after e) -> f d a e b c -> f a d e b c
    assert oplog.get_sub_doc("w1", "board").state["order"] == ["f", "a", "d", "e", "b", "c"]


def test_a_fenced_op_by_reference_needs_no_workspace(oplog: OpLog, clean_db: Engine) -> None:
    """What an HTTP pull worker holds is (request id, token): the fence's own statement names
    the workspace, so nothing is read to find it; a reference scoped to another worker class
    is fenced off like a wrong token, and nothing is written."""
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", "w-ref", "j1", "main", worker_class="llm").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=600)
    assert claim is not None
    op = {"type": "cell.set", "column": "a", "value": 1}
    done = oplog.apply_op(None, "cells", op, new_op_id(),
                          fence=ClaimRef(rid, claim.token, ("llm",)))  # fmt: skip
    assert (done.workspace_id, done.clock) == ("w-ref", 1)
    assert [o.fence for o in oplog.ops_since("w-ref", "cells")] == [rid]
    before = table_snapshot_ops(clean_db)
    with pytest.raises(LeaseLost):
        oplog.apply_op(None, "cells", op, new_op_id(),
                       fence=ClaimRef(rid, claim.token, ("tabs",)))  # fmt: skip
    with pytest.raises(InvalidRequest, match="workspace_id is required"):
        oplog.apply_op(None, "cells", op, new_op_id())
    assert table_snapshot_ops(clean_db) == before


def test_a_by_reference_retry_of_a_landed_op_after_the_claim_ended_replays(
    oplog: OpLog, clean_db: Engine
) -> None:
    """The HTTP claim-op route passes no workspace: a retry whose answer was lost, made once
    the claim is over, still learns its answer (as it does with a workspace given) — looked
    up by the fence the op row keeps; another payload under its op id is a conflict."""
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", "w-ref", "j1", "main", worker_class="llm").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=600)
    assert claim is not None
    ref = ClaimRef(rid, claim.token, ("llm",))
    op = {"type": "cell.set", "column": "a", "value": 1}
    op_id = new_op_id()
    first = oplog.apply_op(None, "cells", op, op_id, fence=ref)
    queue.claim(rid, "worker-b", now=db_now(clean_db) + timedelta(seconds=601))  # lapsed
    before = table_snapshot_ops(clean_db)
    zombies = zombie_ops()
    late = oplog.apply_op(None, "cells", op, op_id, fence=ref)
    assert (late.workspace_id, late.clock, late.duplicate, late.committed_at) == (
        "w-ref", first.clock, True, first.committed_at,
    )  # fmt: skip
    assert zombie_ops() == zombies  # a replay, not a refused write
    with pytest.raises(OpIdConflict):
        oplog.apply_op(None, "cells", {**op, "value": 2}, op_id, fence=ref)
    for fence, sub_doc, oid in (
        (ClaimRef(rid, claim.token, ("tabs",)), "cells", op_id),  # another class's key
        (ref, "other", op_id),  # another sub-doc
        (ref, "cells", new_op_id()),  # an op never written
    ):
        with pytest.raises(LeaseLost):
            oplog.apply_op(None, sub_doc, op, oid, fence=fence)
    assert zombie_ops() == zombies + 3
    assert table_snapshot_ops(clean_db) == before


def test_asyncio_run_per_call_keeps_one_redis_client_at_most(
    clean_db: Engine, redis_url: str
) -> None:
    """``asyncio.run`` per call: a closed loop's ``redis.asyncio`` client goes, and its
    connection with it (a loop-keyed weak table kept every client: it holds its loop)."""
    import asyncio
    import gc
    import time

    aoplog = AsyncOpLog(clean_db.url.render_as_string(hide_password=False))

    async def my_connection_id() -> int:
        return int(await aoplog.redis().client_id())

    ids = [asyncio.run(my_connection_id()) for _ in range(4)]
    gc.collect()
    assert len(aoplog._redis) <= 1, f"{len(aoplog._redis)} clients kept"
    r = redis_lib.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10  # a shut socket's client goes from the list a moment later
    while True:
        kept = {int(c["id"]) for c in r.client_list()} & set(ids)
        if len(kept) <= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(kept) <= 1, f"{len(kept)} connections of closed loops still open"
    asyncio.run(aoplog.aclose())
    assert len(aoplog._redis) == 0
