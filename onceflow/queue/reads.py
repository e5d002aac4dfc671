"""Reads of the layer-1 store: one request, a live claim, a filtered list, counts.

Operations of both APIs (:class:`~onceflow.Queue` and :class:`~onceflow.AsyncQueue`):
each is written once as steps (see :mod:`onceflow.connector`).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from onceflow.connector import (
    Query,
    Steps,
    all_rows,
    on_every_shard,
    one_row,
    operation,
    retrying,
)
from onceflow.errors import InvalidRequest, NotFound
from onceflow.ids import check_id
from onceflow.models.requests import Request
from onceflow.models.scopes import WorkspaceScope, scope_params
from onceflow.models.status import Status, parse_status
from onceflow.queue import sql
from onceflow.settings import Settings

LIST_LIMIT_MAX = 1000


def request_key(request_id: str, workspace_id: str | None) -> dict[str, Any]:
    """A request's key for a statement, checked: its id, and its workspace when the caller
    knows it (None: the row is found by its id alone)."""
    check_id("request_id", request_id)
    if workspace_id is not None:
        check_id("workspace_id", workspace_id)
    return {"request_id": request_id, "workspace_id": workspace_id}


def one(query: Query, params: dict[str, Any]) -> Steps[Any]:
    """A read's first row (or None), repeated once on a fresh connection after a lost one."""
    return retrying(lambda: one_row(query, params))


def every(query: Query, params: dict[str, Any]) -> Steps[builtins.list[Any]]:
    """A read's rows, repeated once on a fresh connection after a lost one."""
    return retrying(lambda: all_rows(query, params))


class ReadOps:
    """Reads of the layer-1 store (a mixin of both queue APIs)."""

    settings: Settings

    @operation
    def get(self, request_id: str, *, workspace_id: str | None = None) -> Steps[Request]:
        """The request with this id (in ``workspace_id``, when given), or :class:`NotFound`."""
        row = yield from one(sql.GET, request_key(request_id, workspace_id))
        if row is None:
            raise NotFound(request_id)
        return Request.from_row(row)

    @operation
    def live_claim(
        self,
        request_id: str,
        token: str,
        *,
        worker_classes: Sequence[str] | None = None,
        workspace_id: str | None = None,
        workspaces: WorkspaceScope | None = None,
    ) -> Steps[Request | None]:
        """The request if it runs under ``token`` with a live lease (DB clock), else None.

        ``worker_classes`` and ``workspaces`` scope it (an HTTP worker key's classes and
        workspaces; None: any). A read, not a fence: it
        holds nothing, so a write that must not outlive the
        claim still fences in its own statement (``fence_check``, the fenced updates).
        """
        scope = None if worker_classes is None else builtins.list(worker_classes)
        params = {
            **request_key(request_id, workspace_id), "token": token, "now": None,
            "worker_classes": scope, **scope_params(workspaces),
        }  # fmt: skip
        row = yield from one(sql.LIVE_CLAIM, params)
        return None if row is None else Request.from_row(row)

    @operation
    def list(
        self,
        *,
        workspace_id: str | None = None,
        status: str | Sequence[str] | None = None,
        worker_class: str | None = None,
        stage: str | None = None,
        job_id: str | None = None,
        limit: int = 100,
    ) -> Steps[builtins.list[Request]]:
        """Requests matching every given filter, newest first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= LIST_LIMIT_MAX:
            raise InvalidRequest(f"limit must be an integer in [1, {LIST_LIMIT_MAX}]")
        values = {
            "workspace_id": workspace_id, "worker_class": worker_class,
            "stage": stage, "job_id": job_id,
        }  # fmt: skip
        params: dict[str, Any] = {}
        for name, value in values.items():
            if value is not None:
                params[name] = check_id(name, value)
        if status is not None:
            statuses = [status] if isinstance(status, str) else builtins.list(status)
            params["statuses"] = [parse_status(s).value for s in statuses]
        given = {*params, *(["status"] if status is not None else [])}
        filters = tuple(f for f in sql.LIST_FILTERS if f in given)
        query = sql.list_query(filters, limit)
        if workspace_id is not None:  # one workspace: its shard (routed by the parameter)
            rows = yield from every(query, params)
        else:  # every shard's newest, merged as the statement orders them, cut at limit
            parts = yield from on_every_shard(lambda: every(query, params))
            rows = sorted(
                (r for part in parts for r in part),
                key=lambda r: (-r["created_at"].timestamp(), r["request_id"]),
            )[:limit]
        return [Request.from_row(r) for r in rows]

    @operation
    def counts(self, workspace_id: str | None = None) -> Steps[dict[str, dict[str, int]]]:
        """Request counts as ``{worker_class: {status: n}}`` (every status present, zeros too);
        of one workspace's requests if ``workspace_id`` is given, else of all."""
        if workspace_id is None:
            parts = yield from on_every_shard(lambda: every(sql.COUNTS, {}))
            rows = [r for part in parts for r in part]
        else:
            check_id("workspace_id", workspace_id)
            rows = yield from every(sql.COUNTS_FOR_WORKSPACE, {"workspace_id": workspace_id})
        out: dict[str, dict[str, int]] = {}
        for row in rows:
            per_class = out.setdefault(row["worker_class"], {s.value: 0 for s in Status})
            per_class[row["status"]] += int(row["n"])
        return out
