"""Workspace scopes of worker keys and worker tokens: parsing of the settings, the key
tables, and minting / verifying tokens (no server: tests/security/test_worker_scopes.py)."""

from __future__ import annotations

import base64
import json
import logging
from datetime import UTC, datetime, timedelta

import jwt
import pytest
from pydantic import ValidationError

from onceflow.errors import InvalidRequest
from onceflow.integrations.fastapi import KeyAuth, hash_key
from onceflow.models import WorkspaceScope
from onceflow.settings import Settings, WorkerKeyScopes
from onceflow.worker_tokens import (
    AUDIENCE,
    mint_worker_token,
    verify_worker_token,
)

SECRET = "s" * 64
OTHER_SECRET = "o" * 64
KEY = "of_unit_worker_key_0123456789abcdef"


def test_patterns_parse_to_exact_ids_and_prefixes() -> None:
    scope = WorkspaceScope.parse(["acme-*", "w1", "w1", "beta-*"])
    assert scope == WorkspaceScope(frozenset({"w1"}), ("acme-", "beta-"))
    assert scope.allows("acme-7") and scope.allows("w1") and scope.allows("beta-")
    assert not scope.allows("acme") and not scope.allows("w10") and not scope.allows("x")
    assert scope.patterns() == ["w1", "acme-*", "beta-*"]
    assert WorkspaceScope.parse(["w1", "*"]) is None  # every workspace


@pytest.mark.parametrize(
    "patterns",
    [[], ["a*b"], ["*a"], ["**"], [""], [1], "acme-*", ["x" * 201], ["a\x00"]],
)
def test_bad_patterns_are_refused(patterns: object) -> None:
    with pytest.raises(InvalidRequest):
        WorkspaceScope.parse(patterns)  # type: ignore[arg-type]


def test_settings_take_both_forms_of_worker_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = "a" * 64, "b" * 64
    table = {old: ["tabs"], new: {"worker_classes": ["tabs"], "workspaces": ["acme-*"]}}
    monkeypatch.setenv("ONCEFLOW_WORKER_KEYS", json.dumps(table))
    monkeypatch.setenv("ONCEFLOW_WORKER_TOKEN_SECRETS", f" {SECRET} , {OTHER_SECRET},")
    st = Settings()
    assert st.worker_keys[old] == ["tabs"]
    assert st.worker_keys[new] == WorkerKeyScopes(worker_classes=["tabs"], workspaces=["acme-*"])
    assert st.worker_token_secret_list == [SECRET, OTHER_SECRET]
    assert SECRET not in repr(st)  # a secret setting is never shown


@pytest.mark.parametrize(
    "entry",
    [
        {"worker_classes": ["tabs"]},  # no workspaces: refused, never "every workspace"
        {"worker_classes": ["tabs"], "workspace": ["w1"]},  # a typo is not ignored
        {"worker_classes": "tabs", "workspaces": ["w1"]},
    ],
)
def test_settings_refuse_a_malformed_scoped_entry(
    monkeypatch: pytest.MonkeyPatch, entry: object
) -> None:
    monkeypatch.setenv("ONCEFLOW_WORKER_KEYS", json.dumps({"a" * 64: entry}))
    with pytest.raises(ValidationError):
        Settings()


def test_key_auth_keeps_claim_workspaces_apart_from_api_workspaces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    digest = hash_key(KEY)
    legacy = hash_key(KEY + "-legacy")
    with caplog.at_level(logging.WARNING, logger="onceflow.api"):
        auth = KeyAuth(
            api_keys={digest: ["w-api"]},
            worker_keys={
                digest: {"worker_classes": ["tabs"], "workspaces": ["acme-*"]},
                legacy: ["tabs"],
            },
        )
    both = auth.authenticate(KEY)
    assert both is not None
    assert both.may_use_workspace("w-api") and not both.may_use_workspace("acme-1")
    assert both.may_claim_in("acme-1") and not both.may_claim_in("w-api")
    old = auth.authenticate(KEY + "-legacy")
    assert old is not None and old.claim_workspaces is None and old.may_claim_in("anything")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and legacy[:12] in warned[0] and digest[:12] not in warned[0]
    assert KEY not in warned[0]


@pytest.mark.parametrize(
    "entry",
    [
        {"worker_classes": ["tabs"], "workspaces": []},
        {"worker_classes": ["tabs"], "workspaces": ["a*b"]},
        {"worker_classes": [], "workspaces": ["w1"]},
        {"worker_classes": ["tabs"]},
        {"worker_classes": ["tabs"], "workspaces": ["w1"], "other": 1},
    ],
)
def test_key_auth_refuses_a_bad_worker_key_at_start(entry: object) -> None:
    with pytest.raises(InvalidRequest):
        KeyAuth(worker_keys={"a" * 64: entry})  # type: ignore[dict-item]


