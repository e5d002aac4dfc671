"""Reading spend: the ledger summed by workspace, stage, provider (or model, outcome), and
the average cost of a workspace's calls, which prices the calls the compute lock saved.

Every read runs on each database (each shard of a database split by workspace) and the
answers merge: sums added, groups joined. A shard that cannot be read is listed in
``shards_unavailable`` while another answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from onceflow.db import fetch_all, raw_connection, retry_disconnect
from onceflow.errors import InvalidRequest
from onceflow.ids import check_id
from onceflow.models.scopes import WorkspaceScope, like_patterns
from onceflow.spend import sql
from onceflow.spend.databases import Database, Databases, as_databases

#: The groups a report is summed by when none are named.
DEFAULT_BY = ("workspace", "stage", "provider")
#: The most groups one report returns (the costliest first).
REPORT_LIMIT = 1000
#: The window of ledger rows the price of a saved call is averaged over (days).
SAVINGS_WINDOW_DAYS = 30


def _check_by(by: Iterable[str]) -> list[str]:
    if isinstance(by, str):
        by = [by]
    names = list(by)
    for name in names:
        if name not in sql.GROUPS:
            raise InvalidRequest(
                f"cannot group spend by {name!r}: choose from {', '.join(sql.GROUPS)}"
            )
    if len(set(names)) != len(names):
        raise InvalidRequest(f"a group is named twice in {names}")
    return names


def _check_time(name: str, value: object) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidRequest(f"{name} must be a datetime with a time zone, or None")
    return value


def _json(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def spend(
    database: Database | Databases = None,
    *,
    workspace_id: str | None = None,
    provider: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    by: Sequence[str] = DEFAULT_BY,
    limit: int = REPORT_LIMIT,
    scope: WorkspaceScope | None = None,
) -> dict[str, Any]:
    """Settled spend from the ledger, summed by the groups ``by``; ``scope``: of those
    workspaces only (None: every workspace).

    ``by``: any of ``workspace``, ``stage``, ``provider``, ``model``, ``outcome`` (none: one
    total). ``since`` (inclusive) and ``until`` (exclusive) bound the rows' recording time
    (database clock). The answer, JSON-ready: ``rows`` — each group's ``calls``,
    ``input_tokens``, ``output_tokens``, ``cost`` (a decimal string), ``first_at`` and
    ``last_at``, the costliest first, at most ``limit``; ``total`` over the rows;
    ``truncated``; ``shards_unavailable``.
    """
    names = _check_by(by)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= REPORT_LIMIT:
        raise InvalidRequest(f"limit must be an integer from 1 to {REPORT_LIMIT}, not {limit!r}")
    ws = None if workspace_id is None else check_id("workspace_id", workspace_id)
    params: dict[str, Any] = {
        "ws": ws,
        "provider": None if provider is None else check_id("provider", provider),
        "since": _check_time("since", since),
        "until": _check_time("until", until),
        "limit": limit + 1,
    }
    if scope is not None:
        params["ws_like"] = like_patterns(scope)
    columns = [sql.GROUPS[n] for n in names]
    query = sql.report(columns, scoped=scope is not None)
    dbs = as_databases(database)

    def read(engine: Any) -> list[Any]:
        def once() -> list[Any]:
            with raw_connection(engine) as conn:
                return fetch_all(conn, query, params)

        return retry_disconnect(once)

    down: list[int] = []
    if ws is not None:
        answers = [read(dbs.of(ws))]
    else:
        answers, down = dbs.each(read)
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rows in answers:
        for row in rows:
            key = tuple(row[c] for c in columns)
            into = merged.get(key)
            if into is None:
                merged[key] = dict(row)
                continue
            for field in ("calls", "input_tokens", "output_tokens", "cost"):
                into[field] += row[field]
            into["first_at"] = min(into["first_at"], row["first_at"])
            into["last_at"] = max(into["last_at"], row["last_at"])
    ordered = sorted(merged.values(), key=lambda r: (-r["cost"], -r["calls"]))
    truncated = len(ordered) > limit
    ordered = ordered[:limit]
    total = {
        field: sum((r[field] for r in ordered), Decimal(0) if field == "cost" else 0)
        for field in ("calls", "input_tokens", "output_tokens", "cost")
    }
    renamed = {c: n for n, c in sql.GROUPS.items()}
    rows_out = [{renamed.get(k, k): _json(v) for k, v in row.items()} for row in ordered]
    return {
        "by": names,
        "rows": rows_out,
        "total": {k: _json(v) for k, v in total.items()},
        "truncated": truncated,
        "shards_unavailable": down,
    }


def average_call_cost(
    workspace_ids: Iterable[str],
    database: Database | Databases = None,
    *,
    days: int = SAVINGS_WINDOW_DAYS,
) -> dict[str, Decimal]:
    """Each workspace's average settled cost of a call made (``ok``, cost known) over the
    last ``days`` days; workspaces without such calls are left out."""
    names = sorted({check_id("workspace_id", ws) for ws in workspace_ids})
    if not names:
        return {}
    params = {"workspaces": names, "days": int(days)}
    dbs = as_databases(database)

    def read(engine: Any) -> list[Any]:
        def once() -> list[Any]:
            with raw_connection(engine) as conn:
                return fetch_all(conn, sql.AVERAGE_COST, params)

        return retry_disconnect(once)

    answers, _ = dbs.each(read)
    return {r["workspace_id"]: r["average_cost"] for rows in answers for r in rows}


def priced_savings(
    savings: dict[str, Any], database: Database | Databases = None
) -> dict[str, Any]:
    """The compute lock's savings (:func:`onceflow.locks.savings.read_savings`) in money.

    A saved call is priced at the workspace's average settled cost of a call made over the
    last :data:`SAVINGS_WINDOW_DAYS` days (the lock's counters do not say which provider a
    saved call would have gone to): ``saved_cost`` per workspace (None: no priced calls in
    the ledger yet) and ``saved_cost_total`` — an estimate, as a decimal string.
    """
    rows = savings.get("workspaces", [])
    prices = average_call_cost((r["workspace_id"] for r in rows), database)
    total = Decimal(0)
    out = []
    for row in rows:
        price = prices.get(row["workspace_id"])
        saved = None if price is None else price * int(row.get("saved", 0))
        if saved is not None:
            total += saved
        out.append({**row, "saved_cost": None if saved is None else str(saved)})
    return {**savings, "workspaces": out, "saved_cost_total": str(total)}


__all__ = [
    "DEFAULT_BY",
    "REPORT_LIMIT",
    "SAVINGS_WINDOW_DAYS",
    "average_call_cost",
    "priced_savings",
    "spend",
]
