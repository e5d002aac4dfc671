"""A pull worker's key reaches only its tenants: worker keys and minted worker tokens are
scoped to workspaces, through a real ``onceflow api`` server, Postgres and Redis.

The attack: a worker key of a shared pull class (the key a web app puts in its pages)
claimed any workspace's request of that class, and with the claim read and wrote that
workspace's data. Now a scoped key or token claims only rows of its workspaces (another
tenant's row stays queued, untouched, never even locked), cannot heartbeat, complete, fail,
write or read under another workspace's claim token, and a token that is expired, forged,
unsigned or minted for too long is an unknown key (401) that changes nothing.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import jwt
import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.integrations.fastapi import hash_key, mint_worker_token
from onceflow.keys import queue_name
from onceflow.worker_tokens import AUDIENCE
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import Proc, api_server
from tests.acceptance.test_http_api import auth, snapshot

pytestmark = pytest.mark.slow

PULL = "t-pull"
API_KEY = "of_test_scopes_api_key_0123456789abcdef"  # every workspace: enqueues
TENANT_KEY = "of_test_scopes_tenant_key_0123456789ab"  # t-pull in acme-a
PREFIX_KEY = "of_test_scopes_prefix_key_0123456789ab"  # t-pull in acme-*
LEGACY_KEY = "of_test_scopes_legacy_key_0123456789ab"  # t-pull, the older list form
SECRET = "worker-token-secret-" + "s" * 44
OLD_SECRET = "worker-token-old-secret-" + "o" * 40  # still verifies (rotation)
MAX_LIFETIME = 3600
OP = {"type": "cell.set", "column": "a", "value": 1}

_SECRETS_SEEN: list[str] = []


@pytest.fixture(scope="module")
def scoped_api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str
) -> Iterator[tuple[str, Proc]]:
    """A real ``onceflow api`` with scoped, prefix and legacy worker keys and token secrets."""
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): ["*"]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps(
            {
                hash_key(TENANT_KEY): {"worker_classes": [PULL], "workspaces": ["acme-a"]},
                hash_key(PREFIX_KEY): {"worker_classes": [PULL], "workspaces": ["acme-*"]},
                hash_key(LEGACY_KEY): [PULL],
            }
        ),
        "ONCEFLOW_WORKER_TOKEN_SECRETS": f"{SECRET},{OLD_SECRET}",
        "ONCEFLOW_WORKER_TOKEN_MAX_LIFETIME_SECONDS": str(MAX_LIFETIME),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
        "ONCEFLOW_API_RATE_LIMIT": "",
    }
    with api_server(tmp_path_factory.mktemp("scoped-api"), env) as (url, proc):
        yield url, proc
    log_text = proc.log()
    for secret in (API_KEY, TENANT_KEY, PREFIX_KEY, LEGACY_KEY, SECRET, OLD_SECRET, *_SECRETS_SEEN):
        assert secret not in log_text  # neither keys, tokens, nor claim tokens are logged


@pytest.fixture()
def http(scoped_api: tuple[str, Proc], runtime: Any, redis_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=scoped_api[0], timeout=10) as client:
        yield client
    redis_lib.Redis.from_url(redis_url).delete(queue_name(PULL))


def token(workspaces: list[str], *, secret: str = SECRET, **kw: Any) -> str:
    minted = mint_worker_token(workspaces=workspaces, worker_classes=[PULL], secret=secret, **kw)
    _SECRETS_SEEN.append(minted)
    return minted


def row_of(snap: dict[str, list[tuple[Any, ...]]], rid: str) -> tuple[Any, ...]:
    """The request ``rid``'s row in a :func:`snapshot`."""
    (found,) = [r for r in snap["workspace_process_requests"] if rid in r]
    return found


def enqueue(http: httpx.Client, ws: str, priority: int = 0) -> str:
    body = {"stage": "noop", "job_id": "j", "input": {"value": 1}, "worker_class": PULL}
    if priority:
        body["priority"] = priority
    answer = http.post(f"/v1/workspaces/{ws}/requests", json=body, headers=auth(API_KEY))
    assert answer.status_code == 201, answer.text
    return str(answer.json()["request_id"])


def claim(http: httpx.Client, key: str, **body: Any) -> httpx.Response:
    return http.post(
        f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "tab", **body}, headers=auth(key)
    )


def test_a_scoped_key_or_token_claims_only_its_tenants_rows(
    http: httpx.Client, clean_db: Engine
) -> None:
    # The other tenant's row is first in line: an unscoped claim takes it first.
    globex = enqueue(http, "globex", priority=10)
    mine = enqueue(http, "acme-a")
    before = snapshot(clean_db)
    taken = claim(http, TENANT_KEY)
    assert taken.status_code == 201, taken.text
    assert taken.json()["request_id"] == mine
    _SECRETS_SEEN.append(taken.json()["claim_token"])
    for key in (TENANT_KEY, token(["acme-a"]), token(["acme-a"], secret=OLD_SECRET)):
        assert claim(http, key).status_code == 204  # globex's row is not theirs
        assert claim(http, key, wait=0.3).status_code == 204  # nor on a long poll
    # Every column of globex's row as it was: status, attempts, claim columns, updated_at.
    assert row_of(snapshot(clean_db), globex) == row_of(before, globex)
    # The legacy key (no workspace scope) still claims any workspace, as before.
    legacy = claim(http, LEGACY_KEY)
    assert legacy.status_code == 201 and legacy.json()["request_id"] == globex
    _SECRETS_SEEN.append(legacy.json()["claim_token"])


