"""Enqueue on a real Postgres: idempotent at the primary key, batches, bad input."""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import Any

import pytest
from sqlalchemy import Engine, text

from onceflow import InputMismatch, InvalidRequest, NewRequest, PayloadTooLarge, Queue, Status
from onceflow.ids import request_id_for
from tests.acceptance.procs import wait_for
from tests.conftest import table_snapshot


def test_32_threads_same_request_one_row_one_creator(api_queue: Queue) -> None:
    barrier = threading.Barrier(32)
    results: list[Any] = []
    errors: list[BaseException] = []

    def enqueue() -> None:
        try:
            barrier.wait()
            results.append(api_queue.enqueue("evaluate", "w1", "j1", "main", {"cols": ["a"]}))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=enqueue) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 32
    assert sum(r.created for r in results) == 1
    assert {r.request_id for r in results} == {request_id_for("w1", "j1", "main", "evaluate")}
    assert not any(r.input_mismatch for r in results)
    assert len(api_queue.list(workspace_id="w1")) == 1


def test_duplicate_gets_existing_status(api_queue: Queue) -> None:
    first = api_queue.enqueue("evaluate", "w1", "j1", "main", {"x": 1})
    claim = api_queue.claim(first.request_id, "worker-a")
    assert claim is not None
    again = api_queue.enqueue("evaluate", "w1", "j1", "main", {"x": 1})
    assert (again.created, again.status, again.request_id) == (
        False,
        Status.RUNNING,
        first.request_id,
    )
    # A duplicate never rewrites a claimed row (Chancy #51): still running under the same claim.
    assert api_queue.get(first.request_id).claimed_by == "worker-a"
    api_queue.heartbeat(claim)


def test_input_mismatch_is_reported_not_merged(api_queue: Queue, clean_db: Engine) -> None:
    first = api_queue.enqueue("evaluate", "w1", "j1", "main", {"x": 1})
    other = api_queue.enqueue("evaluate", "w1", "j1", "main", {"x": 2})
    assert other.request_id == first.request_id
    assert (other.created, other.input_mismatch) == (False, True)
    assert api_queue.get(first.request_id).input == {"x": 1}
    before = table_snapshot(clean_db)
    with pytest.raises(InputMismatch):
        api_queue.enqueue("evaluate", "w1", "j1", "main", {"x": 2}, strict=True)
    assert table_snapshot(clean_db) == before


def test_strict_batch_with_a_mismatch_writes_nothing(api_queue: Queue, clean_db: Engine) -> None:
    api_queue.enqueue("evaluate", "w1", "j1", "main", {"x": 1})
    before = table_snapshot(clean_db)
    batch = [NewRequest("w1", f"new-{i}", "evaluate") for i in range(5)]
    batch.append(NewRequest("w1", "j1", "evaluate", "main", input={"x": 2}))
    with pytest.raises(InputMismatch):
        api_queue.enqueue_many(batch, strict=True)
    assert table_snapshot(clean_db) == before


def test_enqueue_many_one_round_trip_results_in_order(api_queue: Queue) -> None:
    api_queue.enqueue("s", "w", "j-3", "")
    items = [NewRequest("w", f"j-{i}", "s") for i in range(10)]
    items.append(NewRequest("w", "j-0", "s"))  # the same request twice in one batch
    results = api_queue.enqueue_many(items)
    assert [r.request_id for r in results[:10]] == [
        request_id_for("w", f"j-{i}", "", "s") for i in range(10)
    ]
    assert [r.created for r in results] == [i != 3 for i in range(10)] + [False]
    assert results[10].request_id == results[0].request_id
    assert sum(api_queue.counts()["default"].values()) == 10


def test_one_row_and_a_batch_write_the_same_row(api_queue: Queue, clean_db: Engine) -> None:
    """One request is sent as its values (ENQUEUE_ONE), a batch as one JSON array (ENQUEUE):
    every column they write, and what they answer, are the same."""
    fields: dict[str, Any] = {
        "branch_path": "b/1", "input": {"doc": [1, {"deep": "é\u2028"}], "n": 1.5},
        "worker_class": "wc-x", "priority": -7, "max_attempts": 9, "max_crash_attempts": 2,
        "run_after_seconds": 30.0,
    }  # fmt: skip
    one = api_queue.enqueue_many([NewRequest("w1", "alone", "s", **fields)])
    many = api_queue.enqueue_many([NewRequest("w1", f"pair-{i}", "s", **fields) for i in (0, 1)])
    again = api_queue.enqueue_many([NewRequest("w1", "alone", "s", **fields)])
    other = api_queue.enqueue("s", "w1", "alone", "b/1", {"doc": 2}, worker_class="wc-x")
    assert [(r.created, r.status, r.input_mismatch) for r in one + many] == [
        (True, Status.QUEUED, False)
    ] * 3
    assert (again[0].created, again[0].request_id) == (False, one[0].request_id)
    assert (other.created, other.input_mismatch) == (False, True)
    with clean_db.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT job_id, branch_path, stage, dedupe, input, input_hash, worker_class, "
            "priority, max_attempts, max_crash_attempts, status, "
            "round(extract(epoch FROM run_after - created_at)), "
            "dispatched_at = created_at, updated_at = created_at "
            "FROM workspace_process_requests ORDER BY job_id"
        ).fetchall()
    assert [r[0] for r in rows] == ["alone", "pair-0", "pair-1"]
    assert rows[0][1:] == rows[1][1:] == rows[2][1:], rows
    assert rows[0][11] == 30


