"""JSON payloads: canonical encoding, hashing and the size limit. JSON only, never pickle."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from onceflow.errors import InvalidRequest, PayloadTooLarge

JSON = Any  # a JSON-able value: dict, list, str, int, float, bool or None


def canonical_json(value: JSON, *, what: str = "input") -> str:
    """Encode ``value`` canonically (sorted keys, no spaces), rejecting what jsonb cannot hold."""
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{what} is not JSON: {exc}") from None
    if "\\u0000" in text:
        # Postgres jsonb cannot store NUL in strings; refuse it here rather than as a driver error.
        raise InvalidRequest(f"{what} contains a NUL character (\\u0000), which jsonb cannot store")
    return text


def encode_payload(value: JSON, limit: int, *, what: str = "input") -> tuple[str, str]:
    """Canonical JSON text and its sha256, or an error when over ``limit`` bytes."""
    text = canonical_json(value, what=what)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{what} contains a lone surrogate: not valid UTF-8") from None
    if len(data) > limit:
        raise PayloadTooLarge(what, len(data), limit)
    return text, hashlib.sha256(data).hexdigest()
