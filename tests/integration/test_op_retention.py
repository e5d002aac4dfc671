"""The op log's retention horizon on a real Postgres and Redis.

Pruning must never refuse a new write: a client op without ``base_clock``, a
stage's fenced write and an SDK op minted on a stale clock all apply after a
prune; only an op the log no longer knows *and* based below the horizon is
refused, and the SDK parks it for the application instead of dropping it.
Time moves through ``prune(now=…)``, never by sleeping. Every test runs on both APIs
(:class:`OpLog` / :class:`AsyncOpLog`, with the matching SDK client).
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from sqlalchemy import Engine, text

from onceflow import Queue
from onceflow.demo.procs import wait_for
from onceflow.errors import InvalidRequest, ReplayTooOld
from onceflow.models.ops import NodeInsert
from onceflow.oplog import (
    AsyncWorkspaceClient,
    OpLog,
    OpsParked,
    TransportError,
    WorkspaceClient,
    new_op_id,
    stage_op_id,
)
from tests.both_apis import Blocking
from tests.integration.test_claims import db_now
from tests.integration.test_oplog import DropResponses, table_snapshot_ops, workspace_client

WS = "w-ret"


@pytest.fixture()
def oplog(api_oplog: Any) -> Any:
    """The op log, on both APIs."""
    return api_oplog


def cell(column: str, value: Any) -> dict[str, Any]:
    return {"type": "cell.set", "column": column, "value": value}


def pruned_clock(engine: Engine, sub_doc: str) -> int:
    with engine.connect() as conn:
        value = conn.execute(
            text(
                "SELECT pruned_clock FROM workspace_sub_docs"
                " WHERE workspace_id = :w AND sub_doc = :s"
            ),
            {"w": WS, "s": sub_doc},
        ).scalar_one()
    return int(value)


def logged_clocks(oplog: OpLog, sub_doc: str) -> list[int]:
    return [o.clock for o in oplog.ops_since(WS, sub_doc)]


def prune_all(oplog: OpLog, engine: Engine) -> int:
    """Prune as if two hours had passed with a one-hour window: every op row is past it."""
    return oplog.prune(older_than_seconds=3600, now=db_now(engine) + timedelta(hours=2))


def test_after_a_prune_a_new_client_op_without_base_clock_applies(
    oplog: OpLog, clean_db: Engine
) -> None:
    for i in range(3):
        oplog.apply_op(WS, "cells", cell("a", i), new_op_id())
    assert prune_all(oplog, clean_db) == 3
    assert pruned_clock(clean_db, "cells") == 3

    fresh = oplog.apply_op(WS, "cells", cell("b", 1), new_op_id())  # no base_clock
    assert (fresh.clock, fresh.duplicate, fresh.error) == (4, False, None)
    again = oplog.apply_op(WS, "cells", cell("b", 1), fresh.op_id)  # its retry dedups
    assert (again.clock, again.duplicate) == (4, True)
    assert oplog.get_sub_doc(WS, "cells").state["cells"] == {"a": 2, "b": 1}


class RecordSends:
    """Wraps a sync or an async transport: records each send's (op id, base_clock)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: list[tuple[str, int | None]] = []

    def apply(self, *args: Any) -> Any:
        self.sent.append((args[3], args[4]))
        return self.inner.apply(*args)


def test_a_new_clients_first_op_on_a_pruned_sub_doc_is_rebased_once_and_applies(
    oplog: OpLog, clean_db: Engine, tmp_path: Path
) -> None:
    for i in range(3):
        oplog.apply_op(WS, "cells", cell("a", i), new_op_id())
    assert prune_all(oplog, clean_db) == 3
    recorder: list[RecordSends] = []

    def record(transport: Any) -> RecordSends:
        recorder.append(RecordSends(transport))
        return recorder[-1]

    # A client that never saw the sub-doc bases its op on clock 0: below the horizon (3),
    # so refused once; this process never sent it, so it is re-based on 3 and sent again.
    client = workspace_client(oplog, WS, record, outbox=tmp_path / "o.sqlite")
    sent = client.apply("cells", cell("c", 1))
    assert sent is not None and (sent.clock, sent.duplicate) == (4, False)
    assert recorder[0].sent == [(sent.op_id, 0), (sent.op_id, 3)]
    assert client.pending() == [] and client.parked() == []
    assert client.seen_clock("cells") == 4
    assert oplog.get_sub_doc(WS, "cells").state["cells"] == {"a": 2, "c": 1}


