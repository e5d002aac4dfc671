"""The request page's data route over HTTP (no browser): a real `onceflow api`, Postgres,
Redis and Celery worker. GET /dashboard/api/requests/{id} against the tables: a run to
success, a death, an operator's requeue and a fixed run, a worker killed mid-stage and its
rescue; payloads withheld from a key of other workspaces; roles; bad and unknown ids."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.demo.procs import wait_for
from onceflow.models import Dispatch
from onceflow.queue import Queue
from tests.browser.conftest import ADMIN_KEY, API_KEY, SCOPED_KEY, VIEWER_KEY, auth
from tests.browser.stages import FIXED, RELEASE
from tests.browser.test_dashboard_api import idle_rows, status_of
from tests.conftest import table_snapshot

pytestmark = pytest.mark.slow


@pytest.fixture()
def http(dashboard_api: tuple[str, Any]) -> Any:
    with httpx.Client(base_url=dashboard_api[0], timeout=10) as client:
        yield client


def detail(http: httpx.Client, rid: str, key: str = VIEWER_KEY, **params: str) -> dict[str, Any]:
    answer = http.get(f"/dashboard/api/requests/{rid}", headers=auth(key), params=params)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    found: dict[str, Any] = answer.json()
    return found


def row_of(engine: Engine, rid: str) -> dict[str, Any]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT * FROM workspace_process_requests WHERE request_id = :r"), {"r": rid}
        ).one()
    return dict(row._mapping)


def attempt_events(engine: Engine, rid: str) -> list[str]:
    """The request's history rows as the table holds them, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT event FROM workspace_request_attempts WHERE request_id = :r ORDER BY seq"),
            {"r": rid},
        ).scalars()
        return list(rows)


def iso(value: Any) -> Any:
    return None if value is None else value.isoformat()


def test_a_run_to_success_matches_its_row_ops_and_locks(
    http: httpx.Client, dash: Any, dashboard_worker: Any, engine: Engine
) -> None:
    rid = dash.flow.enqueue("cell", "dash-ws1", "jd1", "a", {"value": 7}).request_id
    wait_for(lambda: status_of(engine, rid) == "succeeded", what="the cell to run")
    row = row_of(engine, rid)
    page = detail(http, rid)
    request = page["request"]
    for name in ("status", "attempts", "crash_attempts", "claimed_by", "worker_class", "stage"):
        assert request[name] == row[name], name
    for name in ("created_at", "updated_at", "finished_at", "claimed_at"):
        assert request[name] == iso(row[name]), name
    assert page["withheld"] is False
    assert page["input"] == {"text": '{\n  "value": 7\n}', "truncated": False}
    assert '"value": 7' in page["result"]["text"] and page["error"] is None
    [attempt] = page["attempts"]
    assert attempt["claimed_by"] == row["claimed_by"] and attempt["outcome"] == "succeeded"
    assert attempt["ended_at"] == iso(row["finished_at"])
    assert attempt["locks"] == [{"cell": "cell", "outcome": "paid"}]  # the job's first call
    assert page["locks"] == [{"cell": "cell", "outcome": "paid", "attempt": 1}]
    assert [e["event"] for e in page["history"]] == ["enqueued", "claimed", "succeeded"]
    with engine.connect() as conn:
        ops = conn.execute(
            text("SELECT op_id, clock, committed_at FROM workspace_sub_doc_ops WHERE fence = :r"),
            {"r": rid},
        ).all()
    assert [(o["op_id"], o["clock"], o["committed_at"]) for o in page["ops"]] == [
        (op_id, clock, iso(at)) for op_id, clock, at in ops
    ]
    assert len(ops) == 1 and page["spend"] == []
    # A viewer may not act; an admin may not requeue a succeeded row (the dashboard does not).
    assert page["actions"]["requeue"] is False and page["actions"]["cancel"] is False

    # The same job's second branch finds the value stored: its lock outcome says so.
    other = dash.flow.enqueue("cell", "dash-ws1", "jd1", "b", {"value": 7}).request_id
    wait_for(lambda: status_of(engine, other) == "succeeded", what="the second cell")
    assert detail(http, other)["locks"] == [{"cell": "cell", "outcome": "stored", "attempt": 1}]


