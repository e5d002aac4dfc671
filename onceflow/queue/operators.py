"""What an operator does to a request: cancel, requeue; and the sweeper's undispatched mark.

Operations of both APIs (:class:`~onceflow.Queue` and :class:`~onceflow.AsyncQueue`),
each written once as steps (see :mod:`onceflow.connector`).
"""

from __future__ import annotations

from datetime import datetime

from onceflow.connector import Execute, FetchOne, Steps, operation
from onceflow.errors import InvalidTransition
from onceflow.metrics import record as metrics
from onceflow.models.requests import Request
from onceflow.models.status import Status
from onceflow.queue import sql
from onceflow.queue.reads import ReadOps, request_key
from onceflow.settings import Settings


class OperatorOps:
    """Operator actions of the layer-1 store (a mixin of both queue APIs)."""

    settings: Settings

    # Same shape as requeue on purpose: two operator actions, each its own fenced statement.
    @operation
    def cancel(
        self,
        request_id: str,
        *,
        now: datetime | None = None,
        expect: datetime | None = None,
        expect_run: str | None = None,
        workspace_id: str | None = None,
    ) -> Steps[Request]:
        """Cancel a queued request at once, or ask a running one to stop (its heartbeat says so).

        A finished request, or a running one asked to stop already, is returned unchanged
        (and not counted again in ``onceflow_requests_cancelled_total``). Fenced (an
        operator's cancel): with ``expect``, only a queued or running row last updated at
        ``expect`` moves; with ``expect_run``, only the running run of that identity
        (``sql.RUN_ID``, as the dashboard shows it); when nothing moved,
        :class:`InvalidTransition` is raised (the caller tells a repeat from a change).
        """
        key = request_key(request_id, workspace_id)
        params = {**key, "now": now, "expect": expect, "expect_run": expect_run}
        row = yield FetchOne(sql.CANCEL, params)
        if row is None:
            current = yield from ReadOps.get.steps(self, request_id, workspace_id=workspace_id)
            if expect is not None or expect_run is not None:
                raise InvalidTransition(request_id, current.status.value, "cancel")
            return current
        cancelled = Request.from_row(row)
        metrics.cancelled(cancelled)
        return cancelled

    @operation
    def requeue(
        self,
        request_id: str,
        *,
        now: datetime | None = None,
        expect: datetime | None = None,
        workspace_id: str | None = None,
    ) -> Steps[Request]:
        """Run a finished (succeeded, dead or cancelled) request again; refused while running.

        ``expect`` fences it: only a dead or cancelled row last updated at ``expect`` moves;
        any other row is left unchanged and :class:`InvalidTransition` is raised.
        """
        key = request_key(request_id, workspace_id)
        params = {**key, "now": now, "notify": self.settings.notify}
        row = yield FetchOne(sql.REQUEUE, {**params, "expect": expect})
        if row is not None:
            requeued = Request.from_row(row)
            metrics.requeued(requeued)
            return requeued
        current = yield from ReadOps.get.steps(self, request_id, workspace_id=workspace_id)
        if current.status is Status.RUNNING or expect is not None:
            raise InvalidTransition(request_id, current.status.value, "requeue")
        return current

    @operation
    def mark_undispatched(self, request_id: str, *, workspace_id: str | None = None) -> Steps[None]:
        """Note that a queued request's wake-up was not sent, so the next sweep sends one."""
        yield Execute(sql.MARK_UNDISPATCHED, request_key(request_id, workspace_id))