def test_ids_with_json_escapes_are_stored_as_given(api_queue: Queue, clean_db: Engine) -> None:
    """A batch's rows travel as one JSON text written out by hand: quotes, backslashes and
    non-ASCII in every text column come back as given, under the ids request_id_for derives
    (the single-row path, which binds each value, writes the same)."""
    odd = ['q"uote', "back\\slash", "é 日本 🙂", 'a/b\\"c', "tab-less 'single'"]
    items = [
        NewRequest(w, f"{j}-{i}", s, b)
        for i, (w, j, s, b) in enumerate(
            zip(odd, odd[1:] + odd[:1], odd[2:] + odd[:2], odd[3:] + odd[:3], strict=True)
        )
    ]
    batch = api_queue.enqueue_many(items)
    alone = api_queue.enqueue(items[0].stage, items[0].workspace_id, "alone", items[0].branch_path)
    expected = [
        request_id_for(it.workspace_id, it.job_id, it.branch_path, it.stage) for it in items
    ]
    assert [r.request_id for r in batch] == expected
    assert all(r.created for r in [*batch, alone])
    with clean_db.connect() as conn:
        stored = conn.exec_driver_sql(
            "SELECT request_id, workspace_id, job_id, stage, branch_path "
            "FROM workspace_process_requests ORDER BY created_at, job_id"
        ).fetchall()
    by_id = {r[0]: tuple(r[1:]) for r in stored}
    for it, rid in zip(items, expected, strict=True):
        assert by_id[rid] == (it.workspace_id, it.job_id, it.stage, it.branch_path)
    assert by_id[alone.request_id] == (
        items[0].workspace_id,
        "alone",
        items[0].stage,
        items[0].branch_path,
    )


def test_a_bool_priority_is_refused_on_the_single_path_too(
    api_queue: Queue, clean_db: Engine
) -> None:
    """True is an int to Python; bound as a parameter Postgres would have cast it to 1."""
    before = table_snapshot(clean_db)
    with pytest.raises(InvalidRequest, match="priority"):
        api_queue.enqueue("evaluate", "w1", "j1", priority=True)  # type: ignore[arg-type]
    assert table_snapshot(clean_db) == before


class Urgency(IntEnum):
    LOW = -1
    HIGH = 7


def test_an_int_enum_priority_is_stored_as_its_value(api_queue: Queue, clean_db: Engine) -> None:
    """An int subclass is an int; only bool (and non-ints) are refused."""
    one = api_queue.enqueue("evaluate", "w1", "j-high", priority=Urgency.HIGH)
    many = api_queue.enqueue_many(
        [NewRequest("w1", f"j-low-{i}", "evaluate", priority=Urgency.LOW) for i in range(2)]
    )
    assert one.created and all(r.created for r in many)
    with clean_db.connect() as conn:
        stored = dict(
            conn.exec_driver_sql(
                "SELECT job_id, priority FROM workspace_process_requests"
            ).fetchall()
        )
    assert stored == {"j-high": 7, "j-low-0": -1, "j-low-1": -1}


def test_non_dedupe_stages_get_fresh_ids(api_queue: Queue) -> None:
    a = api_queue.enqueue("radar", "w", "j", "", dedupe=False)
    b = api_queue.enqueue("radar", "w", "j", "", dedupe=False)
    assert a.request_id != b.request_id
    assert a.created and b.created


BAD_ITEMS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"workspace_id": ""}, InvalidRequest),
    ({"job_id": ""}, InvalidRequest),
    ({"stage": ""}, InvalidRequest),
    ({"worker_class": ""}, InvalidRequest),
    ({"workspace_id": "w" * 201}, InvalidRequest),
    ({"job_id": "bad\x00id"}, InvalidRequest),
    ({"branch_path": "p" * 501}, InvalidRequest),
    ({"input": {"x": object()}}, InvalidRequest),
    ({"input": {"x": float("nan")}}, InvalidRequest),
    ({"input": {"x": "nul \x00 inside"}}, InvalidRequest),
    ({"input": {"x": "lone \ud800 surrogate"}}, InvalidRequest),
    ({"job_id": "lone-\udfff"}, InvalidRequest),
    ({"input": {"x": "y" * (256 * 1024)}}, PayloadTooLarge),
    ({"max_attempts": 0}, InvalidRequest),
    ({"priority": 10**9}, InvalidRequest),
    ({"priority": True}, InvalidRequest),
    ({"priority": 1.0}, InvalidRequest),
    ({"run_after_seconds": -1}, InvalidRequest),
    ({"request_id": ""}, InvalidRequest),
]


