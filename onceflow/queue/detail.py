"""One request, whole: the dashboard's request page (``GET /dashboard/api/requests/{id}``).

:func:`read_request` gathers, on the request's database, everything onceflow knows of one
request, as a JSON-able dict (the shape: docs/dashboard.md, "The request page"):

* the row itself (``workspace_process_requests``), found by its id (``ix_wpr_request_id``),
  or by its key when the workspace is given;
* its history (``workspace_request_attempts``, migration 0014): one row per claim that ended
  — completed, handed off, failed, rescued by the sweeper after its lease lapsed, overran
  its run bound — and per operator requeue or cancel, each written by the very statement
  that moved the row, so the history never disagrees with it;
* the hand-offs: the follow-ups its completion created (``handed_to``) and the request
  whose completion created it (a parent's end and its follow-ups' creation are one
  transaction: the same database time, ``ix_wra_ended``);
* the ops its claims wrote (``fence``, ``ix_ops_fence``) and its spend ledger rows
  (``ix_spend_ledger_request``), each list cut at :data:`LIST_LIMIT`;
* each run's compute-lock outcomes, as its end recorded them.

Every statement reads by the request's key (or an index on it), never a table's history.
The input, result and error are given as text (the stored JSON, indented, cut at
:data:`TEXT_CAP_BYTES`) and only to a reader that may read the workspace (``readable``);
to another reader each attempt's and each history event's error type and message are None
too;
times are the database's, as ISO 8601.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Engine

from onceflow.db import bounded_read, fetch_all, retry_disconnect
from onceflow.errors import InvalidRequest, NotFound
from onceflow.queue.sql import ATTEMPTS, RUN_ID, TABLE

#: The input, result and error are cut at this many bytes of UTF-8 text.
TEXT_CAP_BYTES: Final = 64 * 1024
#: At most this many ops and ledger rows are listed (the first, in order).
LIST_LIMIT: Final = 500
#: At most this many history rows are listed: the newest (the request's latest claims and
#: its outcome), the older ones cut (``history_truncated``).
HISTORY_LIMIT: Final = 1000

# The request by its id; by its key when the workspace is given. Two rows at most: an id
# that names rows of several workspaces is refused (the caller names the workspace).
ROW: Final = f"""
SELECT now() AS db_now, w.request_id, w.workspace_id, w.job_id, w.branch_path, w.stage,
       w.worker_class, w.status, w.priority, w.attempts, w.crash_attempts, w.max_attempts,
       w.max_crash_attempts, w.created_at, w.updated_at, w.finished_at, w.run_after,
       w.claimed_by, w.claimed_at, w.lease_seconds, w.lease_expires_at, w.heartbeat_at,
       w.cancel_requested, CASE WHEN w.status = 'running' THEN {RUN_ID} END AS run,
       w.input, w.result, w.error
FROM {TABLE} w
WHERE w.request_id = %(request_id)s
  AND (CAST(%(workspace_id)s AS text) IS NULL OR w.workspace_id = %(workspace_id)s)
LIMIT 2
"""

HISTORY: Final = f"""
SELECT a.seq, a.event, a.next_status, a.attempt, a.claimed_by, a.claimed_at, a.lease_seconds,
       a.heartbeat_at, a.ended_at, a.error_type, a.error_message, a.handed_to, a.locks
FROM {ATTEMPTS} a
WHERE a.workspace_id = %(workspace_id)s AND a.request_id = %(request_id)s
ORDER BY a.seq DESC
LIMIT {HISTORY_LIMIT + 1}
"""

# The completion that created this request: a hand-off's end and its follow-ups' creation
# are one transaction, so its end time is this row's created_at (ix_wra_ended).
HANDED_FROM: Final = f"""
SELECT a.request_id FROM {ATTEMPTS} a
WHERE a.workspace_id = %(workspace_id)s AND a.ended_at = %(created_at)s
  AND a.event = 'handed_off' AND CAST(%(request_id)s AS text) = ANY(a.handed_to)
