"""One request's page data (onceflow.queue.detail) on a real Postgres and Redis: its history
is written by the statements that end its claims, so it matches the row; its ops, spend and
compute-lock outcomes match their tables."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import Queue, Status
from onceflow.errors import InvalidRequest, NotFound
from onceflow.queue import Failure
from onceflow.queue.detail import TEXT_CAP_BYTES, as_text, read_request
from onceflow.spend import Grant, LedgerHooks, Usage
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.runtime import run_request
from tests.integration.test_claims import db_now


def attempt_rows(engine: Engine, request_id: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT * FROM workspace_request_attempts WHERE request_id = :r ORDER BY seq"),
            {"r": request_id},
        )
        return [dict(r._mapping) for r in rows]


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def test_a_failed_then_retried_request_has_each_attempt_as_the_row_had_it(
    queue: Queue, clean_db: Engine
) -> None:
    rid = queue.enqueue("s", "ws-a", "j1", input={"q": "hello"}).request_id
    t0 = db_now(clean_db)
    first = queue.claim(rid, "worker-1", lease_seconds=30, now=t0)
    assert first is not None
    failed = queue.fail(first, {"type": "Boom", "message": "x" * 2000}, retry_in=0, now=t0)
    assert failed.status is Status.QUEUED
    t1 = t0 + timedelta(seconds=1)
    second = queue.claim(rid, "worker-2", lease_seconds=45, now=t1)
    assert second is not None
    done = queue.complete(second, {"answer": 42}, now=t1 + timedelta(seconds=1))

    page = read_request(clean_db, rid)
    assert page["request"]["status"] == "succeeded"
    assert page["request"]["attempts"] == done.attempts == 2
    assert page["request"]["finished_at"] == iso(done.finished_at)
    assert page["withheld"] is False
    assert json.loads(page["input"]["text"]) == {"q": "hello"}
    assert json.loads(page["result"]["text"]) == {"answer": 42}
    assert json.loads(page["error"]["text"])["type"] == "Boom"  # the row keeps its last error
    a1, a2 = page["attempts"]
    assert (a1["attempt"], a1["claimed_by"], a1["lease_seconds"]) == (1, "worker-1", 30.0)
    assert (a1["outcome"], a1["next_status"], a1["error_type"]) == ("failed", "queued", "Boom")
    assert len(a1["error_message"]) == 500  # capped; the row's error is whole
    assert a1["claimed_at"] == iso(t0) and a1["ended_at"] == iso(t0)
    assert (a2["attempt"], a2["claimed_by"], a2["lease_seconds"]) == (2, "worker-2", 45.0)
    assert (a2["outcome"], a2["next_status"]) == ("succeeded", "succeeded")
    assert a2["claimed_at"] == iso(done.claimed_at) and a2["ended_at"] == iso(done.finished_at)
    events = [(e["event"], e["attempt"]) for e in page["history"]]
    assert events == [
        ("enqueued", None), ("claimed", 1), ("failed", 1), ("claimed", 2), ("succeeded", 2),
    ]  # fmt: skip
    assert page["history"][0]["at"] == iso(done.created_at)
    assert page["actions"] == {
        "requeue": False, "cancel": False, "requeue_version": None, "cancel_version": None,
        "cancel_run": None,
    }  # fmt: skip
    # The table itself: one row per ended claim, as the page shows them.
    assert [r["event"] for r in attempt_rows(clean_db, rid)] == ["failed", "succeeded"]


def test_a_lapsed_lease_rescued_by_the_sweeper_and_one_taken_over_by_a_claim(
    queue: Queue, clean_db: Engine
) -> None:
    rid = queue.enqueue("s", "ws-a", "j2", max_crash_attempts=5).request_id
    t0 = db_now(clean_db)
    assert queue.claim(rid, "crashed-1", lease_seconds=5, now=t0) is not None
    swept = queue.sweep_once(now=t0 + timedelta(seconds=6))
    assert swept.rescued == [rid]
    # The next claim's lease lapses too, and a claim takes it over directly (no sweep).
    t1 = t0 + timedelta(seconds=7)
    assert queue.claim(rid, "crashed-2", lease_seconds=5, now=t1) is not None
    t2 = t1 + timedelta(seconds=6)
    third = queue.claim(rid, "worker-3", lease_seconds=30, now=t2)
    assert third is not None

    page = read_request(clean_db, rid)
    row = queue.get(rid)
    assert row.status is Status.RUNNING and row.attempts == 3 and row.crash_attempts == 2
    got = [(a["attempt"], a["claimed_by"], a["outcome"]) for a in page["attempts"]]
    assert got == [(1, "crashed-1", "rescued"), (2, None, "taken_over"), (3, "worker-3", "running")]
    rescued = page["attempts"][0]
    assert rescued["next_status"] == "queued" and rescued["last_heartbeat_at"] == iso(t0)
    assert rescued["ended_at"] == iso(t0 + timedelta(seconds=6))
    assert page["request"]["run"] is not None and page["request"]["claimed_by"] == "worker-3"
    events = [e["event"] for e in page["history"]]
    assert events == ["enqueued", "claimed", "rescued", "claimed"]
    # Cancel, as the dashboard does, is offered for the running run to a key that may act.
    acting = read_request(clean_db, rid, may_act=True)["actions"]
    assert acting["cancel"] and acting["cancel_run"] == page["request"]["run"]
    assert not read_request(clean_db, rid, may_act=False)["actions"]["cancel"]


def test_operator_moves_and_a_dead_end_are_in_the_history(queue: Queue, clean_db: Engine) -> None:
    rid = queue.enqueue("s", "ws-a", "j3", max_attempts=1).request_id
    claim = queue.claim(rid, "w1")
    assert claim is not None
    dead = queue.fail(claim, RuntimeError("nope"))
    assert dead.status is Status.DEAD
    page = read_request(clean_db, rid, may_act=True)
    assert page["actions"]["requeue"] and page["actions"]["requeue_version"] == iso(dead.updated_at)
    requeued = queue.requeue(rid, expect=dead.updated_at)
    cancelled = queue.cancel(rid, expect=requeued.updated_at)
    assert cancelled.status is Status.CANCELLED

    page = read_request(clean_db, rid, may_act=True)
    events = [(e["event"], e["detail"].get("by")) for e in page["history"]]
    assert events == [
        ("enqueued", None), ("claimed", None), ("failed", None), ("dead", "run"),
        ("requeued", "operator"), ("cancelled", "operator"),
    ]  # fmt: skip
    assert [a["outcome"] for a in page["attempts"]] == ["failed"]  # no claim since the requeue
    assert page["attempts"][0]["error_type"] == "RuntimeError"
    assert page["actions"]["requeue"] and not page["actions"]["cancel"]


def test_hand_offs_ops_spend_and_lock_outcomes_match_their_tables(
    clean_db: Engine, redis_url: str
) -> None:
    flow = Flow(name="detail-test")

    class In(BaseModel):
        value: int = 0

    stored: dict[str, int] = {}

    @flow.stage("second", input=In, worker_class="wc-detail")
    def second(ctx: StageContext, data: In) -> dict[str, Any]:
        return {"second": data.value}

    @flow.stage("first", input=In, worker_class="wc-detail")
    def first(ctx: StageContext, data: In) -> dict[str, Any]:
        for _ in range(2):  # the first call computes (paid), the second finds it stored
            ctx.compute_once(
                "fit", check=lambda: stored.get("fit"), compute=lambda: data.value,
                store=lambda v: stored.__setitem__("fit", v),
            )  # fmt: skip
        ctx.apply_op("cells", {"type": "cell.set", "column": "a", "value": data.value})
        ctx.apply_op("cells", {"type": "cell.set", "column": "b", "value": data.value})
        hooks = LedgerHooks(clean_db)
        grant = Grant(workspace_id=ctx.workspace_id, provider="llm", estimate_tokens=10,
                      stage="first", request_id=ctx.request_id, cell_key="fit")  # fmt: skip
        hooks.admit(grant)
        hooks.settle(grant, Usage(7, 3), "ok", "llm", "m-1", None, None, None)
        ctx.then("second", {"value": data.value + 1})
        return {"first": data.value}

    parent = flow.enqueue("first", "ws-h", "job-h", "main", {"value": 5})
    spec = flow.spec("first")
    outcome = run_request(flow.queue, spec, parent.request_id, "host:1", lambda _: True)
    assert outcome["outcome"] == "succeeded", outcome
    [child] = flow.queue.list(stage="second")

    page = read_request(clean_db, parent.request_id)
    assert page["hand_offs"] == {"from": [], "to": [child.request_id]}
    [attempt] = page["attempts"]
    assert attempt["outcome"] == "handed_off" and attempt["claimed_by"] == "host:1"
    assert attempt["locks"] == [
        {"cell": "fit", "outcome": "paid"}, {"cell": "fit", "outcome": "stored"},
    ]  # fmt: skip
    assert page["locks"] == [{**lock, "attempt": 1} for lock in attempt["locks"]]
    assert [e["event"] for e in page["history"]] == ["enqueued", "claimed", "handed_off"]
    assert page["history"][-1]["detail"]["to"] == [child.request_id]
    with clean_db.connect() as conn:
        ops = conn.execute(text(
            "SELECT sub_doc, op_id, op_type, clock FROM workspace_sub_doc_ops "
            "WHERE fence = :r ORDER BY clock"), {"r": parent.request_id}).all()  # fmt: skip
        ledger = conn.execute(text(
            "SELECT provider, model, cell_key, outcome, input_tokens, output_tokens "
            "FROM spend_ledger WHERE request_id = :r"), {"r": parent.request_id}).all()  # fmt: skip
    assert len(ops) == 2
    assert [(o["sub_doc"], o["op_id"], o["op_type"], o["clock"]) for o in page["ops"]] == [
        tuple(o) for o in ops
    ]
    assert not any(o["rejected"] for o in page["ops"]) and page["ops_truncated"] is False
    assert len(ledger) == 1
    [line] = page["spend"]
    got = tuple(line[k] for k in ("provider", "model", "cell_key", "outcome", "input_tokens",
                                  "output_tokens"))  # fmt: skip
    assert got == tuple(ledger[0])

    # The follow-up names its parent; it wrote nothing itself.
    child_page = read_request(clean_db, child.request_id)
    assert child_page["hand_offs"] == {"from": [parent.request_id], "to": []}
    assert child_page["ops"] == [] and child_page["spend"] == []
    assert json.loads(child_page["input"]["text"]) == {"value": 6}
    json.dumps(page)  # JSON-able as is


def test_payloads_are_withheld_from_a_reader_of_other_workspaces_and_capped(
    queue: Queue, clean_db: Engine
) -> None:
    big = {"text": "é" * (TEXT_CAP_BYTES)}  # 2 bytes each: past the cap
    rid = queue.enqueue("s", "ws-secret", "j", input=big).request_id
    hidden = read_request(clean_db, rid, readable=lambda ws: ws != "ws-secret")
    assert hidden["withheld"] is True
    assert hidden["input"] is None and hidden["result"] is None and hidden["error"] is None
    assert hidden["request"]["workspace_id"] == "ws-secret"  # the row itself is shown
    shown = read_request(clean_db, rid, workspace_id="ws-secret")
    assert shown["input"]["truncated"] is True
    assert len(shown["input"]["text"].encode()) <= TEXT_CAP_BYTES
    assert shown["input"]["text"].startswith('{\n  "text": "éé')
    assert as_text("<b>x</b>") == {"text": '"<b>x</b>"', "truncated": False}  # text, as stored
    assert as_text(None) is None


def test_a_failed_requests_error_text_is_withheld_in_its_attempts_and_history(
    queue: Queue, clean_db: Engine
) -> None:
    rid = queue.enqueue("s", "ws-secret", "j").request_id
    t0 = db_now(clean_db)
    first = queue.claim(rid, "worker-1", lease_seconds=30, now=t0)
    assert first is not None
    queue.fail(first, {"type": "SecretError", "message": "token=hunter2"}, retry_in=0, now=t0)
    second = queue.claim(rid, "worker-2", lease_seconds=30, now=t0 + timedelta(seconds=1))
    assert second is not None
    dead = queue.fail(second, {"type": "SecretError", "message": "token=hunter2"}, retryable=False)
    assert dead.status is Status.DEAD

    hidden = read_request(clean_db, rid, readable=lambda ws: ws != "ws-secret")
    assert hidden["withheld"] is True and hidden["error"] is None
    assert [(a["outcome"], a["error_type"], a["error_message"]) for a in hidden["attempts"]] == [
        ("failed", None, None), ("failed", None, None),
    ]  # fmt: skip
    failed = [e for e in hidden["history"] if e["event"] == "failed"]
    assert len(failed) == 2
    assert all(e["detail"]["error_type"] is None for e in failed)
    assert all(e["detail"]["error_message"] is None for e in failed)
    assert "hunter2" not in json.dumps(hidden) and "SecretError" not in json.dumps(hidden)
    # A reader of the workspace sees the same events with their errors.
    shown = read_request(clean_db, rid)
    assert [a["error_type"] for a in shown["attempts"]] == ["SecretError", "SecretError"]
    assert [e["detail"]["error_message"] for e in shown["history"] if e["event"] == "failed"] == [
        "token=hunter2", "token=hunter2",
    ]  # fmt: skip


def test_unknown_ids_another_workspace_and_ambiguous_ids(queue: Queue, clean_db: Engine) -> None:
    with pytest.raises(NotFound):
        read_request(clean_db, "no-such-request")
    rid = queue.enqueue("s", "ws-1", "j").request_id
    with pytest.raises(NotFound):
        read_request(clean_db, rid, workspace_id="ws-2")
    queue.enqueue("s", "ws-x", "j", request_id="shared-id")
    queue.enqueue("s", "ws-y", "j", request_id="shared-id")
    with pytest.raises(InvalidRequest, match="several workspaces"):
        read_request(clean_db, "shared-id")
    assert read_request(clean_db, "shared-id", workspace_id="ws-y")["request"]["workspace_id"] == (
        "ws-y"
    )


def test_retention_deletes_a_requests_history_with_it(queue: Queue, clean_db: Engine) -> None:
    kept = queue.enqueue("s", "ws-r", "j-kept").request_id
    gone = queue.enqueue("s", "ws-r", "j-gone").request_id
    for rid in (kept, gone):
        claim = queue.claim(rid, "w")
        assert claim is not None
        queue.complete(claim, {"ok": True})
    with clean_db.begin() as conn:  # the kept row finished just now, the other long ago
        conn.execute(
            text("UPDATE workspace_process_requests SET finished_at = now() - interval '2 days' "
                 "WHERE request_id = :r"), {"r": gone})  # fmt: skip
    assert queue.prune(retention_seconds=86400, payload_retention_seconds=None) == 1
    assert attempt_rows(clean_db, gone) == []
    assert [r["event"] for r in attempt_rows(clean_db, kept)] == ["succeeded"]


def test_batched_ends_keep_each_runs_lock_outcomes(queue: Queue, clean_db: Engine) -> None:
    """The worker's batch statements write each run's compute-lock outcomes to its history
    row, as the single ones do: a run that used compute_once stays in the batch."""
    paid = [{"cell": "score:fit", "outcome": "paid"}, {"cell": "score:pay", "outcome": "waited"}]
    rids = [queue.enqueue("s", "ws-b", f"j{i}", input={"i": i}).request_id for i in range(4)]
    claims = [queue.claim(r, "worker-b", lease_seconds=30) for r in rids]
    assert all(claims)
    c0, c1, c2, c3 = claims
    assert c0 and c1 and c2 and c3
    queue.complete_many([(c0, {"ok": 0}, paid), (c1, {"ok": 1})])
    queue.fail_many([Failure(c2, {"type": "Boom", "message": "b"}, locks=paid[:1]),
                     Failure(c3, {"type": "Boom", "message": "b"})])  # fmt: skip
    locks = {r: [h["locks"] for h in attempt_rows(clean_db, r)] for r in rids}
    assert locks == {rids[0]: [paid], rids[1]: [None], rids[2]: [paid[:1]], rids[3]: [None]}
    page = read_request(clean_db, rids[0])
    assert page["attempts"][0]["locks"] == paid
    with pytest.raises(InvalidRequest):
        queue.complete_many([(c0, {"ok": 0}, paid, "extra")])  # type: ignore[list-item]


def test_a_long_history_keeps_its_newest_rows_and_invents_no_claims(
    queue: Queue, clean_db: Engine
) -> None:
    """Past HISTORY_LIMIT rows the oldest are cut: the outcome is kept, and an attempt missing
    only because it was cut is not shown as taken over."""
    from onceflow.queue.detail import HISTORY_LIMIT

    rid = queue.enqueue("s", "ws-a", "j-long").request_id
    t0 = db_now(clean_db)
    first = queue.claim(rid, "worker-1", lease_seconds=30, now=t0)
    assert first is not None
    queue.fail(first, {"type": "Boom", "message": "1"}, retry_in=0, now=t0)
    with clean_db.begin() as conn:  # operator moves between the claims, many of them
        conn.execute(
            text(
                "INSERT INTO workspace_request_attempts (workspace_id, request_id, event, "
                "next_status, ended_at) SELECT 'ws-a', :r, 'cancel_requested', 'queued', "
                "CAST(:t AS timestamptz) + i * interval '1 ms' FROM generate_series(1, :n) i"
            ),
            {"r": rid, "t": t0, "n": HISTORY_LIMIT},
        )
    t1 = t0 + timedelta(seconds=2)
    second = queue.claim(rid, "worker-2", lease_seconds=30, now=t1)
    assert second is not None
    queue.fail(second, {"type": "Boom", "message": "2"}, retry_in=0, now=t1)
    third = queue.claim(rid, "worker-3", lease_seconds=30, now=t1 + timedelta(seconds=1))
    assert third is not None
    queue.complete(third, {"ok": True}, now=t1 + timedelta(seconds=2))

    page = read_request(clean_db, rid)
    assert page["history_truncated"] is True
    got = [(a["attempt"], a["claimed_by"], a["outcome"]) for a in page["attempts"]]
    assert got == [(2, "worker-2", "failed"), (3, "worker-3", "succeeded")]
    events = page["history"]
    assert events[0]["event"] == "enqueued"
    assert [e["event"] for e in events[-4:]] == ["claimed", "failed", "claimed", "succeeded"]
    assert len([e for e in events if e["event"] == "cancel_requested"]) == HISTORY_LIMIT - 2
