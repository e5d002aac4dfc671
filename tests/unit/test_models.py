"""Request's fast builders (from_row, after_run) against the dataclass's own constructor."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from onceflow.models.requests import Request
from onceflow.models.status import Status

T0 = datetime(2026, 12, 5, 1, 0, tzinfo=UTC)


def _row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": "r" * 64, "workspace_id": "w", "job_id": "j", "branch_path": "b",
        "stage": "s", "dedupe": True, "input": {"doc": [1, 2]}, "input_hash": "h",
        "worker_class": "wc", "status": "running", "claimed_by": "worker-1",
        "lease_expires_at": T0 + timedelta(seconds=30), "heartbeat_at": T0, "claimed_at": T0,
        "attempts": 1, "crash_attempts": 0, "max_attempts": 5, "max_crash_attempts": 3,
        "run_after": T0, "priority": 2, "cancel_requested": False, "dispatched_at": T0,
        "result": None, "error": None, "created_at": T0, "updated_at": T0, "finished_at": None,
        "claim_token": "secret", "took_over": False,
    }  # fmt: skip
    row.update(changes)
    return row


def _by_constructor(row: dict[str, Any]) -> Request:
    values = {f.name: row[f.name] for f in dataclasses.fields(Request)}
    values["status"] = Status(values["status"])
    return Request(**values)


def test_the_builders_fill_every_field_through_its_slot() -> None:
    """They skip __init__: safe only while it does nothing but set the fields."""
    assert not hasattr(Request, "__post_init__")
    assert all(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(Request)
    )
    row = _row()
    built = Request.from_row(row)
    assert built == _by_constructor(row)
    assert type(built.status) is Status
    assert not hasattr(built, "claim_token")
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.stage = "other"  # type: ignore[misc]


def test_after_run_takes_the_run_columns_and_keeps_the_rest() -> None:
    claimed = Request.from_row(_row())
    ran = {"workspace_id": "w", "status": "succeeded", "result": {"ok": True},
           "finished_at": T0 + timedelta(seconds=2), "lease_expires_at": None,
           "updated_at": T0 + timedelta(seconds=2)}  # fmt: skip
    after = claimed.after_run(ran)
    assert after == dataclasses.replace(
        claimed, status=Status.SUCCEEDED, result={"ok": True}, finished_at=ran["finished_at"],
        lease_expires_at=None, updated_at=ran["updated_at"],
    )  # fmt: skip
    assert claimed.status is Status.RUNNING  # the claim's own request is unchanged


def test_an_unknown_status_is_a_value_error_as_before() -> None:
    with pytest.raises(ValueError, match="not a valid Status"):
        Request.from_row(_row(status="exploded"))
    with pytest.raises(ValueError, match="not a valid Status"):
        Request.from_row(_row()).after_run({"status": "exploded"})
    assert Request.from_row(_row(status=Status.QUEUED)).status is Status.QUEUED


def test_a_row_without_a_field_is_an_error() -> None:
    row = _row()
    del row["attempts"]
    with pytest.raises(KeyError):
        Request.from_row(row)
