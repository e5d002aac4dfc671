"""The dashboard's data routes over HTTP (no browser): a real `onceflow api`, Postgres, Redis
and Celery worker. Roles, the snapshot against the table, fenced requeue, bad ids."""

from __future__ import annotations

import json
from contextlib import ExitStack
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.demo.procs import wait_for
from onceflow.keys import counters_key, queue_name
from onceflow.locks.counters import calls_saved, parse_hash
from onceflow.models import NewRequest
from onceflow.queue import Queue
from tests.browser.conftest import ADMIN_KEY, API_KEY, SCOPED_KEY, VIEWER_KEY, WC, auth
from tests.conftest import table_snapshot

pytestmark = pytest.mark.slow

OPS_LAST_MINUTE = (
    "SELECT count(*) FROM workspace_sub_doc_ops WHERE committed_at > now() - interval '60 s'"
)
IDLE = "t-dash-idle"  # a worker class nobody serves: its rows stay queued / scheduled


def expected_depth(engine: Engine) -> dict[str, dict[str, dict[str, int]]]:
    """Depth counted straight from the table (a full scan: fine in a test)."""
    query = text("""
        SELECT worker_class, stage,
               CASE WHEN status = 'queued' AND run_after > now() THEN 'scheduled'
                    ELSE status END AS s, count(*) AS n
        FROM workspace_process_requests
        WHERE status IN ('queued', 'running', 'dead')
        GROUP BY 1, 2, 3""")
    out: dict[str, dict[str, dict[str, int]]] = {}
    with engine.connect() as conn:
        for wc, stage, status, n in conn.execute(query):
            cell = out.setdefault(wc, {}).setdefault(
                stage, {"queued": 0, "scheduled": 0, "running": 0, "dead": 0}
            )
            cell[status] = int(n)
    return out


def idle_rows(engine: Engine, due: int, later: int) -> list[str]:
    """Requests of a class nobody serves: ``due`` due now and ``later`` scheduled in an hour."""
    queue = Queue(engine)
    items = [NewRequest("dash-idle", f"d{i}", "cell", worker_class=IDLE) for i in range(due)]
    items += [
        NewRequest("dash-idle", f"l{i}", "cell", worker_class=IDLE, run_after_seconds=3600)
        for i in range(later)
    ]
    return [r.request_id for r in queue.enqueue_many(items)]


def drained(engine: Engine) -> bool:
    query = text(
        "SELECT count(*) FROM workspace_process_requests "
        "WHERE worker_class = :wc AND status IN ('queued', 'running')"
    )
    with engine.connect() as conn:
        return conn.execute(query, {"wc": WC}).scalar_one() == 0


def status_of(engine: Engine, request_id: str) -> str:
    query = text("SELECT status FROM workspace_process_requests WHERE request_id = :r")
    with engine.connect() as conn:
        return str(conn.execute(query, {"r": request_id}).scalar_one())


@pytest.fixture()
def http(dashboard_api: tuple[str, Any]) -> Any:
    with httpx.Client(base_url=dashboard_api[0], timeout=10) as client:
        yield client


def test_roles_no_key_and_other_keys_are_refused(http: httpx.Client, dash: Any) -> None:
    page = http.get("/dashboard")  # the shell: no data, no key needed
    assert page.status_code == 200 and "Operator key" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert http.get("/dashboard/dashboard.js").status_code == 200
    # No Swagger UI or ReDoc page (their scripts come from a CDN) on the dashboard's origin;
    # the schema they would show stays.
    assert http.get("/docs").status_code == http.get("/redoc").status_code == 404
    assert "/v1/workspaces/{ws}/requests" in http.get("/openapi.json").json()["paths"]
    for method, path in [
        ("GET", "/dashboard/api/snapshot"),
        ("GET", "/dashboard/api/stream"),
        ("POST", "/dashboard/api/requests/r1/requeue"),
        ("POST", "/dashboard/api/requests/r1/cancel"),
    ]:
        for headers in ({}, auth("wrong-key"), auth(API_KEY)):  # an API key is no operator key
            answer = http.request(method, path, headers=headers, json={})
            assert answer.status_code == 401, (method, path, answer.text)
            assert answer.json()["code"] == "unauthorized"
    assert http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).status_code == 200
    assert http.get("/dashboard/api/snapshot", headers=auth(ADMIN_KEY)).status_code == 200
    for action in ("requeue", "cancel"):
        refused = http.post(
            f"/dashboard/api/requests/r1/{action}", headers=auth(VIEWER_KEY), json={}
        )
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
    # The stream: a viewer key reads Server-Sent Events, the first one a snapshot.
    with http.stream("GET", "/dashboard/api/stream", headers=auth(VIEWER_KEY)) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("event:")) == "event: snapshot"
        assert next(lines).startswith('data: {"db_now"')