ORDER BY a.request_id
LIMIT {LIST_LIMIT}
"""

OPS: Final = f"""
SELECT o.sub_doc, o.op_id, o.op_type, o.clock, o.committed_at, o.clock IS NULL AS rejected
FROM workspace_sub_doc_ops o
WHERE o.workspace_id = %(workspace_id)s AND o.fence = %(request_id)s
ORDER BY o.committed_at, o.clock NULLS LAST, o.sub_doc, o.op_id
LIMIT {LIST_LIMIT + 1}
"""

SPEND: Final = f"""
SELECT s.provider, s.model, s.cell_key, s.outcome, s.input_tokens, s.output_tokens, s.cost,
       s.saved_cost, s.recorded_at
FROM spend_ledger s
WHERE s.workspace_id = %(workspace_id)s AND s.request_id = %(request_id)s
ORDER BY s.recorded_at, s.permit_id
LIMIT {LIST_LIMIT + 1}
"""

#: Every statement of this module by name (pinned in tests/unit/test_statement_sql.py).
STATEMENTS: Final = {
    "detail.row": ROW,
    "detail.history": HISTORY,
    "detail.handed_from": HANDED_FROM,
    "detail.ops": OPS,
    "detail.spend": SPEND,
}

_REQUEST_FIELDS: Final = (
    "request_id", "workspace_id", "job_id", "branch_path", "stage", "worker_class", "status",
    "priority", "attempts", "crash_attempts", "max_attempts", "max_crash_attempts",
    "created_at", "updated_at", "finished_at", "run_after", "claimed_by", "claimed_at",
    "lease_seconds", "lease_expires_at", "heartbeat_at", "cancel_requested", "run",
)  # fmt: skip

#: A history row's event → the event the page shows for the claim's end.
_ENDED_AS: Final = {
    "succeeded": "succeeded",
    "handed_off": "handed_off",
    "failed": "failed",
    "rescued": "rescued",
    "overran": "overran",
}


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _number(value: Any) -> Any:
    return float(value) if isinstance(value, Decimal) else value


def as_text(value: Any, cap: int = TEXT_CAP_BYTES) -> dict[str, Any] | None:
    """A stored JSON value as text for a page (indented, keys sorted), cut at ``cap`` bytes
    of UTF-8 (``truncated``); None for none (SQL NULL)."""
    if value is None:
        return None
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    data = text.encode("utf-8")
    if len(data) <= cap:
        return {"text": text, "truncated": False}
    return {"text": data[:cap].decode("utf-8", errors="ignore"), "truncated": True}


def _find(
    engines: Sequence[Engine], request_id: str, workspace_id: str | None
) -> tuple[Engine, dict[str, Any]]:
    """The request's row and the engine of its database; NotFound, or InvalidRequest for an
    id that names requests of several workspaces."""
    params = {"request_id": request_id, "workspace_id": workspace_id}

    def read(engine: Engine) -> list[dict[str, Any]]:
        def once() -> list[dict[str, Any]]:
            with bounded_read(engine) as raw:
                return fetch_all(raw, ROW, params)

        return retry_disconnect(once)

    found: list[tuple[Engine, dict[str, Any]]] = []
    for engine in engines:
        found.extend((engine, row) for row in read(engine))
    if not found:
        raise NotFound(request_id)
    if len(found) > 1:
        raise InvalidRequest(
            f"request id {request_id!r} names requests of several workspaces: "
            "name the workspace (workspace_id)"
        )
    return found[0]


def _related(engine: Engine, row: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The history, hand-offs in, ops and spend of the request ``row`` (one checkout)."""
    key = {"workspace_id": row["workspace_id"], "request_id": row["request_id"]}

    def once() -> dict[str, list[dict[str, Any]]]:
        with bounded_read(engine) as raw:
            return {
                "history": fetch_all(raw, HISTORY, key),
                "from": fetch_all(raw, HANDED_FROM, {**key, "created_at": row["created_at"]}),
                "ops": fetch_all(raw, OPS, key),
                "spend": fetch_all(raw, SPEND, key),
            }

    return retry_disconnect(once)


