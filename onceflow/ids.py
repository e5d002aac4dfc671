"""Identifiers: deterministic request ids, claim tokens, and validation of caller ids.

A deterministic request id is ``sha256`` over a canonical encoding of
``(workspace_id, job_id, branch_path, stage)``: a JSON array (strings escaped by
JSON's rules, so no separator inside a part can make two tuples collide),
prefixed by a version tag, encoded as UTF-8. The encoding is frozen: changing it
would stop duplicates from collapsing across versions, so the tests pin vectors.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import uuid
from typing import NewType

from onceflow.errors import InvalidRequest

RequestId = NewType("RequestId", str)
ClaimToken = NewType("ClaimToken", str)

ID_MAX = 200
BRANCH_PATH_MAX = 500
_REQUEST_ID_TAG = "onceflow.request.v1"
#: JSON's string escaping with ``ensure_ascii=False`` (C, as json.dumps uses it).
_quote = json.encoder.encode_basestring
_TAG_JSON = _quote(_REQUEST_ID_TAG)


def check_id(name: str, value: object, *, max_len: int = ID_MAX, allow_empty: bool = False) -> str:
    """Return ``value`` if it is a usable id string, else raise :class:`InvalidRequest`."""
    # The common case in one test: a printable str holds no lone surrogate (category Cs is
    # not printable), so only emptiness and the length are left to check.
    if (
        type(value) is str
        and value.isprintable()
        and (value or allow_empty)
        and len(value) <= max_len
    ):
        return value
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidRequest(f"{name} must not be empty")
    if len(value) > max_len:
        raise InvalidRequest(f"{name} is {len(value)} characters, over the limit of {max_len}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{name} is not valid UTF-8 (a lone surrogate)") from None
    if not value.isprintable():
        # Control characters (NUL above all) cannot be stored in Postgres text or shown safely.
        raise InvalidRequest(f"{name} contains control characters")
    return value


#: A worker class: it names a broker queue (``onceflow.wc.<class>``), so it is kept to
#: characters no broker, Redis key scheme or shell treats specially.
WORKER_CLASS_MAX = 100
_WORKER_CLASS_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{WORKER_CLASS_MAX - 1}}}")


def check_worker_class(value: object, *, name: str = "worker_class") -> str:
    """Return ``value`` if it is a usable worker class, else raise :class:`InvalidRequest`.

    1 to 100 characters from ``A-Z a-z 0-9 _ . -``, starting with a letter or digit.
    """
    if not isinstance(value, str) or not _WORKER_CLASS_RE.fullmatch(value):
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise InvalidRequest(
            f"{name} {shown!r} is not a worker class: 1-{WORKER_CLASS_MAX} characters from "
            "A-Z a-z 0-9 _ . - starting with a letter or digit"
        )
    return value


def request_id_for(workspace_id: str, job_id: str, branch_path: str, stage: str) -> RequestId:
    """The deterministic request id of a deduplicated stage (stable across versions)."""
    check_id("workspace_id", workspace_id)
    check_id("job_id", job_id)
    check_id("branch_path", branch_path, max_len=BRANCH_PATH_MAX, allow_empty=True)
    check_id("stage", stage)
    return derive_request_id(workspace_id, job_id, branch_path, stage)


def derive_request_id(workspace_id: str, job_id: str, branch_path: str, stage: str) -> RequestId:
    """:func:`request_id_for` of parts already checked (the enqueue path checks them first)."""
    # json.dumps([tag, *parts], ensure_ascii=False, separators=(",", ":")), written out:
    # the same string escaper json.dumps uses, without building an encoder per call.
    parts = ",".join(
        (_TAG_JSON, _quote(workspace_id), _quote(job_id), _quote(branch_path), _quote(stage))
    )
    canonical = f"[{parts}]"
    return RequestId(hashlib.sha256(canonical.encode("utf-8")).hexdigest())


def random_request_id() -> RequestId:
    """A fresh id for a stage that is not deduplicated (32 hex chars, never a sha256)."""
    return RequestId(uuid.uuid4().hex)


def new_claim_token() -> ClaimToken:
    """A fresh 128-bit claim token from ``secrets``."""
    return ClaimToken(secrets.token_hex(16))
