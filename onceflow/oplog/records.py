"""The op log's values: op ids, and what an op, a sub-doc and the log answer."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from onceflow.errors import InvalidRequest

OP_ID_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"


def new_op_id() -> str:
    """A nanoid-style op id: 21 URL-safe characters from ``secrets`` (126 bits)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(21))


def check_op_id(op_id: object) -> str:
    """``op_id`` if it looks like a real id (16 to 64 URL-safe characters), else an error."""
    if not isinstance(op_id, str) or not OP_ID_RE.fullmatch(op_id):
        raise InvalidRequest("op_id must be 16-64 characters of A-Z a-z 0-9 _ -")
    return op_id


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of an op: its clock (None if rejected), and whether this was a replay."""

    workspace_id: str
    sub_doc: str
    op_id: str
    clock: int | None
    duplicate: bool
    result: Any
    error: Any
    committed_at: datetime

    @property
    def applied(self) -> bool:
        """True if the op changed the sub-doc (now or on its first attempt)."""
        return self.error is None

    def as_json(self) -> dict[str, Any]:
        """A JSON-able dict for APIs."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["committed_at"] = self.committed_at.isoformat()
        return out


# Records as frozen dataclasses (alike by shape): each names its own fields.
@dataclass(frozen=True, slots=True)
class SubDoc:
    """A sub-doc's state at a commit clock."""

    workspace_id: str
    sub_doc: str
    clock: int
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One applied op, as ``ops_since`` returns it."""

    op_id: str
    clock: int
    op_type: str
    payload: dict[str, Any]
    result: Any
    fence: str | None
    committed_at: datetime


def stage_op_id(request_id: str, key: str) -> str:
    """A deterministic op id for a stage's write: a retry of the stage joins the first write."""
    digest = hashlib.sha256(json.dumps([request_id, key]).encode()).digest()
    return "stg-" + digest.hex()[:40]