def test_snapshot_equals_the_table_after_a_drain(
    http: httpx.Client, dash: Any, dashboard_worker: Any, engine: Engine, redis_url: str
) -> None:
    idle_rows(engine, due=3, later=2)
    flow = dash.flow
    for branch in ("a", "b", "c"):  # one job, three rows: one call made, two saved
        flow.enqueue("cell", "dash-ws1", "j1", branch, {"value": 5})
    flow.enqueue("cell", "dash-ws2", "j2", "", {"value": 6})
    dead_id = flow.enqueue("flaky", "dash-ws1", "jf", "", {}).request_id
    wait_for(lambda: drained(engine), what="the worker to drain t-dash")
    assert status_of(engine, dead_id) == "dead"

    snap = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    assert snap["depth"] == expected_depth(engine)
    assert snap["depth"][IDLE]["cell"] == {"queued": 3, "scheduled": 2, "running": 0, "dead": 0}
    assert snap["depth"][WC]["flaky"]["dead"] == 1
    oldest = snap["oldest_queued_age_seconds"]
    assert oldest[IDLE] >= 0 and WC not in oldest
    assert snap["running"] == []
    [dead] = snap["dead"]
    assert dead["request_id"] == dead_id and dead["attempts"] == 1
    assert dead["error"].startswith("RuntimeError: not fixed yet")
    with engine.connect() as conn:
        ops = conn.execute(text(OPS_LAST_MINUTE)).scalar_one()
    assert snap["ops"]["last_minute"] == ops == 4
    # Savings per workspace, as Redis holds them, and as the provider would see them.
    client = redis_lib.Redis.from_url(redis_url)
    savings = {w["workspace_id"]: w for w in snap["savings"]["workspaces"]}
    assert set(savings) == {"dash-ws1", "dash-ws2"}
    for ws, made, asked in (("dash-ws1", 1, 3), ("dash-ws2", 1, 1)):
        stored = parse_hash(client.hgetall(counters_key(ws)))
        assert savings[ws]["made"] == stored["computes"] == made
        assert savings[ws]["saved"] == calls_saved(stored) == asked - made
        assert savings[ws]["asked"] == asked