def test_a_long_poll_of_a_scoped_token_takes_its_own_row_when_it_comes(
    http: httpx.Client, clean_db: Engine
) -> None:
    globex = enqueue(http, "globex")
    answers: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: answers.append(claim(http, token(["acme-*"]), wait=20)), daemon=True
    )
    poll.start()
    mine = enqueue(http, "acme-b")
    poll.join(30)
    (answer,) = answers
    assert answer.status_code == 201 and answer.json()["request_id"] == mine
    _SECRETS_SEEN.append(answer.json()["claim_token"])
    assert "queued" in row_of(snapshot(clean_db), globex)


def test_prefix_patterns(http: httpx.Client) -> None:
    for ws in ("acme-1", "acme-2", "acmeco", "globex"):
        enqueue(http, ws)
    got = set()
    for key in (PREFIX_KEY, token(["acme-*"])):
        answer = claim(http, key)
        assert answer.status_code == 201
        got.add(answer.json()["request"]["workspace_id"])
        _SECRETS_SEEN.append(answer.json()["claim_token"])
    assert got == {"acme-1", "acme-2"}
    assert claim(http, PREFIX_KEY).status_code == 204  # "acmeco" does not start with "acme-"
    exact = claim(http, token(["acmeco"]))
    assert exact.status_code == 201 and exact.json()["request"]["workspace_id"] == "acmeco"
    _SECRETS_SEEN.append(exact.json()["claim_token"])


def test_a_token_for_one_workspace_cannot_work_another_workspaces_claim(
    http: httpx.Client, clean_db: Engine
) -> None:
    rid = enqueue(http, "globex")
    held = claim(http, LEGACY_KEY)  # the back end's claim on globex's request
    assert held.status_code == 201
    stolen = held.json()["claim_token"]
    _SECRETS_SEEN.append(stolen)
    before = snapshot(clean_db)
    attacker = token(["acme-a"])
    for ws in ({}, {"workspace_id": "globex"}):
        body = {"claim_token": stolen, **ws}
        calls = {
            "heartbeat": ("heartbeat", {**body, "lease_seconds": 600}),
            "complete": ("complete", {**body, "result": {"stolen": True}}),
            "fail": ("fail", {**body, "error": "x"}),
            "op": ("ops", {**body, "sub_doc": "d", "op": OP, "key": "k"}),
            "sub-doc read": ("sub-docs", {**body, "sub_doc": "d"}),
            "lock": ("locks", {**body, "task": "t"}),
        }
        for what, (path, payload) in calls.items():
            for key in (attacker, TENANT_KEY):
                answer = http.post(f"/v1/claims/{rid}/{path}", json=payload, headers=auth(key))
                assert answer.status_code == 409, (what, answer.text)
                assert answer.json()["code"] == "lease_lost", what
    assert snapshot(clean_db) == before  # no lease extended, nothing completed or written
    # A token is not an API key: no enqueue, no reads.
    assert enqueue_status(http, attacker, "acme-a") == 403
    assert (
        http.get(f"/v1/workspaces/acme-a/requests/{rid}", headers=auth(attacker)).status_code == 403
    )


def enqueue_status(http: httpx.Client, key: str, ws: str) -> int:
    body = {"stage": "noop", "job_id": "x", "input": {"value": 1}, "worker_class": PULL}
    return http.post(f"/v1/workspaces/{ws}/requests", json=body, headers=auth(key)).status_code


def _unsigned(claims: dict[str, Any]) -> str:
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


def test_expired_forged_unsigned_and_over_long_tokens_are_unknown_keys(
    http: httpx.Client, clean_db: Engine
) -> None:
    enqueue(http, "acme-a")
    now = int(datetime.now(UTC).timestamp())
    body = {
        "aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + 60,
        "worker_classes": [PULL], "workspaces": ["acme-a"],
    }  # fmt: skip
    bad = {
        "expired": token(["acme-a"], ttl_seconds=60, now=datetime.now(UTC) - timedelta(hours=1)),
        "wrong secret": token(["acme-a"], secret="another-secret-" + "x" * 40),
        "alg none": _unsigned(body),
        "HS512": jwt.encode(body, SECRET, algorithm="HS512"),
        "over-long lifetime": jwt.encode({**body, "exp": now + MAX_LIFETIME + 60}, SECRET),
        "other audience": jwt.encode({**body, "aud": "someone-else"}, SECRET),
        "every workspace": jwt.encode({**body, "workspaces": ["*"]}, SECRET),
    }
    _SECRETS_SEEN.extend(bad.values())
    before = snapshot(clean_db)
    for why, key in bad.items():
        answer = claim(http, key)
        assert answer.status_code == 401, (why, answer.text)
        assert answer.json()["code"] == "unauthorized", why
    assert snapshot(clean_db) == before
    good = claim(http, jwt.encode(body, SECRET))  # the same claims, well signed: accepted
    assert good.status_code == 201
    _SECRETS_SEEN.append(good.json()["claim_token"])


def test_unscoped_worker_keys_are_named_once_at_start(scoped_api: tuple[str, Proc]) -> None:
    log_lines = scoped_api[1].log().splitlines()
    lines = [line for line in log_lines if "has no workspace scope" in line]
    assert len(lines) == 1 and hash_key(LEGACY_KEY)[:12] in lines[0]
    for key in (TENANT_KEY, PREFIX_KEY):
        assert hash_key(key)[:12] not in lines[0]