def test_a_death_an_operators_requeue_and_a_fixed_run(
    http: httpx.Client, dash: Any, dashboard_worker: Any, engine: Engine, redis_url: str
) -> None:
    rid = dash.flow.enqueue("flaky", "dash-ws1", "jd2", "", {}).request_id
    wait_for(lambda: status_of(engine, rid) == "dead", what="the request to die")
    page = detail(http, rid, ADMIN_KEY)
    assert page["actions"]["requeue"] is True and page["actions"]["cancel"] is False
    assert '"RuntimeError"' in page["error"]["text"]
    [died] = page["attempts"]
    assert (died["outcome"], died["next_status"], died["error_type"]) == (
        "failed", "dead", "RuntimeError",
    )  # fmt: skip
    assert detail(http, rid, VIEWER_KEY)["actions"]["requeue"] is False  # a viewer may not

    redis_lib.Redis.from_url(redis_url).set(FIXED + "jd2", 1)
    body = {"version": page["actions"]["requeue_version"]}
    moved = http.post(f"/dashboard/api/requests/{rid}/requeue", headers=auth(ADMIN_KEY), json=body)
    assert moved.status_code == 200, moved.text
    wait_for(lambda: status_of(engine, rid) == "succeeded", what="the fixed run")
    row = row_of(engine, rid)
    page = detail(http, rid, ADMIN_KEY)
    assert [(a["attempt"], a["outcome"]) for a in page["attempts"]] == [
        (1, "failed"), (1, "succeeded"),  # attempts start again after a requeue
    ]  # fmt: skip
    assert page["attempts"][-1]["claimed_at"] == iso(row["claimed_at"])
    events = [e["event"] for e in page["history"]]
    assert events == [
        "enqueued", "claimed", "failed", "dead", "requeued", "claimed", "succeeded",
    ]  # fmt: skip
    assert page["result"]["text"] == '{\n  "fixed": true\n}'
    assert page["error"] is None  # a requeue clears the row's error; the history keeps it


def test_a_worker_killed_mid_stage_is_rescued_and_its_attempt_shows_it(
    http: httpx.Client, dash: Any, dashboard_worker: Any, engine: Engine, redis_url: str
) -> None:
    queue = Queue(engine)
    rid = dash.flow.enqueue("hold", "dash-ws1", "jd3", "", {}).request_id
    wait_for(lambda: status_of(engine, rid) == "running", what="the hold stage to start")
    killed_holder = row_of(engine, rid)["claimed_by"]
    pid = int(killed_holder.rsplit(":", 1)[1])  # host:pid of the pool process running it
    os.kill(pid, signal.SIGKILL)
    lease_until = row_of(engine, rid)["lease_expires_at"]

    def lapsed() -> bool:
        with engine.connect() as conn:
            return bool(conn.execute(text("SELECT now() > :t"), {"t": lease_until}).scalar())

    wait_for(lapsed, what="the killed run's lease to lapse", timeout=30)
    # The killed message is redelivered at once (acks_late, reject_on_worker_lost): its
    # retry may take the lapsed lease over itself; else a sweeper (this one, or another's
    # run meanwhile) rescues the row. Both are correct: the page is checked for either.
    swept = queue.sweep_once()  # the sweeper's rescue statement, as beat would run it
    for wake in swept.to_dispatch:
        if wake.request_id == rid:
            dash.flow.dispatch(Dispatch(wake.request_id, wake.stage, wake.worker_class,
                                        wake.workspace_id))  # fmt: skip

    def claimed_again() -> bool:
        row = row_of(engine, rid)
        return row["status"] == "running" and row["claimed_by"] != killed_holder

    wait_for(claimed_again, what="another pool process to claim it")
    redis_lib.Redis.from_url(redis_url).rpush(RELEASE + "jd3", 1)
    wait_for(lambda: status_of(engine, rid) == "succeeded", what="the released run")

    row = row_of(engine, rid)
    page = detail(http, rid)
    assert page["request"]["crash_attempts"] == row["crash_attempts"] == 1
    assert page["request"]["attempts"] == row["attempts"] == 2
    first, second = page["attempts"]
    assert first["attempt"] == 1 and first["outcome"] in ("rescued", "taken_over")
    if first["outcome"] == "rescued":  # ended by a sweeper's statement: who held it, when
        assert first["claimed_by"] == killed_holder
        assert first["next_status"] == "queued" and first["ended_at"] is not None
        events = ["enqueued", "claimed", "rescued", "claimed", "succeeded"]
        assert attempt_events(engine, rid) == ["rescued", "succeeded"]
    else:  # taken over by the next claim: no statement of its own ended it
        assert (first["claimed_by"], first["ended_at"]) == (None, None)
        events = ["enqueued", "claimed", "succeeded"]
        assert attempt_events(engine, rid) == ["succeeded"]
        assert rid not in swept.rescued  # our sweep did not rescue what the page says it did not
    assert (second["attempt"], second["outcome"]) == (2, "succeeded")
    assert second["claimed_by"] == row["claimed_by"] != killed_holder
    assert [e["event"] for e in page["history"]] == events


