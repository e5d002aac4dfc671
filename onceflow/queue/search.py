"""The dashboard's request search: filters, a pasted id, newest first, keyset pages.

Every query shape reads an index in the order it returns rows (or a few index entries it
then sorts), never the table:

* a workspace: ``ix_wpr_workspace (workspace_id, created_at)``;
* a job (``job``, with or without ``branch``): ``ix_wpr_job (job_id, created_at)``;
* a pasted id (``q``): ``ix_wpr_request_id`` (the id, or a prefix of at least
  :data:`PREFIX_MIN` hex digits as a range) OR-ed with ``ix_wpr_job`` (a job id);
* anything else (stage, worker class, status, a time range, nothing): ``ix_wpr_created
  (created_at)`` read newest first, the other filters checked on the rows it reaches.

A reader limited to some workspaces (``Filters.scope``) lists only their requests: the
scope is one more condition, checked on the rows the chosen index reaches; a workspace
filter outside the scope is refused by the route before any statement runs.

A page is ``created_at DESC, workspace_id DESC, request_id DESC`` (unique: the table's key
breaks ties; the ids compared by code point, ``COLLATE "C"``, whatever the database's
collation, as Python compares them when it merges shards' pages), cut at ``limit``; the
next page starts after the last row's key (keyset: no row repeated or skipped while rows
are added). A database split by workspace: each shard is asked for a page, the pages merge
in that order and are cut again (:func:`search`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Engine

from onceflow.db import bounded_read, fetch_all, retry_disconnect
from onceflow.errors import InvalidRequest
from onceflow.ids import check_id
from onceflow.models.scopes import WorkspaceScope, like_patterns
from onceflow.models.status import Status
from onceflow.queue.overview import per_shard

LIMIT_MAX: Final = 200
LIMIT_DEFAULT: Final = 50
#: The shortest pasted request-id prefix searched as a prefix (shorter: exact ids only).
PREFIX_MIN: Final = 8
_HEX: Final = re.compile(r"[0-9a-f]+")
_ID_HEX_LEN: Final = 64  # a request id derived from its key: sha256 hex

_T = "workspace_process_requests"
COLUMNS: Final = (
    "request_id", "workspace_id", "job_id", "branch_path", "stage", "worker_class", "status",
    "attempts", "created_at", "updated_at", "finished_at",
)  # fmt: skip

# Each filter's condition (parameters by the filter's name); ORDER and the cursor's below.
_CONDITIONS: Final = {
    "workspace": "w.workspace_id = %(workspace)s",
    "job": "w.job_id = %(job)s",
    "branch": "w.branch_path = %(branch)s",
    "stage": "w.stage = %(stage)s",
    "worker_class": "w.worker_class = %(worker_class)s",
    "status": "w.status = %(status)s",
    "since": "w.created_at >= %(since)s",
    "until": "w.created_at < %(until)s",
    # Hex digits sort before 'g' in every collation: [q, q || 'g') holds exactly the ids
    # that start with q (read as a range of ix_wpr_request_id).
    "q_prefix": "(w.job_id = %(q)s OR (w.request_id >= %(q)s AND w.request_id < %(q_end)s))",
    "q": "(w.request_id = %(q)s OR w.job_id = %(q)s)",
    "cursor": (
        '(w.created_at, w.workspace_id COLLATE "C", w.request_id COLLATE "C")'
        " < (%(c_at)s, %(c_ws)s, %(c_id)s)"
    ),
    # A reader limited to some workspaces: its exact ids and prefixes as escaped LIKE
    # patterns (onceflow.models.scopes.like_patterns), checked on the rows the index reaches.
    "scope": "w.workspace_id LIKE ANY(CAST(%(ws_like)s AS text[]))",
}
# The ids compare by code point (COLLATE "C") whatever the database's collation: the same
# order as the merge of the shards' pages in Python (search) and as the cursor's.
_ORDER: Final = 'w.created_at DESC, w.workspace_id COLLATE "C" DESC, w.request_id COLLATE "C" DESC'


@dataclass(frozen=True, slots=True)
class Filters:
    """What to find; None: any. ``q`` is a pasted request id (or its prefix) or job id.
    ``scope``: the workspaces the reader may list (None: every workspace)."""

    workspace: str | None = None
    job: str | None = None
    branch: str | None = None
    stage: str | None = None
    worker_class: str | None = None
    status: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    q: str | None = None
    scope: WorkspaceScope | None = None


def checked(filters: Filters) -> Filters:
    """``filters`` as given, or :class:`InvalidRequest` naming the bad one."""
    for name in ("workspace", "job", "stage", "worker_class"):
        value = getattr(filters, name)
        if value is not None:
            check_id(name, value)
    if filters.branch is not None:
        check_id("branch", filters.branch, max_len=500, allow_empty=True)
    if filters.status is not None and filters.status not in {s.value for s in Status}:
        raise InvalidRequest(
            f"status must be one of {', '.join(s.value for s in Status)}, not {filters.status!r}"
        )
    for name in ("since", "until"):
        value = getattr(filters, name)
        if value is not None and value.tzinfo is None:
            raise InvalidRequest(f"{name} must be an ISO 8601 timestamp with a zone")
    if filters.since and filters.until and filters.since >= filters.until:
        raise InvalidRequest("since must be before until")
    if filters.q is not None:
        check_id("q", filters.q)
    return filters


def parse_time(name: str, value: str | None) -> datetime | None:
    """An ISO 8601 timestamp with a zone, or :class:`InvalidRequest`."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{name} must be an ISO 8601 timestamp with a zone") from None
    if parsed.tzinfo is None:
        raise InvalidRequest(f"{name} must be an ISO 8601 timestamp with a zone")
    return parsed