def test_requeue_is_fenced_and_cancel_refuses_finished_rows(
    http: httpx.Client, dash: Any, dashboard_worker: Any, engine: Engine, redis_url: str
) -> None:
    dead_id = dash.flow.enqueue("flaky", "dash-ws1", "jr", "", {}).request_id
    wait_for(lambda: status_of(engine, dead_id) == "dead", what="the request to die")
    [shown] = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()["dead"]
    url = f"/dashboard/api/requests/{dead_id}/requeue"

    # The row changed since it was shown (another operator requeued it, it died again).
    before = table_snapshot(engine)
    stale = (datetime.fromisoformat(shown["version"]) - timedelta(seconds=1)).isoformat()
    refused = http.post(url, headers=auth(ADMIN_KEY), json={"version": stale})
    assert refused.status_code == 409 and refused.json()["code"] == "changed", refused.text
    assert table_snapshot(engine) == before
    # A viewer may not; a missing or malformed version is a 422; nothing moves.
    assert http.post(url, headers=auth(VIEWER_KEY), json=shown).status_code == 403
    for body in ({}, {"version": "yesterday"}, {"version": "2026-01-01T00:00:00"},
                 {"version": shown["version"], "extra": 1}):  # fmt: skip
        assert http.post(url, headers=auth(ADMIN_KEY), json=body).status_code == 422, body
    assert table_snapshot(engine) == before

    moved = http.post(url, headers=auth(ADMIN_KEY), json={"version": shown["version"]})
    assert moved.status_code == 200 and moved.json()["status"] == "queued", moved.text
    # The wake-up was sent: the worker runs it, and it dies again (not fixed yet).
    wait_for(lambda: status_of(engine, dead_id) == "dead" and drained(engine), what="re-death")
    before = table_snapshot(engine)
    again = http.post(url, headers=auth(ADMIN_KEY), json={"version": shown["version"]})
    assert again.status_code == 409  # the version shown before the first requeue: refused
    assert table_snapshot(engine) == before

    # Cancel: a queued row is cancelled (fenced on its version); a finished one is 409.
    [idle_id] = idle_rows(engine, due=1, later=0)
    cancel = f"/dashboard/api/requests/{idle_id}/cancel"
    seen = {"version": Queue(engine).get(idle_id).updated_at.isoformat()}
    assert http.post(cancel, headers=auth(ADMIN_KEY), json=seen).json()["status"] == "cancelled"
    before = table_snapshot(engine)
    assert http.post(cancel, headers=auth(ADMIN_KEY), json=seen).status_code == 409
    assert table_snapshot(engine) == before


def test_cancel_is_fenced_on_the_run(http: httpx.Client, dash: Any, engine: Engine) -> None:
    """A page showing run 1 of a request cannot cancel run 2 (same holder name, even)."""
    queue = Queue(engine)
    [rid] = idle_rows(engine, due=1, later=0)  # a class no worker serves: this test claims
    first = queue.claim(rid, "holder-a", lease_seconds=0.2)
    assert first is not None
    snap = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    [shown] = [r for r in snap["running"] if r["request_id"] == rid]
    assert shown["holder"] == "holder-a"

    def lapsed() -> bool:
        with engine.connect() as conn:
            query = text("SELECT now() > :t")
            return bool(conn.execute(query, {"t": first.lease_expires_at}).scalar())

    wait_for(lapsed, what="run 1's lease to lapse on the database clock")
    second = queue.claim(rid, "holder-a", lease_seconds=60)  # run 2, same holder
    assert second is not None and second.token != first.token
    url = f"/dashboard/api/requests/{rid}/cancel"
    before = table_snapshot(engine)
    # What a stale page sends: run 1's version, or run 1's identity.
    for field in ("version", "run"):
        stale = {field: shown[field]}
        refused = http.post(url, headers=auth(ADMIN_KEY), json=stale)
        assert refused.status_code == 409 and refused.json()["code"] == "changed", refused.text
        assert table_snapshot(engine) == before  # run 2 goes on, not asked to stop
    assert http.post(url, headers=auth(ADMIN_KEY), json={}).status_code == 422  # says what
    assert http.post(url, headers=auth(VIEWER_KEY), json=stale).status_code == 403
    assert table_snapshot(engine) == before

    queue.heartbeat(second)  # a heartbeat moves updated_at, not the run
    snap = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    [now_shown] = [r for r in snap["running"] if r["request_id"] == rid]
    assert now_shown["run"] != shown["run"]
    queue.heartbeat(second)  # and another after the page showed it: the run still matches
    done = http.post(url, headers=auth(ADMIN_KEY), json={"run": now_shown["run"]})
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "running" and done.json()["cancel_requested"] is True
    assert queue.heartbeat(second).cancel_requested  # run 2 learns it at its next heartbeat