def test_sdk_first_op_on_an_unseen_sub_doc_lost_answer_pruned_is_parked_not_applied_twice(
    oplog: OpLog, clean_db: Engine, tmp_path: Path
) -> None:
    """Was: the SDK minted its first op on a sub-doc it never saw without base_clock, so
    once the op's row was pruned its replay was taken as new and applied a second time (a
    node another user had deleted came back)."""
    for i in range(3):  # another client has been writing to the sub-doc: clock 3
        oplog.apply_op(WS, "board", NodeInsert(node=f"n{i}", after=f"n{i - 1}" if i else None))
    client = workspace_client(
        oplog, WS, lambda t: DropResponses(t, drops=1), outbox=tmp_path / "o.sqlite",
        max_attempts=1,
    )  # fmt: skip
    with pytest.raises(TransportError):  # committed, then the answer was lost
        client.apply("board", NodeInsert(node="mine", after="n2"))
    [queued] = client.pending()
    assert queued["base_clock"] == 0  # minted on a sub-doc never seen: clock 0, not None
    assert oplog.get_sub_doc(WS, "board").state["order"] == ["n0", "n1", "n2", "mine"]

    assert prune_all(oplog, clean_db) == 4  # offline past the window: its row is pruned
    oplog.apply_op(WS, "board", {"type": "node.delete", "node": "mine"})  # another user
    with pytest.raises(OpsParked) as parked:  # the replay: refused as too old, parked
        client.replay()
    assert [p["op_id"] for p in parked.value.parked] == [queued["op_id"]]
    assert [p["op_id"] for p in client.parked()] == [queued["op_id"]]
    doc = oplog.get_sub_doc(WS, "board")
    assert (doc.clock, doc.state["order"]) == (5, ["n0", "n1", "n2"])  # not applied again
    client.close()


def test_a_fenced_stage_write_applies_after_a_prune(oplog: OpLog, clean_db: Engine) -> None:
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", WS, "j1", "main").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=600)
    assert claim is not None
    for i in range(2):
        oplog.apply_op(WS, "job:j1", cell("seed", i), new_op_id())
    assert prune_all(oplog, clean_db) == 2

    op_id = stage_op_id(rid, "cell:fit")  # what ctx.apply_op(key="cell:fit") sends
    write = oplog.apply_op(WS, "job:j1", cell("fit", 0.8), op_id, fence=claim)
    assert (write.clock, write.duplicate, write.error) == (3, False, None)
    retry = oplog.apply_op(WS, "job:j1", cell("fit", 0.8), op_id, fence=claim)
    assert (retry.clock, retry.duplicate) == (3, True)
    assert [o.fence for o in oplog.ops_since(WS, "job:j1")] == [rid]


def _blocked_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        waiting = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return bool(waiting)


def _committed_at(engine: Engine, sub_doc: str) -> dict[int, datetime]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT clock, committed_at FROM workspace_sub_doc_ops"
                " WHERE workspace_id = :w AND sub_doc = :s AND clock IS NOT NULL"
            ),
            {"w": WS, "s": sub_doc},
        ).all()
    return {int(c): at for c, at in rows}


