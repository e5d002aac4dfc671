"""CacheKey: its checks, its digest, and the lock cell identical calls merge on."""

from __future__ import annotations

import hashlib

import pytest

from onceflow.cache import CacheKey
from onceflow.cache.key import check_digest
from onceflow.errors import InvalidRequest
from onceflow.keys import lock_key


def test_a_key_is_its_sha256_whatever_its_text() -> None:
    prompt = "Résumé {of} : this\n" * 10_000  # long, braces, colons, newlines: any text
    key = CacheKey("workspace", prompt, 60)
    assert key.digest == hashlib.sha256(prompt.encode()).hexdigest()
    assert prompt not in repr(key)  # a prompt is not shown in logs


@pytest.mark.parametrize(
    ("scope", "key", "ttl"),
    [
        ("tenant", "k", 60),
        ("Global", "k", 60),
        (None, "k", 60),
        ("global", "", 60),
        ("global", b"bytes", 60),
        ("global", "\ud800", 60),  # a lone surrogate is not text
        ("global", "k", 0),
        ("global", "k", -1),
        ("global", "k", float("nan")),
        ("global", "k", float("inf")),
        ("global", "k", True),
        ("global", "k", "60"),
        ("global", "k", 1e12),
    ],
)
def test_bad_keys_are_refused(scope: object, key: object, ttl: object) -> None:
    with pytest.raises(InvalidRequest):
        CacheKey(scope, key, ttl)  # type: ignore[arg-type]


def test_the_lock_cell_is_the_keys_not_the_callers() -> None:
    ws_key = CacheKey("workspace", "prompt", 60)
    assert ws_key.lock_cell("acme") == ("acme", "onceflow.cache", ws_key.digest)
    global_key = CacheKey("global", "prompt", 60)
    cell = global_key.lock_cell("acme")
    assert cell == global_key.lock_cell("other")  # every workspace merges on one lock
    assert lock_key(*cell).startswith(f"onceflow:{{onceflow.cache.{global_key.digest}}}:")


def test_a_digest_is_64_lowercase_hex_digits() -> None:
    assert check_digest("a" * 64) == "a" * 64
    for bad in ("A" * 64, "a" * 63, "g" * 64, None):
        with pytest.raises(InvalidRequest):
            check_digest(bad)