def test_one_key_gets_at_most_eight_streams(http: httpx.Client, dash: Any) -> None:
    with ExitStack() as open_streams:
        for _ in range(8):
            stream = open_streams.enter_context(
                http.stream("GET", "/dashboard/api/stream", headers=auth(VIEWER_KEY))
            )
            assert stream.status_code == 200
        with http.stream("GET", "/dashboard/api/stream", headers=auth(VIEWER_KEY)) as ninth:
            assert ninth.status_code == 429
            ninth.read()
        assert ninth.json()["code"] == "rate_limited" and ninth.headers["RateLimit-Limit"] == "8"
        # Another key is still served (the process's own bound is far off).
        with http.stream("GET", "/dashboard/api/stream", headers=auth(ADMIN_KEY)) as other:
            assert other.status_code == 200
            assert next(ln for ln in other.iter_lines() if ln.startswith("event:")) == (
                "event: snapshot"
            )


def test_a_repeated_cancel_of_a_running_row_changes_and_counts_nothing(
    http: httpx.Client, dash: Any, engine: Engine
) -> None:
    from prometheus_client import REGISTRY

    def cancelled() -> float:
        labels = {"worker_class": "wc-dash-stop"}
        return REGISTRY.get_sample_value("onceflow_requests_cancelled_total", labels) or 0.0

    queue = Queue(engine)
    rid = queue.enqueue("s", "dash-ws1", "j-stop", worker_class="wc-dash-stop").request_id
    assert queue.claim(rid, "a", lease_seconds=300) is not None
    snap = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    [shown] = [r for r in snap["running"] if r["request_id"] == rid]
    run = {"run": shown["run"]}
    cancel = f"/dashboard/api/requests/{rid}/cancel"
    first = http.post(cancel, headers=auth(ADMIN_KEY), json=run)
    assert first.status_code == 200 and first.json()["cancel_requested"] is True, first.text
    before, counted = table_snapshot(engine), cancelled()
    again = http.post(cancel, headers=auth(ADMIN_KEY), json=run)
    # Idempotent: the stop asked for already is what the operator wants; nothing moves.
    assert again.status_code == 200 and again.json()["already_requested"] is True, again.text
    assert again.json()["version"] == first.json()["version"]
    assert table_snapshot(engine) == before
    assert queue.cancel(rid).updated_at == queue.get(rid).updated_at
    assert table_snapshot(engine) == before and cancelled() == counted


def test_bad_and_unknown_ids(http: httpx.Client, dash: Any, engine: Engine) -> None:
    version = {"version": "2026-01-01T00:00:00+00:00"}
    before = table_snapshot(engine)
    for action in ("requeue", "cancel"):
        for bad in ("x" * 1000, "a%00b", "a%1Fb"):
            answer = http.post(
                f"/dashboard/api/requests/{bad}/{action}", headers=auth(ADMIN_KEY), json=version
            )
            assert answer.status_code == 422, (bad, answer.text)
            assert answer.json()["code"] == "invalid_request"
        unknown = http.post(
            f"/dashboard/api/requests/no-such-id/{action}", headers=auth(ADMIN_KEY), json=version
        )
        assert unknown.status_code == 404 and unknown.json()["code"] == "not_found"
    assert table_snapshot(engine) == before