def test_prune_goes_by_clock_and_refuses_only_replays_below_the_horizon(
    oplog: OpLog, clean_db: Engine
) -> None:
    queue = Queue(clean_db, settings=oplog.settings)
    rid = queue.enqueue("evaluate", WS, "j1", "main").request_id
    claim = queue.claim(rid, "worker-a", lease_seconds=600)
    assert claim is not None
    ops = {clock: cell("a", clock) for clock in (1, 2, 3)} | {4: cell("b", 4), 6: cell("c", 6)}
    sent = {}
    for clock in (1, 2, 3):  # as the SDK sends them: based on the clock seen before
        sent[clock] = oplog.apply_op(WS, "cells", ops[clock], new_op_id(), base_clock=clock - 1)

    # committed_at is the transaction's start: a fenced write whose transaction began first
    # but waited (here: on its request row) commits after a later one, with an older time.
    late: dict[str, Any] = {}
    with clean_db.connect() as blocker:
        blocker.execute(
            text("SELECT 1 FROM workspace_process_requests WHERE request_id = :r FOR UPDATE"),
            {"r": rid},
        )

        def stage_write() -> None:
            late["r"] = oplog.apply_op(WS, "cells", cell("late", 1),
                                       stage_op_id(rid, "cell:late"), fence=claim)  # fmt: skip

        writer = threading.Thread(target=stage_write)
        writer.start()
        wait_for(lambda: _blocked_on_a_lock(clean_db), what="the fenced write to wait")
        sent[4] = oplog.apply_op(WS, "cells", ops[4], new_op_id(), base_clock=3)
        blocker.rollback()
    writer.join(timeout=30)
    assert late["r"].clock == 5
    sent[6] = oplog.apply_op(WS, "cells", ops[6], new_op_id(), base_clock=5)
    at = _committed_at(clean_db, "cells")
    assert at[5] < at[4] < at[6]

    # The window's edge falls between op 5 and op 4: ops 1-3 and 5 are older than it.
    cutoff = at[5] + (at[4] - at[5]) / 2
    assert oplog.prune(older_than_seconds=60, now=cutoff + timedelta(seconds=60)) == 5
    assert pruned_clock(clean_db, "cells") == 5
    assert logged_clocks(oplog, "cells") == [6]  # exactly the ops above the horizon

    before = table_snapshot_ops(clean_db)
    for clock in (3, 4):  # forgotten, and based below the horizon: maybe applied already
        with pytest.raises(ReplayTooOld) as refused:
            oplog.apply_op(WS, "cells", ops[clock], sent[clock].op_id, base_clock=clock - 1)
        assert refused.value.horizon == 5
    assert table_snapshot_ops(clean_db) == before

    replay = oplog.apply_op(WS, "cells", ops[6], sent[6].op_id, base_clock=5)
    assert (replay.clock, replay.duplicate) == (6, True)  # at the horizon: still known
    fresh = oplog.apply_op(WS, "cells", cell("d", 7), new_op_id(), base_clock=5)
    assert (fresh.clock, fresh.duplicate) == (7, False)


def test_pruning_only_rejected_ops_leaves_the_horizon(oplog: OpLog, clean_db: Engine) -> None:
    missing = {"type": "node.move", "node": "nope", "after": None}
    rejected = oplog.apply_op(WS, "board", missing, new_op_id(), base_clock=0)
    assert rejected.clock is None and rejected.error is not None
    edge = db_now(clean_db)
    for node in ("a", "b", "c"):
        oplog.apply_op(WS, "board", NodeInsert(node=node), new_op_id())
    # Only the rejected op is older than the window.
    assert oplog.prune(older_than_seconds=60, now=edge + timedelta(seconds=60)) == 1
    assert pruned_clock(clean_db, "board") == 0
    assert logged_clocks(oplog, "board") == [1, 2, 3]
    # So an op minted offline at clock 1 is not taken for a pruned replay.
    offline = oplog.apply_op(WS, "board", NodeInsert(node="d"), new_op_id(), base_clock=1)
    assert (offline.clock, offline.duplicate) == (4, False)


