"""Encoding a payload for storage: one set of checks, with or without its digest (no services)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.errors import InvalidRequest
from onceflow.payloads import canonical_json, encode_json, encode_payload

LIMIT = 64
DEPTH = 4

# JSON values with what the checks look for: non-ASCII (bytes > characters), NUL, lone
# surrogates, nesting, floats (NaN is refused) — small, so that the limit is met often.
_text = st.text(
    alphabet=st.sampled_from(["a", "é", "日", "\x00", "\ud800", '"', "\\"]), max_size=12
)
_leaf = st.none() | st.booleans() | st.integers() | st.floats() | _text
_values = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=12,
)


def _outcome(fn: Any, value: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(value)
    except InvalidRequest as exc:
        return type(exc).__name__, str(exc)


@given(_values)
def test_a_result_is_checked_exactly_as_an_input_is(value: Any) -> None:
    """encode_json (results, errors: no digest) refuses what encode_payload refuses, with the
    same error, and stores the same text."""
    digested = _outcome(lambda v: encode_payload(v, LIMIT, what="x", max_depth=DEPTH), value)
    plain = _outcome(lambda v: encode_json(v, LIMIT, what="x", max_depth=DEPTH), value)
    if digested[0] == "ok":
        text, digest = digested[1]
        assert plain == ("ok", text)
        assert text == canonical_json(value, what="x", max_depth=DEPTH)
        assert digest == hashlib.sha256(text.encode("utf-8")).hexdigest()
    else:
        assert plain == digested


def test_the_limit_counts_utf8_bytes_not_characters() -> None:
    fits = "é" * ((LIMIT - 2) // 2)  # two bytes each, plus the quotes
    assert len(json.dumps(fits, ensure_ascii=False).encode()) == LIMIT
    assert encode_json(fits, LIMIT) == f'"{fits}"'
    with pytest.raises(InvalidRequest, match="66 bytes, over the payload limit of 64"):
        encode_json(fits + "é", LIMIT)
    with pytest.raises(InvalidRequest, match="66 bytes, over the payload limit of 64"):
        encode_payload(fits + "é", LIMIT)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a\x00b", "NUL"),
        ("a\ud800b", "lone surrogate"),
        ([[[[["deep"]]]]], "nest"),
        (float("nan"), "NaN"),
        ({1, 2}, "not JSON"),
    ],
)
def test_each_refusal_names_its_reason(value: Any, message: str) -> None:
    for encode in (encode_json, encode_payload):
        with pytest.raises(InvalidRequest, match=message):
            encode(value, 1 << 20, max_depth=DEPTH)
