"""Reads of the layer-1 store: one request, a live claim, a filtered list, counts.

Mixed into :class:`~onceflow.queue.Queue`.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, bindparam, select

from onceflow.db import (
    fetch_all,
    fetch_one,
    raw_connection,
    retry_disconnect,
    translate_errors,
)
from onceflow.errors import InvalidRequest, NotFound
from onceflow.ids import check_id
from onceflow.models.requests import Request
from onceflow.models.status import Status, parse_status
from onceflow.models.tables import workspace_process_requests as wpr
from onceflow.queue import sql
from onceflow.settings import Settings

LIST_LIMIT_MAX = 1000


class ReadOps:
    """Reads of the layer-1 store (a mixin of :class:`~onceflow.queue.Queue`)."""

    engine: Engine
    settings: Settings

    def get(self, request_id: str) -> Request:
        """The request with this id, or :class:`NotFound`."""
        check_id("request_id", request_id)
        row = retry_disconnect(lambda: self._read_one(sql.Q_GET, {"request_id": request_id}))
        if row is None:
            raise NotFound(request_id)
        return Request.from_row(row)

    def live_claim(self, request_id: str, token: str) -> Request | None:
        """The request if it runs under ``token`` with a live lease (DB clock), else None.

        A read, not a fence: it holds nothing, so a write that must not outlive the
        claim still fences in its own statement (``fence_check``, the fenced updates).
        """
        check_id("request_id", request_id)
        params = {"request_id": request_id, "token": token, "now": None}
        row = retry_disconnect(lambda: self._read_one(sql.Q_LIVE_CLAIM, params))
        return None if row is None else Request.from_row(row)

    def list(
        self,
        *,
        workspace_id: str | None = None,
        status: str | Sequence[str] | None = None,
        worker_class: str | None = None,
        stage: str | None = None,
        job_id: str | None = None,
        limit: int = 100,
    ) -> builtins.list[Request]:
        """Requests matching every given filter, newest first."""
        if not isinstance(limit, int) or not 1 <= limit <= LIST_LIMIT_MAX:
            raise InvalidRequest(f"limit must be an integer in [1, {LIST_LIMIT_MAX}]")
        query = select(*[wpr.c[name] for name in Request.__dataclass_fields__])
        filters: Mapping[str, str | None] = {
            "workspace_id": workspace_id, "worker_class": worker_class,
            "stage": stage, "job_id": job_id,
        }  # fmt: skip
        for name, value in filters.items():
            if value is not None:
                query = query.where(wpr.c[name] == check_id(name, value))
        if status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            values = [parse_status(s).value for s in statuses]
            query = query.where(wpr.c.status.in_(bindparam("statuses", values, expanding=True)))
        query = query.order_by(wpr.c.created_at.desc(), wpr.c.request_id).limit(limit)

        def read() -> builtins.list[Request]:
            with translate_errors(self.engine.url), self.engine.connect() as conn:
                return [Request.from_row(r) for r in conn.execute(query).mappings()]

        return retry_disconnect(read)

    def counts(self) -> dict[str, dict[str, int]]:
        """Request counts as ``{worker_class: {status: n}}`` (every status present, zeros too)."""
        out: dict[str, dict[str, int]] = {}
        for row in retry_disconnect(lambda: self._read_all(sql.Q_COUNTS, {})):
            per_class = out.setdefault(row["worker_class"], {s.value: 0 for s in Status})
            per_class[row["status"]] = row["n"]
        return out

    def _read_one(self, query: str, params: dict[str, Any]) -> Any:
        """The first row of one statement on a pooled connection (autocommit)."""
        with raw_connection(self.engine) as raw:
            return fetch_one(raw, query, params)

    def _read_all(self, query: str, params: dict[str, Any]) -> builtins.list[Any]:
        """Every row of a read on a pooled connection (safe to repeat: see retry_disconnect)."""
        with raw_connection(self.engine) as raw:
            return fetch_all(raw, query, params)
