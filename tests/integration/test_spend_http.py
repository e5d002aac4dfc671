"""Spend and budgets over HTTP: operator keys (viewer reads, admin sets), the real app on
the test database and Redis; bad input is 422 with nothing written."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import redis as redis_lib
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
from onceflow.keys import counters_key, counters_workspaces_key
from onceflow.queue import Queue
from onceflow.settings import get_settings
from onceflow.spend import Grant, LedgerHooks, Usage
from onceflow.tasks import Flow
from tests.conftest import table_snapshot

VIEWER, ADMIN = "of_spend_viewer_" + "v" * 20, "of_spend_admin_" + "a" * 20
SCOPED = "of_spend_scoped_" + "s" * 20  # an admin key of the "ws-spend-*" workspaces
WS = "ws-spend-http"
OTHER = "ws-other-tenant"


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture()
def http(clean_db: Engine, redis_url: str) -> Iterator[TestClient]:
    keys: dict[str, Any] = {
        hash_key(VIEWER): ["viewer"],
        hash_key(ADMIN): ["admin"],
        hash_key(SCOPED): {"roles": ["admin"], "workspaces": ["ws-spend-*"]},
    }
    settings = get_settings().model_copy(update={"operator_keys": keys})
    Queue(clean_db, settings=settings).enqueue("summarize", WS, "job-1")
    Queue(clean_db, settings=settings).enqueue("summarize", OTHER, "job-1")
    app = create_app(Flow(settings=settings), auth=KeyAuth({}), settings=settings)
    with TestClient(app) as client:
        yield client


def test_operators_set_read_and_clear_budgets_and_read_spend(
    http: TestClient, clean_db: Engine, redis_url: str
) -> None:
    path = f"/dashboard/api/spend/budgets/{WS}/day"
    body: dict[str, Any] = {"limit_cost": "1.5", "on_exceeded": "wait"}
    assert http.put(path, json=body).status_code == 401
    assert http.put(path, json=body, headers=h(VIEWER)).status_code == 403
    before = table_snapshot(clean_db)
    for bad in (
        {"limit_cost": "-1"},
        {"limit_cost": "NaN"},
        {"limit_tokens": -1},
        {},
        {"limit_tokens": 5, "on_exceeded": "never"},
        {"limit_tokens": 5, "colour": "red"},
    ):
        refused = http.put(path, json=bad, headers=h(ADMIN))
        assert refused.status_code == 422, (bad, refused.text)
        assert refused.json()["code"] == "invalid_request"
    week = http.put(f"/dashboard/api/spend/budgets/{WS}/week", json=body, headers=h(ADMIN))
    assert week.status_code == 422
    unknown = http.put("/dashboard/api/spend/budgets/ws-nobody/day", json=body, headers=h(ADMIN))
    assert unknown.status_code == 422 and "ws-nobody" in unknown.json()["detail"]
    assert table_snapshot(clean_db) == before

    made = http.put(path, json=body, headers=h(ADMIN))
    assert made.status_code == 200, made.text
    assert made.json()["limit_cost"] == "1.5" and made.json()["on_exceeded"] == "wait"

    hooks = LedgerHooks(clean_db)
    g = Grant(
        workspace_id=WS,
        provider="openai",
        estimate_tokens=100,
        estimate_cost=Decimal("0.2"),
        stage="summarize",
    )
    hooks.admit(g)
    hooks.settle(g, Usage(80, 20), "ok", "openai", "gpt-x", Decimal("0.25"))

    shown = http.get("/dashboard/api/spend/budgets", headers=h(VIEWER)).json()["budgets"]
    assert [(b["workspace_id"], b["spent_cost"], b["spent_tokens"]) for b in shown] == [
        (WS, "0.25", 100)
    ]
    report = http.get(
        "/dashboard/api/spend", params={"by": ["provider", "stage"]}, headers=h(VIEWER)
    )
    assert report.status_code == 200
    (top,) = report.json()["rows"]
    assert {k: v for k, v in top.items() if not k.endswith("_at")} == {
        "provider": "openai",
        "stage": "summarize",
        "calls": 1,
        "input_tokens": 80,
        "output_tokens": 20,
        "cost": "0.25",
    }
    assert (
        http.get("/dashboard/api/spend", params={"by": "colour"}, headers=h(VIEWER)).status_code
        == 422
    )

    # The compute lock saved 4 calls of this workspace: priced at its average cost per call.
    client = redis_lib.Redis.from_url(redis_url)
    client.hset(counters_key(WS), mapping={"computes": 1, "preflight_hits": 4})
    client.sadd(counters_workspaces_key(), WS)
    try:
        savings = http.get("/dashboard/api/spend/savings", headers=h(VIEWER)).json()
    finally:
        client.delete(counters_key(WS))
        client.srem(counters_workspaces_key(), WS)
    (row,) = [r for r in savings["workspaces"] if r["workspace_id"] == WS]
    assert (row["saved"], Decimal(row["saved_cost"])) == (4, Decimal("1.00"))

    assert http.delete(path, headers=h(VIEWER)).status_code == 403
    cleared = http.delete(path, headers=h(ADMIN))
    assert cleared.json() == {"workspace_id": WS, "cleared": ["day"]}


def test_a_key_limited_to_some_workspaces_reads_and_changes_only_theirs(
    http: TestClient, clean_db: Engine, redis_url: str
) -> None:
    body = {"limit_cost": "2"}
    for ws in (WS, OTHER):  # an unscoped admin sets both
        made = http.put(f"/dashboard/api/spend/budgets/{ws}/day", json=body, headers=h(ADMIN))
        assert made.status_code == 200, made.text
    hooks = LedgerHooks(clean_db)
    for ws, cost in ((WS, "0.25"), (OTHER, "7")):
        g = Grant(workspace_id=ws, provider="openai", estimate_tokens=10,
                  estimate_cost=Decimal("0.1"), stage="summarize")  # fmt: skip
        hooks.admit(g)
        hooks.settle(g, Usage(8, 2), "ok", "openai", "gpt-x", Decimal(cost))

    # Outside its workspaces: 403 with a message, nothing changed.
    before = table_snapshot(clean_db)
    other = f"/dashboard/api/spend/budgets/{OTHER}/day"
    for answer in (
        http.put(other, json={"limit_cost": "999"}, headers=h(SCOPED)),
        http.delete(other, headers=h(SCOPED)),
        http.get("/dashboard/api/spend", params={"workspace_id": OTHER}, headers=h(SCOPED)),
        http.get("/dashboard/api/spend/budgets", params={"workspace_id": OTHER}, headers=h(SCOPED)),
    ):
        assert answer.status_code == 403, answer.text
        assert answer.json()["code"] == "forbidden"
        assert "not scoped to that workspace" in answer.json()["detail"]
    assert table_snapshot(clean_db) == before

    # Its own: read and changed as an admin's.
    mine = http.put(f"/dashboard/api/spend/budgets/{WS}/day", json={"limit_cost": "3"},
                    headers=h(SCOPED))  # fmt: skip
    assert mine.status_code == 200 and mine.json()["limit_cost"] == "3", mine.text
    shown = http.get("/dashboard/api/spend/budgets", headers=h(SCOPED)).json()["budgets"]
    assert [b["workspace_id"] for b in shown] == [WS]
    every = http.get("/dashboard/api/spend/budgets", headers=h(VIEWER)).json()["budgets"]
    assert {b["workspace_id"] for b in every} == {WS, OTHER}
    # Reports sum its workspaces only, whatever the grouping.
    for by in (["workspace"], ["provider"], []):
        report = http.get("/dashboard/api/spend", params={"by": by}, headers=h(SCOPED))
        assert report.status_code == 200, report.text
        assert report.json()["total"]["cost"] == "0.25", by
        assert OTHER not in report.text
    assert http.get("/dashboard/api/spend", params={"by": ["provider"]},
                    headers=h(VIEWER)).json()["total"]["cost"] == "7.25"  # fmt: skip
    # Savings: its workspaces' rows only.
    client = redis_lib.Redis.from_url(redis_url)
    for ws in (WS, OTHER):
        client.hset(counters_key(ws), mapping={"computes": 1, "preflight_hits": 2})
        client.sadd(counters_workspaces_key(), ws)
    try:
        savings = http.get("/dashboard/api/spend/savings", headers=h(SCOPED)).json()
        every_savings = http.get("/dashboard/api/spend/savings", headers=h(VIEWER)).json()
    finally:
        for ws in (WS, OTHER):
            client.delete(counters_key(ws))
            client.srem(counters_workspaces_key(), ws)
    assert [r["workspace_id"] for r in savings["workspaces"]] == [WS]
    assert Decimal(savings["saved_cost_total"]) == Decimal("0.5")  # 2 saved at 0.25
    assert {r["workspace_id"] for r in every_savings["workspaces"]} >= {WS, OTHER}