@pytest.mark.parametrize(("override", "error"), BAD_ITEMS)
def test_bad_input_clear_error_and_nothing_written(
    api_queue: Queue, clean_db: Engine, override: dict[str, Any], error: type[Exception]
) -> None:
    api_queue.enqueue("evaluate", "w1", "j-existing", "main")
    before = table_snapshot(clean_db)
    fields: dict[str, Any] = {"workspace_id": "w1", "job_id": "j1", "stage": "evaluate"}
    fields.update(override)
    good = NewRequest("w1", "j-good", "evaluate")
    with pytest.raises(error) as info:
        api_queue.enqueue_many([good, NewRequest(**fields)])
    assert str(info.value)  # a message a person can read
    assert table_snapshot(clean_db) == before


def test_unknown_status_filter_is_an_error(api_queue: Queue) -> None:
    with pytest.raises(InvalidRequest, match="unknown status"):
        api_queue.list(status="finished")


def test_a_caller_chosen_id_in_two_workspaces_is_two_requests_each_answered_by_its_own(
    api_queue: Queue, queue: Queue
) -> None:
    """Requests are keyed (workspace_id, request_id): an id a caller chose may name a row in
    each of two workspaces. Each enqueue is answered from its own row, never the other
    workspace's; a lookup by the id alone is ambiguous and matches nothing (not the other
    workspace's row); by its key, each is found. (Before: the batch answered both items from
    one row — one was reported not created, its wake-up never sent — and a write by the id
    alone could land on, or be refused by, the wrong workspace's row.)"""
    from onceflow import ClaimRef, LeaseLost, NotFound

    first = NewRequest(workspace_id="wsA", job_id="j", stage="s", request_id="chosen-1",
                       input={"a": 1})  # fmt: skip
    other = NewRequest(workspace_id="wsB", job_id="j", stage="s", request_id="chosen-1",
                       input={"b": 2})  # fmt: skip
    made = api_queue.enqueue_many([first, other])
    assert [(r.workspace_id, r.created, r.input_mismatch) for r in made] == [
        ("wsA", True, False),
        ("wsB", True, False),
    ]
    claim = api_queue.claim("chosen-1", "w", workspace_id="wsB")
    assert claim is not None and claim.request.input == {"b": 2}
    again = api_queue.enqueue_many([first, other])  # each answered by its own row's status
    assert [(r.workspace_id, r.created, r.status) for r in again] == [
        ("wsA", False, Status.QUEUED),
        ("wsB", False, Status.RUNNING),
    ]
    # By the id alone: ambiguous, so nothing — never the other workspace's row.
    with pytest.raises(NotFound):
        api_queue.get("chosen-1")
    assert api_queue.claim("chosen-1", "w") is None
    with pytest.raises(LeaseLost):
        api_queue.heartbeat(ClaimRef("chosen-1", claim.token))
    # By the key: each found, the live claim untouched by the refused write.
    assert api_queue.get("chosen-1", workspace_id="wsA").status is Status.QUEUED
    ref = ClaimRef("chosen-1", claim.token, workspace_id="wsB")
    assert api_queue.complete(ref, {"ok": 1}).status is Status.SUCCEEDED


@pytest.mark.parametrize("batch", [False, True], ids=["one_row", "batch"])
def test_an_enqueue_that_waited_for_a_concurrent_insert_reads_its_row(
    api_queue: Queue, clean_db: Engine, batch: bool
) -> None:
    """Another transaction inserted the row and commits while this enqueue waits on it (ON
    CONFLICT waits for the inserter): the row committed after the statement's snapshot, so
    the statement itself returns nothing for it and the enqueue reads it by its key (one
    row and a batch alike): a duplicate, not an error, nothing written twice."""
    other = NewRequest("w1", "j-race", "evaluate", "main", {"n": 1})
    mine = [other, NewRequest("w1", "j-race-2", "evaluate", "main", {"n": 2})]
    out: list[Any] = []

    def enqueue() -> None:
        try:
            if batch:
                out.append(api_queue.enqueue_many(mine))
            else:
                out.append([api_queue.enqueue("evaluate", "w1", "j-race", "main", {"n": 1})])
        except BaseException as exc:
            out.append(exc)

    def waiting_on_a_lock() -> bool:
        with clean_db.connect() as conn:
            n = conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() "
                "AND query LIKE '%workspace_process_requests%'"
            )).scalar()  # fmt: skip
        return bool(n)

    with clean_db.connect() as conn:
        tx = conn.begin()
        [first] = Queue(clean_db).enqueue_many([other], connection=conn)
        assert first.created
        thread = threading.Thread(target=enqueue)
        thread.start()
        wait_for(waiting_on_a_lock, what="the enqueue waiting for the uncommitted row")
        tx.commit()
    thread.join(timeout=30)
    assert not thread.is_alive()
    [results] = out
    assert not isinstance(results, BaseException), results
    assert (results[0].created, results[0].status, results[0].input_mismatch) == (
        False, Status.QUEUED, False,
    )  # fmt: skip
    assert results[0].request_id == request_id_for("w1", "j-race", "main", "evaluate")
    if batch:
        assert results[1].created
    assert len(api_queue.list(workspace_id="w1")) == (2 if batch else 1)