def _is_prefix(q: str) -> bool:
    return PREFIX_MIN <= len(q) < _ID_HEX_LEN and _HEX.fullmatch(q) is not None


def search_sql(filters: Filters, *, cursor: bool, limit: int) -> str:
    """The statement for ``filters`` (and a cursor), reading at most ``limit`` rows."""
    parts = []
    for name in ("workspace", "job", "branch", "stage", "worker_class", "status", "since",
                 "until"):  # fmt: skip
        if getattr(filters, name) is not None:
            parts.append(_CONDITIONS[name])
    if filters.q is not None:
        parts.append(_CONDITIONS["q_prefix" if _is_prefix(filters.q) else "q"])
    if filters.scope is not None:
        parts.append(_CONDITIONS["scope"])
    if cursor:
        parts.append(_CONDITIONS["cursor"])
    where = " AND ".join(parts) or "true"
    return (
        f"SELECT {', '.join('w.' + c for c in COLUMNS)}\nFROM {_T} w\nWHERE {where}\n"
        f"ORDER BY {_ORDER}\nLIMIT {int(limit)}"
    )


def search_params(filters: Filters, after: tuple[datetime, str, str] | None) -> dict[str, Any]:
    """The statement's parameters."""
    params: dict[str, Any] = {
        name: getattr(filters, name)
        for name in (
            "workspace",
            "job",
            "branch",
            "stage",
            "worker_class",
            "status",
            "since",
            "until",
            "q",
        )
    }
    if filters.q is not None and _is_prefix(filters.q):
        params["q_end"] = filters.q + "g"
    if filters.scope is not None:
        params["ws_like"] = like_patterns(filters.scope)
    if after is not None:
        params["c_at"], params["c_ws"], params["c_id"] = after
    return params


def encode_cursor(row: dict[str, Any]) -> str:
    """The opaque cursor after ``row`` (its sort key)."""
    key = [row["created_at"].isoformat(), row["workspace_id"], row["request_id"]]
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str, str]:
    """The sort key a cursor holds, or :class:`InvalidRequest`."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, ws, rid = json.loads(raw)
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not isinstance(ws, str) or not isinstance(rid, str):
            raise ValueError
        return when, check_id("workspace_id", ws), check_id("request_id", rid)
    except (ValueError, TypeError, binascii.Error, InvalidRequest):
        raise InvalidRequest(
            "cursor is not one this route returned: send a page's `next` unchanged"
        ) from None


def _sort_key(row: dict[str, Any]) -> tuple[datetime, str, str]:
    return (row["created_at"], row["workspace_id"], row["request_id"])


def search(
    engines: Engine | Sequence[Engine],
    filters: Filters,
    *,
    limit: int = LIMIT_DEFAULT,
    cursor: str | None = None,
) -> dict[str, Any]:
    """One page: ``{"items", "next", "limit", "shards_unavailable"}`` (module docstring)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIMIT_MAX:
        raise InvalidRequest(f"limit must be an integer in [1, {LIMIT_MAX}]")
    filters = checked(filters)
    after = decode_cursor(cursor) if cursor is not None else None
    statement = search_sql(filters, cursor=after is not None, limit=limit + 1)
    params = search_params(filters, after)

    def read(engine: Engine) -> list[dict[str, Any]]:
        def once() -> list[dict[str, Any]]:
            with bounded_read(engine) as raw:
                return fetch_all(raw, statement, params)

        return retry_disconnect(once)

    pages, down = per_shard(engines, read)
    rows = sorted((r for page in pages for r in page), key=_sort_key, reverse=True)
    more = len(rows) > limit
    rows = rows[:limit]
    items = [
        {c: (r[c].isoformat() if isinstance(r[c], datetime) else r[c]) for c in COLUMNS}
        for r in rows
    ]
    return {
        "items": items,
        "next": encode_cursor(rows[-1]) if more else None,
        "limit": limit,
        "shards_unavailable": down,
    }


__all__ = [
    "LIMIT_DEFAULT",
    "LIMIT_MAX",
    "PREFIX_MIN",
    "Filters",
    "decode_cursor",
    "encode_cursor",
    "parse_time",
    "search",
    "search_sql",
]
