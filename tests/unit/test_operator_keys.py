"""Operator keys: hashed, role-checked, refused at start-up when malformed, no login-less mode."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from onceflow.errors import InvalidRequest
from onceflow.integrations.fastapi.auth import hash_key
from onceflow.integrations.fastapi.guard import operator_route_class
from onceflow.integrations.fastapi.operators import ADMIN, VIEWER, OperatorAuth
from onceflow.integrations.fastapi.ratelimit import RateLimits, parse_limits
from onceflow.settings import Settings

VIEW_KEY, ADMIN_KEY, API_KEY = "of_view_" + "v" * 20, "of_admin_" + "a" * 20, "of_api_" + "k" * 20


@dataclass
class _Services:  # what the operator routes use of OnceflowServices
    operator_auth: OperatorAuth
    rate_limits: RateLimits


def _client(keys: dict[str, list[str]], per_key: str = "") -> TestClient:
    services = _Services(
        OperatorAuth(keys),
        RateLimits(
            parse_limits("x", per_key), parse_limits("x", "1000/minute"), storage="memory://"
        ),
    )
    router = APIRouter(route_class=operator_route_class(services))  # type: ignore[arg-type]

    @router.get("/op/state")
    def state() -> dict[str, str]:
        return {"ok": "read"}

    @router.post("/op/requeue")
    def requeue() -> dict[str, str]:
        return {"ok": "acted"}

    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_roles_decide_what_a_key_may_do() -> None:
    client = _client({hash_key(VIEW_KEY): [VIEWER], hash_key(ADMIN_KEY): [ADMIN]})
    assert client.get("/op/state", headers=_h(VIEW_KEY)).json() == {"ok": "read"}
    assert client.get("/op/state", headers=_h(ADMIN_KEY)).status_code == 200
    refused = client.post("/op/requeue", headers=_h(VIEW_KEY))
    assert refused.status_code == 403
    assert "admin" in refused.json()["detail"]
    assert client.post("/op/requeue", headers=_h(ADMIN_KEY)).json() == {"ok": "acted"}


def test_requests_refused_for_their_role_use_the_keys_budget() -> None:
    """A 403 (viewer asking to act) is charged to the key: before, the role was checked
    before the charge, so such requests were never limited."""
    keys = {hash_key(VIEW_KEY): [VIEWER], hash_key(ADMIN_KEY): [ADMIN]}
    with _client(keys, "3/minute") as client:  # one event loop: one set of counters
        statuses = [client.post("/op/requeue", headers=_h(VIEW_KEY)).status_code for _ in "abcd"]
        assert statuses == [403, 403, 403, 429]
        assert client.get("/op/state", headers=_h(VIEW_KEY)).status_code == 429  # budget spent
        assert client.get("/op/state", headers=_h(ADMIN_KEY)).status_code == 200  # another key


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer "}, _h(API_KEY)],
    ids=["missing", "not-bearer", "empty", "an-api-key-is-not-an-operator-key"],
)
def test_missing_malformed_or_unknown_keys_get_401(headers: dict[str, str]) -> None:
    client = _client({hash_key(VIEW_KEY): [VIEWER]})
    answer = client.get("/op/state", headers=headers)
    assert answer.status_code == 401
    assert answer.json()["code"] == "unauthorized"


def test_no_operator_key_configured_means_no_access() -> None:
    client = _client({})
    assert client.get("/op/state", headers=_h(VIEW_KEY)).status_code == 401


@pytest.mark.parametrize(
    "table",
    [
        {VIEW_KEY: [VIEWER]},  # a key in the clear
        {hash_key(VIEW_KEY).upper(): [VIEWER]},
        {hash_key(VIEW_KEY): []},
        {hash_key(VIEW_KEY): ["root"]},
        {hash_key(VIEW_KEY): "viewer"},
        {hash_key(VIEW_KEY): {"roles": ["viewer"], "workspaces": []}},
        {hash_key(VIEW_KEY): {"roles": ["viewer"], "workspaces": ["a*b"]}},
        {hash_key(VIEW_KEY): {"roles": ["viewer"], "workspace": ["a"]}},
        {hash_key(VIEW_KEY): {"workspaces": ["a"]}},
    ],
    ids=[
        "clear",
        "upper",
        "no-roles",
        "unknown-role",
        "string-not-list",
        "no-workspaces",
        "inner-star",
        "unknown-field",
        "scope-without-roles",
    ],
)
def test_a_malformed_table_is_refused_at_start_up(table: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        OperatorAuth(table)  # type: ignore[arg-type]


def test_settings_read_the_table_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCEFLOW_OPERATOR_KEYS", f'{{"{hash_key(ADMIN_KEY)}": ["admin"]}}')
    auth = OperatorAuth.from_settings(Settings())
    operator = auth.authenticate(ADMIN_KEY)
    assert operator is not None and operator.may(VIEWER) and operator.may(ADMIN)
    assert auth.authenticate(VIEW_KEY) is None


def test_a_key_limited_to_some_workspaces_reads_only_their_payloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = {
        hash_key(VIEW_KEY): {"roles": ["viewer"], "workspaces": ["acme-*", "solo"]},
        hash_key(ADMIN_KEY): ["admin"],
    }
    monkeypatch.setenv("ONCEFLOW_OPERATOR_KEYS", json.dumps(table))
    auth = OperatorAuth.from_settings(Settings())
    scoped, everything = auth.authenticate(VIEW_KEY), auth.authenticate(ADMIN_KEY)
    assert scoped is not None and everything is not None
    assert scoped.may(VIEWER) and not scoped.may(ADMIN)
    assert scoped.may_read("acme-1") and scoped.may_read("solo")
    assert not scoped.may_read("solo-2") and not scoped.may_read("other")
    assert everything.may_read("other") and everything.workspaces is None
    star = OperatorAuth({hash_key(VIEW_KEY): {"roles": ["viewer"], "workspaces": ["*"]}})
    found = star.authenticate(VIEW_KEY)
    assert found is not None and found.may_read("anything")
