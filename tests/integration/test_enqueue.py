"""Enqueue on a real Postgres: idempotent at the primary key, batches, bad input."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Engine

from onceflow import InputMismatch, InvalidRequest, NewRequest, PayloadTooLarge, Queue, Status
from onceflow.ids import request_id_for
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