@pytest.mark.parametrize(
    "bad",
    [
        {"older_than_seconds": -3600},
        {"older_than_seconds": 0},
        {"older_than_seconds": float("nan")},
        {"older_than_seconds": float("inf")},
        {"older_than_seconds": True},
        {"older_than_seconds": "60"},
        {"older_than_seconds": 60, "limit": True},
        {"older_than_seconds": 60, "limit": 0},
    ],
)
def test_prune_refuses_bad_ages_and_limits_and_deletes_nothing(
    oplog: OpLog, clean_db: Engine, bad: dict[str, Any]
) -> None:
    # Before: older_than_seconds=-3600 deleted the op applied just now (its retry without
    # a base clock would then apply it again); "60" and True were taken as numbers.
    oplog.apply_op(WS, "board", NodeInsert(node="a"), new_op_id())
    with pytest.raises(InvalidRequest):
        oplog.prune(now=db_now(clean_db) + timedelta(seconds=1), **bad)
    assert logged_clocks(oplog, "board") == [1]
    assert pruned_clock(clean_db, "board") == 0


def test_sdk_parks_a_too_old_op_sends_the_others_and_resubmits_or_discards(
    oplog: OpLog, clean_db: Engine, tmp_path: Path
) -> None:
    outbox = tmp_path / "outbox.sqlite"
    client = workspace_client(oplog, WS, outbox=outbox)
    first = client.apply("board", NodeInsert(node="a"))
    assert first is not None and first.clock == 1
    for node in ("b", "c", "d"):  # other writers move the sub-doc on
        oplog.apply_op(WS, "board", NodeInsert(node=node, after="a"))
    # Offline: two ops based on clock 1 (the last the client saw), one on a sub-doc it never
    # saw, one whose caller read clock 4.
    client.apply("board", NodeInsert(node="x"), send=False)
    client.apply("board", NodeInsert(node="w"), send=False)
    client.apply("cells", cell("y", 1), send=False)
    client.apply("board", NodeInsert(node="z"), base_clock=4, send=False)
    queued = client.pending()
    assert [p["base_clock"] for p in queued] == [1, 1, 0, 4]  # never seen: 0
    client.close()  # the process is gone: whether x and w were ever sent is unknown

    assert prune_all(oplog, clean_db) == 4
    assert pruned_clock(clean_db, "board") == 4

    client = workspace_client(oplog, WS, outbox=outbox)  # "tab reload"
    with pytest.raises(ReplayTooOld) as parked:
        client.replay()
    report: Any = parked.value
    assert [p["op_id"] for p in report.parked] == [queued[0]["op_id"], queued[1]["op_id"]]
    assert [(r.op_id, r.clock) for r in report.results] == [
        (queued[2]["op_id"], 1),
        (queued[3]["op_id"], 5),
    ]
    assert sorted(oplog.get_sub_doc(WS, "board").state["order"]) == ["a", "b", "c", "d", "z"]
    client.close()

    client = workspace_client(oplog, WS, outbox=outbox)  # survives a restart
    assert client.pending() == []
    listed = client.parked()
    assert [(p["op_id"], p["sub_doc"], p["op"]["node"], p["base_clock"]) for p in listed] == [
        (queued[0]["op_id"], "board", "x", 1),
        (queued[1]["op_id"], "board", "w", 1),
    ]
    assert all(p["error"]["type"] == "ReplayTooOld" and p["error"]["horizon"] == 4
               for p in listed)  # fmt: skip
    assert client.seen_clock("board") == 5

    client.discard(queued[1]["op_id"])
    with pytest.raises(InvalidRequest):
        client.discard(queued[1]["op_id"])
    again = client.resubmit(queued[0]["op_id"])
    assert again is not None and again.op_id != queued[0]["op_id"]
    assert (again.clock, again.duplicate) == (6, False)
    assert client.parked() == [] and client.pending() == []
    assert sorted(oplog.get_sub_doc(WS, "board").state["order"]) == ["a", "b", "c", "d", "x", "z"]
    client.close()