def test_short_token_secrets_are_refused_at_start() -> None:
    with pytest.raises(InvalidRequest, match="32 bytes"):
        KeyAuth(token_secrets=["short"])


def test_a_minted_token_verifies_with_any_configured_secret() -> None:
    st = Settings(worker_token_secrets=f"{OTHER_SECRET},{SECRET}")
    token = mint_worker_token(
        workspaces=["acme-*", "w1"], worker_classes=["tabs"], ttl_seconds=60, settings=st
    )
    claims = jwt.decode(token, OTHER_SECRET, algorithms=["HS256"], audience=AUDIENCE)
    assert claims["exp"] - claims["iat"] == 60 and claims["nbf"] == claims["iat"]
    assert claims["workspaces"] == ["w1", "acme-*"] and claims["worker_classes"] == ["tabs"]
    # Verified by the second secret of a rotation too (minted by the first of another list).
    verified = verify_worker_token(token, [SECRET, OTHER_SECRET], 3600)
    assert verified is not None
    assert verified.workspaces == WorkspaceScope(frozenset({"w1"}), ("acme-",))
    assert verified.worker_classes == frozenset({"tabs"})
    auth = KeyAuth(token_secrets=[SECRET, OTHER_SECRET])
    principal = auth.authenticate(token)
    assert principal is not None and principal.workspaces == frozenset()  # no API-key rights
    assert principal.may_claim_in("acme-9") and not principal.may_claim_in("globex")


def _unsigned(claims: dict[str, object], alg: str = "none") -> str:
    def part(value: dict[str, object]) -> str:
        raw = json.dumps(value).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    return f"{part({'alg': alg, 'typ': 'JWT'})}.{part(claims)}."


def test_refused_tokens() -> None:
    now = int(datetime.now(UTC).timestamp())
    good = {
        "aud": AUDIENCE, "iat": now, "nbf": now, "exp": now + 60,
        "worker_classes": ["tabs"], "workspaces": ["w1"],
    }  # fmt: skip
    assert verify_worker_token(jwt.encode(good, SECRET), [SECRET], 3600) is not None
    refused = {
        "wrong secret": jwt.encode(good, OTHER_SECRET),
        "alg none": _unsigned(good),
        "HS512": jwt.encode(good, SECRET, algorithm="HS512"),
        "expired": jwt.encode({**good, "iat": now - 7200, "nbf": now - 7200, "exp": now - 3600},
                              SECRET),
        "not yet": jwt.encode({**good, "nbf": now + 600}, SECRET),
        "too long": jwt.encode({**good, "exp": now + 3601}, SECRET),
        "no iat": jwt.encode({k: v for k, v in good.items() if k != "iat"}, SECRET),
        "no exp": jwt.encode({k: v for k, v in good.items() if k != "exp"}, SECRET),
        "wrong audience": jwt.encode({**good, "aud": "someone-else"}, SECRET),
        "every workspace": jwt.encode({**good, "workspaces": ["*"]}, SECRET),
        "no workspaces": jwt.encode({**good, "workspaces": []}, SECRET),
        "bad class": jwt.encode({**good, "worker_classes": ["*"]}, SECRET),
        "garbage": "a.b.c",
    }  # fmt: skip
    for why, token in refused.items():
        assert verify_worker_token(token, [SECRET], 3600) is None, why


def test_minting_refuses_what_the_server_would_refuse() -> None:
    st = Settings(worker_token_secrets=SECRET, worker_token_max_lifetime_seconds=600)
    ok = {"workspaces": ["w1"], "worker_classes": ["tabs"], "settings": st}
    with pytest.raises(InvalidRequest, match="ttl_seconds"):
        mint_worker_token(**ok, ttl_seconds=601)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="never"):
        mint_worker_token(workspaces=["*"], worker_classes=["tabs"], settings=st)
    with pytest.raises(InvalidRequest, match="lists"):
        mint_worker_token(workspaces="w1", worker_classes=["tabs"], settings=st)
    with pytest.raises(InvalidRequest, match="no secret"):
        mint_worker_token(workspaces=["w1"], worker_classes=["tabs"], settings=Settings())
    past = datetime.now(UTC) - timedelta(hours=2)
    old = mint_worker_token(**ok, ttl_seconds=60, now=past)  # type: ignore[arg-type]
    assert verify_worker_token(old, [SECRET], 600) is None  # expired