def test_actions_find_the_row_by_the_workspace_shown(
    http: httpx.Client, dash: Any, engine: Engine, redis_url: str
) -> None:
    """The page sends the row's workspace: the request is found by its key. Another
    workspace is 404 (as an unknown id) and changes nothing; no workspace still works."""
    queue = Queue(engine)
    [rid] = idle_rows(engine, due=1, later=0)
    other = {"workspace_id": "dash-elsewhere"}
    cancel, requeue = (f"/dashboard/api/requests/{rid}/{a}" for a in ("cancel", "requeue"))
    snap = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    assert snap["running"] == [] and snap["dead"] == []  # queued: not shown, as in the page

    seen = {"version": queue.get(rid).updated_at.isoformat()}
    before = table_snapshot(engine)
    for ws, status in (("dash-elsewhere", 404), ("a\x00b", 422), ("", 422), (7, 422)):
        answer = http.post(cancel, headers=auth(ADMIN_KEY), json={**seen, "workspace_id": ws})
        assert answer.status_code == status, (ws, answer.text)
    assert table_snapshot(engine) == before
    done = http.post(cancel, headers=auth(ADMIN_KEY), json={**seen, "workspace_id": "dash-idle"})
    assert done.status_code == 200 and done.json()["status"] == "cancelled", done.text

    # Requeue the cancelled row: by another workspace 404, by its own it moves.
    seen = {"version": done.json()["version"]}
    before = table_snapshot(engine)
    refused = http.post(requeue, headers=auth(ADMIN_KEY), json={**seen, **other})
    assert refused.status_code == 404 and refused.json()["code"] == "not_found", refused.text
    assert table_snapshot(engine) == before
    moved = http.post(requeue, headers=auth(ADMIN_KEY), json={**seen, "workspace_id": "dash-idle"})
    assert moved.status_code == 200 and moved.json()["status"] == "queued", moved.text
    redis_lib.Redis.from_url(redis_url).delete(queue_name(IDLE))  # its wake-up: nobody serves

    # A running row, cancelled by its run as shown (with its workspace), and a repeat.
    assert queue.claim(rid, "holder", lease_seconds=300, workspace_id="dash-idle") is not None
    snap = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    [shown] = [r for r in snap["running"] if r["request_id"] == rid]
    assert shown["workspace_id"] == "dash-idle"
    run = {"run": shown["run"]}
    before = table_snapshot(engine)
    refused = http.post(cancel, headers=auth(ADMIN_KEY), json={**run, **other})
    assert refused.status_code == 404, refused.text
    assert table_snapshot(engine) == before
    mine = {**run, "workspace_id": shown["workspace_id"]}  # what the page sends
    first = http.post(cancel, headers=auth(ADMIN_KEY), json=mine)
    assert first.status_code == 200 and first.json()["cancel_requested"] is True, first.text
    again = http.post(cancel, headers=auth(ADMIN_KEY), json=mine)
    assert again.status_code == 200 and again.json()["already_requested"] is True, again.text
    refused = http.post(cancel, headers=auth(ADMIN_KEY), json={**run, **other})
    assert refused.status_code == 404, refused.text


def test_a_limited_key_sees_no_error_text_of_other_workspaces_in_the_snapshot_or_stream(
    http: httpx.Client, dash: Any, engine: Engine
) -> None:
    queue = Queue(engine)
    dead: dict[str, str] = {}
    for ws in ("dash-ws1", "dash-ws2"):  # the scoped key reads dash-ws1, not dash-ws2
        rid = queue.enqueue("cell", ws, f"jdead-{ws}", worker_class=IDLE).request_id
        claim = queue.claim(rid, "worker-x", lease_seconds=30)
        assert claim is not None
        queue.fail(claim, {"type": "SecretError", "message": f"token of {ws}"}, retryable=False)
        dead[ws] = rid

    def errors(snapshot: dict[str, Any]) -> dict[str, Any]:
        return {r["workspace_id"]: r["error"] for r in snapshot["dead"] if r["request_id"] in
                dead.values()}  # fmt: skip

    every = http.get("/dashboard/api/snapshot", headers=auth(VIEWER_KEY)).json()
    assert errors(every) == {
        "dash-ws1": "SecretError: token of dash-ws1", "dash-ws2": "SecretError: token of dash-ws2",
    }  # fmt: skip
    limited = http.get("/dashboard/api/snapshot", headers=auth(SCOPED_KEY))
    assert limited.status_code == 200, limited.text
    assert errors(limited.json()) == {
        "dash-ws1": "SecretError: token of dash-ws1",
        "dash-ws2": None,
    }
    assert "token of dash-ws2" not in limited.text
    assert "dash-ws2" not in {w["workspace_id"] for w in limited.json()["savings"]["workspaces"]}
    # The stream renders the same shared snapshot for the key it is sent to.
    with http.stream("GET", "/dashboard/api/stream", headers=auth(SCOPED_KEY)) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            assert "token of dash-ws2" not in line
            if line.startswith("data: "):
                shown = errors(json.loads(line[len("data: ") :]))
                if len(shown) == 2:  # a snapshot taken after both rows died
                    assert shown == {"dash-ws1": "SecretError: token of dash-ws1",
                                     "dash-ws2": None}  # fmt: skip
                    break