def test_sdk_op_minted_on_a_stale_clock_and_never_sent_is_rebased_not_parked(
    oplog: OpLog, clean_db: Engine, tmp_path: Path
) -> None:
    client = workspace_client(oplog, WS, outbox=tmp_path / "o.sqlite")
    assert client.apply("cells", cell("a", 1)) is not None  # the client saw clock 1 ...
    for i in range(5):  # ... then stayed idle while others wrote and the sweeper pruned
        oplog.apply_op(WS, "cells", cell("b", i), new_op_id())
    assert prune_all(oplog, clean_db) == 6
    client.apply("cells", cell("c", 1), send=False)  # offline, based on clock 1

    late = client.apply("cells", cell("d", 1))  # sends c, then d: this process never sent them
    assert late is not None and (late.clock, late.duplicate) == (8, False)
    assert client.parked() == [] and client.pending() == []
    assert oplog.get_sub_doc(WS, "cells").state["cells"] == {"a": 1, "b": 4, "c": 1, "d": 1}
    assert client.seen_clock("cells") == 8


def test_sdk_over_http_parks_the_409_and_resubmits_with_the_reported_horizon(
    oplog: OpLog, clean_db: Engine, tmp_path: Path
) -> None:
    import httpx
    from fastapi.testclient import TestClient

    from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
    from onceflow.oplog.http import AsyncHttpTransport, HttpTransport
    from onceflow.tasks import Flow

    key = "of_test_retention_key_0123456789abcdef"
    app = create_app(
        Flow(settings=oplog.settings), auth=KeyAuth({hash_key(key): [WS]}), settings=oplog.settings
    )
    outbox = tmp_path / "outbox.sqlite"
    with TestClient(app) as http:
        if isinstance(oplog, Blocking):  # httpx.AsyncClient on the app, on the test's loop
            asgi = httpx.ASGITransport(app=app)
            async_http = httpx.AsyncClient(transport=asgi, base_url="http://testserver")
            over_http = AsyncHttpTransport("http://testserver", key, client=async_http)

            def sdk() -> Any:
                return oplog.beside(AsyncWorkspaceClient(over_http, WS, outbox=outbox))
        else:
            transport = HttpTransport("http://testserver", key, client=cast(httpx.Client, http))

            def sdk() -> Any:
                return WorkspaceClient(transport, WS, outbox=outbox)

        client = sdk()
        assert client.apply("cells", cell("a", 1)) is not None
        client.apply("cells", cell("x", 1), send=False)  # offline, based on clock 1
        client.close()
        for i in range(2):
            oplog.apply_op(WS, "cells", cell("b", i), new_op_id())
        assert prune_all(oplog, clean_db) == 3
        before = table_snapshot_ops(clean_db)

        client = sdk()
        with pytest.raises(ReplayTooOld) as refused:  # 409 replay_too_old, with the horizon
            client.replay()
        assert refused.value.horizon == 3
        assert table_snapshot_ops(clean_db) == before
        [parked] = client.parked()
        assert (parked["op"], parked["base_clock"], parked["error"]["horizon"]) == (
            cell("x", 1),
            1,
            3,
        )
        again = client.resubmit(parked["op_id"])  # based on the horizon the server reported
        assert again is not None and (again.clock, again.duplicate) == (4, False)
        assert client.parked() == [] and client.seen_clock("cells") == 4
        client.close()
        if isinstance(oplog, Blocking):
            oplog.beside(async_http).aclose()
            # The app served those requests on the test's loop, not on TestClient's: its
            # lifespan closes TestClient's loop's pools only. This loop's go now (left
            # open, their pool tasks were destroyed pending at interpreter exit).
            oplog.beside(app.state.onceflow).aclose()