def test_payloads_are_withheld_from_a_key_of_other_workspaces(
    http: httpx.Client, dash: Any, engine: Engine
) -> None:
    queue = Queue(engine)
    theirs = queue.enqueue("cell", "dash-ws2", "jw", input={"secret": "<b>x</b>"}).request_id
    ours = queue.enqueue("cell", "dash-own-1", "jw", input={"mine": 1}).request_id
    hidden = detail(http, theirs, SCOPED_KEY)
    assert hidden["withheld"] is True
    assert hidden["input"] is None and hidden["result"] is None and hidden["error"] is None
    assert hidden["request"]["workspace_id"] == "dash-ws2"
    assert hidden["actions"]["cancel"] is False  # an admin key, but not of this workspace
    # Nor may it act there: without the workspace (422) or with another's (403); unchanged.
    before = table_snapshot(engine)
    seen = {"version": hidden["request"]["updated_at"]}
    cancel = f"/dashboard/api/requests/{theirs}/cancel"
    answer = http.post(cancel, headers=auth(SCOPED_KEY), json=seen)
    assert answer.status_code == 422 and "workspace_id" in answer.json()["detail"], answer.text
    answer = http.post(cancel, headers=auth(SCOPED_KEY), json={**seen, "workspace_id": "dash-ws2"})
    assert answer.status_code == 403 and answer.json()["code"] == "forbidden", answer.text
    assert table_snapshot(engine) == before
    # An unscoped key reads it, as text (the page renders it as text).
    assert detail(http, theirs, VIEWER_KEY)["input"]["text"] == '{\n  "secret": "<b>x</b>"\n}'
    shown = detail(http, ours, SCOPED_KEY)
    assert shown["withheld"] is False and shown["input"]["text"] == '{\n  "mine": 1\n}'
    assert shown["actions"]["cancel"] is True  # an admin key, and the row is queued
    # A failed row: its attempts' and history's error text is withheld too.
    died = queue.enqueue("cell", "dash-ws2", "jw-failed").request_id
    claim = queue.claim(died, "worker-x", lease_seconds=30)
    assert claim is not None
    queue.fail(claim, {"type": "SecretError", "message": "token=hunter2"}, retryable=False)
    hidden = detail(http, died, SCOPED_KEY)
    assert hidden["withheld"] is True and hidden["request"]["status"] == "dead"
    [attempt] = hidden["attempts"]
    assert (attempt["outcome"], attempt["error_type"], attempt["error_message"]) == (
        "failed", None, None,
    )  # fmt: skip
    [failed] = [e for e in hidden["history"] if e["event"] == "failed"]
    assert failed["detail"]["error_type"] is None and failed["detail"]["error_message"] is None
    assert "hunter2" not in json.dumps(hidden) and "SecretError" not in json.dumps(hidden)
    [attempt] = detail(http, died, VIEWER_KEY)["attempts"]  # an unscoped key reads it
    assert (attempt["error_type"], attempt["error_message"]) == ("SecretError", "token=hunter2")
    assert shown["actions"]["cancel_version"] == shown["request"]["updated_at"]
    mine = {"version": shown["actions"]["cancel_version"], "workspace_id": "dash-own-1"}
    done = http.post(f"/dashboard/api/requests/{ours}/cancel", headers=auth(SCOPED_KEY), json=mine)
    assert done.status_code == 200 and done.json()["status"] == "cancelled", done.text


def test_roles_bad_and_unknown_ids(http: httpx.Client, dash: Any, engine: Engine) -> None:
    [rid] = idle_rows(engine, due=1, later=0)
    url = f"/dashboard/api/requests/{rid}"
    before = table_snapshot(engine)
    for headers in ({}, auth("wrong-key"), auth(API_KEY)):
        answer = http.get(url, headers=headers)
        assert answer.status_code == 401 and answer.json()["code"] == "unauthorized"
    assert http.get(url, headers=auth(VIEWER_KEY)).status_code == 200
    assert detail(http, rid, ADMIN_KEY)["actions"]["cancel"] is True
    assert detail(http, rid, VIEWER_KEY)["actions"]["cancel"] is False
    unknown = http.get("/dashboard/api/requests/no-such-id", headers=auth(VIEWER_KEY))
    assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
    assert "no-such-id" in unknown.json()["detail"]
    for bad in ("x" * 1000, "a%00b", "a%1Fb"):
        answer = http.get(f"/dashboard/api/requests/{bad}", headers=auth(VIEWER_KEY))
        assert answer.status_code == 422 and answer.json()["code"] == "invalid_request", bad
    # By the workspace shown: found; another workspace is as unknown; a bad one is refused.
    assert detail(http, rid, workspace_id="dash-idle")["request"]["request_id"] == rid
    other = http.get(url, headers=auth(VIEWER_KEY), params={"workspace_id": "dash-elsewhere"})
    assert other.status_code == 404
    bad_ws = http.get(url, headers=auth(VIEWER_KEY), params={"workspace_id": "a\x00b"})
    assert bad_ws.status_code == 422
    assert table_snapshot(engine) == before  # reads change nothing