def _attempts(
    row: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    *,
    withheld: bool,
    cut: bool = False,
) -> list[dict[str, Any]]:
    """Each claim of the request: those that ended (history rows with an attempt), a claim
    whose lease lapsed and was taken over by the next claim directly (no statement of its
    own ended it: known only as a missing attempt number), and the live one. ``withheld``:
    the error of each attempt is the request's payload too, so it is None. ``cut``: the
    history's oldest rows were cut, so an attempt number below the first one kept since the
    last requeue may only be missing from the cut, and is not shown as taken over."""
    out: list[dict[str, Any]] = []
    current: set[int] = set()  # attempt numbers that ended since the last requeue
    whole = not cut  # whether `current` holds every claim since the last requeue
    for h in history:
        if h["event"] == "requeued":
            current = set()
            whole = True
        if h["attempt"] is None:
            continue
        current.add(h["attempt"])
        out.append(
            {
                "attempt": h["attempt"],
                "claimed_by": h["claimed_by"],
                "claimed_at": _iso(h["claimed_at"]),
                "lease_seconds": h["lease_seconds"],
                "last_heartbeat_at": _iso(h["heartbeat_at"]),
                "ended_at": _iso(h["ended_at"]),
                "outcome": h["event"],
                "next_status": h["next_status"],
                "error_type": None if withheld else h["error_type"],
                "error_message": None if withheld else h["error_message"],
                "locks": list(h["locks"] or []),
            }
        )
    live = row["attempts"] if row["status"] == "running" else row["attempts"] + 1
    first = 1 if whole else min(current, default=live)
    for n in range(first, live):
        if n not in current:  # a lapsed lease taken over by the next claim
            out.append(_taken_over(n))
    if row["status"] == "running":
        out.append(
            {
                "attempt": row["attempts"],
                "claimed_by": row["claimed_by"],
                "claimed_at": _iso(row["claimed_at"]),
                "lease_seconds": row["lease_seconds"],
                "last_heartbeat_at": _iso(row["heartbeat_at"]),
                "ended_at": None,
                "outcome": "running",
                "next_status": None,
                "error_type": None,
                "error_message": None,
                "locks": [],
            }
        )
    return out


def _taken_over(attempt: int) -> dict[str, Any]:
    return {
        "attempt": attempt, "claimed_by": None, "claimed_at": None, "lease_seconds": None,
        "last_heartbeat_at": None, "ended_at": None, "outcome": "taken_over",
        "next_status": "running", "error_type": None, "error_message": None, "locks": [],
    }  # fmt: skip


def _history(
    row: Mapping[str, Any], history: Sequence[Mapping[str, Any]], *, withheld: bool
) -> list[dict[str, Any]]:
    """The request's events, oldest first: enqueued, each claim and its end, each operator
    move, and the live claim. ``withheld``: an end's error type and message are None."""
    events: list[dict[str, Any]] = [
        {"at": _iso(row["created_at"]), "event": "enqueued", "attempt": None, "detail": {}}
    ]
    for h in history:
        at, attempt = _iso(h["ended_at"]), h["attempt"]
        if attempt is not None and h["claimed_at"] is not None:
            events.append({
                "at": _iso(h["claimed_at"]), "event": "claimed", "attempt": attempt,
                "detail": {"claimed_by": h["claimed_by"], "lease_seconds": h["lease_seconds"]},
            })  # fmt: skip
        event = h["event"]
        if event in _ENDED_AS:
            detail: dict[str, Any] = {"next_status": h["next_status"]}
            if h["error_type"] is not None or h["error_message"] is not None:
                detail.update(  # the error is the request's payload: None when withheld
                    error_type=None if withheld else h["error_type"],
                    error_message=None if withheld else h["error_message"],
                )
            if event == "handed_off":
                detail["to"] = list(h["handed_to"] or [])
            if event == "rescued":
                detail["last_heartbeat_at"] = _iso(h["heartbeat_at"])
            events.append(
                {"at": at, "event": _ENDED_AS[event], "attempt": attempt, "detail": detail}
            )
            if h["next_status"] in ("dead", "cancelled"):
                events.append({
                    "at": at, "event": h["next_status"], "attempt": attempt,
                    "detail": {"by": "run"},
                })  # fmt: skip
        else:  # requeued, cancelled, cancel_requested: an operator's move
            events.append({"at": at, "event": event, "attempt": None, "detail": {"by": "operator"}})
    if row["status"] == "running" and row["claimed_at"] is not None:
        events.append({
            "at": _iso(row["claimed_at"]), "event": "claimed", "attempt": row["attempts"],
            "detail": {"claimed_by": row["claimed_by"], "lease_seconds": row["lease_seconds"]},
        })  # fmt: skip
    return events


