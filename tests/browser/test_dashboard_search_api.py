"""The dashboard's search and series routes over HTTP: a real `onceflow api`, Postgres and
Redis. Roles, filters and pages against the table, pasted ids, bad input, and the series
a real sweep (the Flow's) wrote."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from onceflow.models import NewRequest
from onceflow.queue import Queue
from tests.browser.conftest import ADMIN_KEY, API_KEY, SCOPED_KEY, VIEWER_KEY, auth

pytestmark = pytest.mark.slow

IDLE = "t-dash-search"  # nobody serves it: the rows stay queued


@pytest.fixture()
def http(dashboard_api: tuple[str, Any]) -> Any:
    with httpx.Client(base_url=dashboard_api[0], timeout=10) as client:
        yield client


def _rows(engine: Engine) -> list[str]:
    queue = Queue(engine)
    items = [
        NewRequest(f"dash-s{i % 3}", f"job-{i % 4}", "cell", branch_path=str(i), worker_class=IDLE)
        for i in range(24)
    ]
    return [r.request_id for r in queue.enqueue_many(items)]


def test_search_roles_filters_pages_and_ids(http: httpx.Client, dash: Any, engine: Engine) -> None:
    ids = _rows(engine)
    for headers in ({}, auth("wrong-key"), auth(API_KEY)):
        answer = http.get("/dashboard/api/requests", headers=headers)
        assert answer.status_code == 401 and answer.json()["code"] == "unauthorized"
    for key in (VIEWER_KEY, ADMIN_KEY):
        assert http.get("/dashboard/api/requests", headers=auth(key)).status_code == 200

    # Pages of 5 of one workspace: every row once, newest first, then `next` is null.
    seen: list[dict[str, Any]] = []
    params: dict[str, Any] = {"workspace": "dash-s1", "limit": 5}
    while True:
        page = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY), params=params)
        assert page.status_code == 200, page.text
        body = page.json()
        assert page.headers["cache-control"] == "no-store"
        seen += body["items"]
        if body["next"] is None:
            break
        params["cursor"] = body["next"]
    with engine.connect() as conn:
        expected = [r[0] for r in conn.execute(text(
            "SELECT request_id FROM workspace_process_requests WHERE workspace_id = 'dash-s1' "
            "ORDER BY created_at DESC, workspace_id DESC, request_id DESC"
        ))]  # fmt: skip
    assert [r["request_id"] for r in seen] == expected and len(expected) == 8
    assert {r["status"] for r in seen} == {"queued"} and seen[0]["attempts"] == 0

    both = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY),
                    params={"job": "job-1", "workspace": "dash-s1"}).json()  # fmt: skip
    assert {(r["job_id"], r["workspace_id"]) for r in both["items"]} == {("job-1", "dash-s1")}
    assert len(both["items"]) == 2  # i in {1, 13}

    # A pasted id: whole (with spaces around it), a prefix, a job id.
    one = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY),
                   params={"q": f"  {ids[5]}\n"}).json()  # fmt: skip
    assert [r["request_id"] for r in one["items"]] == [ids[5]]
    prefix = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY),
                      params={"q": ids[5][:12]}).json()  # fmt: skip
    assert ids[5] in [r["request_id"] for r in prefix["items"]]
    job = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY),
                   params={"q": "job-2", "status": "queued"}).json()  # fmt: skip
    assert len(job["items"]) == 6 and {r["job_id"] for r in job["items"]} == {"job-2"}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"status": "sleeping"}, "status must be one of"),
        ({"since": "yesterday"}, "since must be an ISO 8601"),
        ({"until": "2026-12-01T00:00:00"}, "until must be an ISO 8601 timestamp with a zone"),
        ({"cursor": "garbage"}, "cursor is not one this route returned"),
        ({"workspace": "a\x00b"}, "workspace"),
        ({"limit": "500"}, ""),
        ({"limit": "many"}, ""),
    ],
)
def test_search_bad_input_is_refused(
    http: httpx.Client, dash: Any, params: dict[str, str], message: str
) -> None:
    answer = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY), params=params)
    assert answer.status_code == 422, answer.text
    assert message in str(answer.json()["detail"])


def test_series_after_a_sweep(http: httpx.Client, dash: Any, engine: Engine) -> None:
    _rows(engine)
    dash.flow.sweep_once()  # the Flow's sweep writes the rollup
    answer = http.get("/dashboard/api/series", headers=auth(VIEWER_KEY))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["range"] == "hour" and body["step_seconds"] == 60 and len(body["buckets"]) == 60
    assert sum(b["enqueued"] for b in body["buckets"]) == 24
    assert max(b["queued_max"] or 0 for b in body["buckets"]) >= 24
    only = http.get("/dashboard/api/series", headers=auth(VIEWER_KEY),
                    params={"range": "day", "worker_class": IDLE}).json()  # fmt: skip
    assert len(only["buckets"]) == 96 and sum(b["enqueued"] for b in only["buckets"]) == 24
    other = http.get("/dashboard/api/series", headers=auth(VIEWER_KEY),
                     params={"range": "week", "worker_class": "nobody"}).json()  # fmt: skip
    assert len(other["buckets"]) == 84 and sum(b["enqueued"] for b in other["buckets"]) == 0
    refused = http.get("/dashboard/api/series", headers=auth(VIEWER_KEY), params={"range": "year"})
    assert refused.status_code == 422
    assert "range must be one of hour, day, week" in refused.json()["detail"]
    assert http.get("/dashboard/api/series", headers=auth(API_KEY)).status_code == 401


def test_a_limited_key_lists_and_charts_only_its_workspaces(
    http: httpx.Client, dash: Any, engine: Engine
) -> None:
    queue = Queue(engine)
    items = [
        NewRequest(ws, "job-scope", "cell", branch_path=str(i), worker_class=IDLE)
        for i, ws in enumerate(["dash-ws1", "dash-own-1", "dash-own-2", "dash-ws2", "dash-ws10"])
    ]
    ids = {r.workspace_id: r.request_id for r in queue.enqueue_many(items)}
    # The scoped key reads "dash-ws1" and "dash-own-*": the other two are not listed.
    page = http.get("/dashboard/api/requests", headers=auth(SCOPED_KEY), params={"limit": 200})
    assert page.status_code == 200, page.text
    listed = {r["workspace_id"] for r in page.json()["items"]}
    assert listed == {"dash-ws1", "dash-own-1", "dash-own-2"}
    pasted = http.get("/dashboard/api/requests", headers=auth(SCOPED_KEY),
                      params={"q": ids["dash-ws2"]}).json()  # fmt: skip
    assert pasted["items"] == []  # a pasted id of another workspace is not found either
    mine = http.get("/dashboard/api/requests", headers=auth(SCOPED_KEY),
                    params={"workspace": "dash-own-2"}).json()  # fmt: skip
    assert [r["request_id"] for r in mine["items"]] == [ids["dash-own-2"]]
    refused = http.get("/dashboard/api/requests", headers=auth(SCOPED_KEY),
                       params={"workspace": "dash-ws2"})  # fmt: skip
    assert refused.status_code == 403 and refused.json()["code"] == "forbidden", refused.text
    assert "not scoped to that workspace" in refused.json()["detail"]
    every = http.get("/dashboard/api/requests", headers=auth(VIEWER_KEY), params={"limit": 200})
    assert {r["workspace_id"] for r in every.json()["items"]} == set(ids)

    # The series: spend by workspace and budgets of its workspaces only.
    with engine.begin() as conn:
        for ws in ("dash-ws1", "dash-ws2"):
            conn.execute(
                text(
                    "INSERT INTO onceflow_series_spend (bucket, provider, workspace_id, calls, "
                    "input_tokens, output_tokens, cost, saved_cost) "
                    "VALUES (date_trunc('minute', now()), 'p', :ws, 1, 10, 10, 0.5, 0)"
                ),
                {"ws": ws},
            )
            conn.execute(
                text(
                    "INSERT INTO spend_budgets (workspace_id, period, limit_cost, on_exceeded) "
                    "VALUES (:ws, 'day', 10, 'fail')"
                ),
                {"ws": ws},
            )
    seen = http.get("/dashboard/api/series", headers=auth(VIEWER_KEY)).json()
    assert {w["workspace_id"] for w in seen["spend"]["by_workspace"]} == {"dash-ws1", "dash-ws2"}
    assert {b["workspace_id"] for b in seen["budgets"]} == {"dash-ws1", "dash-ws2"}
    scoped = http.get("/dashboard/api/series", headers=auth(SCOPED_KEY))
    assert scoped.status_code == 200, scoped.text
    body = scoped.json()
    assert [w["workspace_id"] for w in body["spend"]["by_workspace"]] == ["dash-ws1"]
    assert [b["workspace_id"] for b in body["budgets"]] == ["dash-ws1"]
    assert "dash-ws2" not in scoped.text
    assert body["spend"]["by_provider"] == seen["spend"]["by_provider"]  # no workspace named
