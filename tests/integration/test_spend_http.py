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
WS = "ws-spend-http"


def h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture()
def http(clean_db: Engine, redis_url: str) -> Iterator[TestClient]:
    keys = {hash_key(VIEWER): ["viewer"], hash_key(ADMIN): ["admin"]}
    settings = get_settings().model_copy(update={"operator_keys": keys})
    Queue(clean_db, settings=settings).enqueue("summarize", WS, "job-1")
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