def _actions(row: Mapping[str, Any], may_act: bool) -> dict[str, Any]:
    """What an operator may do to the row now (the dashboard's fenced requeue and cancel)."""
    status = row["status"]
    requeue = may_act and status in ("dead", "cancelled")
    cancel_queued = may_act and status == "queued"
    cancel_running = may_act and status == "running" and not row["cancel_requested"]
    version = _iso(row["updated_at"])
    return {
        "requeue": requeue,
        "cancel": cancel_queued or cancel_running,
        "requeue_version": version if requeue else None,
        "cancel_version": version if cancel_queued else None,
        "cancel_run": row["run"] if cancel_running else None,
    }


def read_request(
    engines: Engine | Sequence[Engine],
    request_id: str,
    *,
    workspace_id: str | None = None,
    readable: Callable[[str], bool] = lambda _ws: True,
    may_act: bool = False,
) -> dict[str, Any]:
    """Everything known of one request, as a JSON-able dict (module docstring).

    ``engines``: the request's database, or every shard's when its workspace is not known.
    ``readable(workspace_id)``: whether the reader may see the request's input, result and
    error (else ``withheld`` is true and they are None). ``may_act``: whether the reader may
    requeue or cancel (its role); ``actions`` adds what the row's status allows, and offers
    nothing on a workspace the reader may not read.
    Raises :class:`NotFound` (no such request) or :class:`InvalidRequest` (an id of several
    workspaces' requests, without ``workspace_id``).
    """
    shards = [engines] if isinstance(engines, Engine) else list(engines)
    engine, row = _find(shards, request_id, workspace_id)
    related = _related(engine, row)
    newest = related["history"]  # newest first, one more than kept: was anything cut?
    cut = len(newest) > HISTORY_LIMIT
    history = newest[:HISTORY_LIMIT][::-1]
    withheld = not readable(row["workspace_id"])
    attempts = _attempts(row, history, withheld=withheld, cut=cut)
    locks = [{**lock, "attempt": a["attempt"]} for a in attempts for lock in a["locks"]]
    handed_to = [rid for h in history for rid in (h["handed_to"] or [])]
    ops, spend = related["ops"], related["spend"]
    return {
        "db_now": _iso(row["db_now"]),
        "request": {name: _iso(row[name]) for name in _REQUEST_FIELDS},
        "withheld": withheld,
        "input": None if withheld else as_text(row["input"]),
        "result": None if withheld else as_text(row["result"]),
        "error": None if withheld else as_text(row["error"]),
        "history": _history(row, history, withheld=withheld),
        "history_truncated": cut,
        "attempts": attempts,
        "hand_offs": {"from": [r["request_id"] for r in related["from"]], "to": handed_to},
        "ops": [{k: _iso(v) for k, v in op.items()} for op in ops[:LIST_LIMIT]],
        "ops_truncated": len(ops) > LIST_LIMIT,
        "locks": locks,
        "spend": [{k: _number(_iso(v)) for k, v in line.items()} for line in spend[:LIST_LIMIT]],
        "spend_truncated": len(spend) > LIST_LIMIT,
        "actions": _actions(row, may_act and not withheld),
    }


__all__ = ["LIST_LIMIT", "STATEMENTS", "TEXT_CAP_BYTES", "as_text", "read_request"]
