"""Spend and budgets over HTTP, for operators: ``/dashboard/api/spend…``.

Operator routes like the dashboard's (:func:`~onceflow.integrations.fastapi.guard.
operator_route_class`: GET needs a ``viewer`` key, PUT and DELETE an ``admin`` one), and
like them not in ``/openapi.json``, which documents the API of API and worker keys; they
are described in docs/spend-budgets.md. Bodies and queries are validated (422 with the
API's error shape); an unknown workspace is 422 too, and nothing is written.

* ``GET /dashboard/api/spend`` — the ledger summed by ``by`` (:func:`onceflow.spend.spend`);
* ``GET /dashboard/api/spend/budgets`` — budgets with their current period's standing;
* ``PUT /dashboard/api/spend/budgets/{ws}/{period}`` — set a budget (admin);
* ``DELETE /dashboard/api/spend/budgets/{ws}/{period}`` — remove it (admin);
* ``GET /dashboard/api/spend/savings`` — the compute lock's saved calls, priced from the
  ledger (:func:`onceflow.spend.priced_savings`).

An operator key limited to some workspaces reads and changes only theirs: the reports,
budgets and savings list its workspaces alone, and a workspace outside them, named in a
query or a path, is 403 with nothing read or changed.
"""

from __future__ import annotations

import logging
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from onceflow.integrations.fastapi.guard import operator_route_class, readable, request_operator
from onceflow.integrations.fastapi.schemas import WorkspaceIdStr
from onceflow.locks.savings import read_savings
from onceflow.redis_clients import REDIS_OR_OS_ERRORS
from onceflow.spend import Databases, budgets, clear_budget, priced_savings, set_budget, spend

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.services import OnceflowServices

log = logging.getLogger("onceflow.dashboard")

Period = Literal["day", "month"]


class BudgetIn(BaseModel):
    """A budget's limits: money, tokens, or both."""

    model_config = ConfigDict(extra="forbid")

    limit_cost: Decimal | None = Field(
        default=None, description="The limit in money (a decimal string or number), >= 0."
    )
    limit_tokens: int | None = Field(default=None, description="The limit in tokens, >= 0.")
    on_exceeded: Literal["fail", "wait"] = Field(
        default="fail", description="A refused call fails its stage, or waits for the next period."
    )
    allow_new: bool = Field(
        default=False, description="Allow a workspace with no request, sub-doc or spend yet."
    )


def _databases(services: OnceflowServices) -> Databases:
    queue = services.queue
    engines = [shard.engine for shard in queue.shards()]
    return Databases(queue.shard_map, engines=engines)


def create_spend_router(services: OnceflowServices) -> APIRouter:
    """The spend and budget routes of ``services`` (operator keys)."""
    svc = services
    api = APIRouter(
        prefix="/dashboard/api/spend",
        route_class=operator_route_class(svc),
        include_in_schema=False,
    )

    @api.get("", operation_id="spend_report")
    async def report(
        request: Request,
        workspace_id: WorkspaceIdStr | None = None,
        provider: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        by: list[str] = Query(default=["workspace", "stage", "provider"]),  # noqa: B008
    ) -> JSONResponse:
        """Settled spend summed by ``by`` (repeat it), the costliest groups first."""
        operator = request_operator(request)
        if workspace_id is not None:
            readable(operator, workspace_id)
        found = await run_in_threadpool(
            lambda: spend(
                _databases(svc),
                workspace_id=workspace_id,
                provider=provider,
                since=since,
                until=until,
                by=by,
                scope=operator.workspaces,
            )
        )
        return JSONResponse(found, headers={"Cache-Control": "no-store"})

    @api.get("/budgets", operation_id="spend_budgets")
    async def list_budgets(
        request: Request, workspace_id: WorkspaceIdStr | None = None
    ) -> JSONResponse:
        """Budgets (one workspace's, or all the key may read) with their period's spend."""
        operator = request_operator(request)
        if workspace_id is not None:
            readable(operator, workspace_id)
        found = await run_in_threadpool(lambda: budgets(workspace_id, database=_databases(svc)))
        shown = [b.as_dict() for b in found if operator.may_read(b.workspace_id)]
        return JSONResponse({"budgets": shown})

    @api.put("/budgets/{ws}/{period}", operation_id="spend_budget_set")
    async def put_budget(
        ws: WorkspaceIdStr, period: Period, body: BudgetIn, request: Request
    ) -> JSONResponse:
        """Set (or replace) a workspace's budget for a period."""
        readable(request_operator(request), ws)
        made = await run_in_threadpool(
            lambda: set_budget(
                ws,
                period,
                limit_cost=body.limit_cost,
                limit_tokens=body.limit_tokens,
                on_exceeded=body.on_exceeded,
                allow_new=body.allow_new,
                database=_databases(svc),
            )
        )
        log.info("budget set: %s %s by operator %s", ws, period, _key_id(request))
        return JSONResponse(made.as_dict())

    @api.delete("/budgets/{ws}/{period}", operation_id="spend_budget_clear")
    async def delete_budget(ws: WorkspaceIdStr, period: Period, request: Request) -> JSONResponse:
        """Remove a workspace's budget for a period (``cleared`` is empty if there was none)."""
        readable(request_operator(request), ws)
        cleared = await run_in_threadpool(
            lambda: clear_budget(ws, period, database=_databases(svc))
        )
        log.info("budget cleared: %s %s by operator %s", ws, period, _key_id(request))
        return JSONResponse({"workspace_id": ws, "cleared": cleared})

    @api.get("/savings", operation_id="spend_savings")
    async def savings(request: Request) -> JSONResponse:
        """The compute lock's saved calls per workspace, priced at each workspace's average
        settled cost of a call (an estimate; None where the ledger has no priced call); of
        the workspaces the key may read."""
        operator = request_operator(request)

        def read() -> dict[str, Any]:
            try:
                counted = read_savings(svc.oplog.redis())
            except REDIS_OR_OS_ERRORS as exc:
                return {"error": f"Redis: {type(exc).__name__}"}
            if operator.workspaces is not None:
                rows = [r for r in counted["workspaces"] if operator.may_read(r["workspace_id"])]
                counted = {**counted, "workspaces": rows, "workspaces_total": len(rows)}
            return priced_savings(counted, _databases(svc))

        return JSONResponse(await run_in_threadpool(read))

    return api


def _key_id(request: Request) -> str:
    operator: Any = getattr(request.state, "onceflow_operator", None)
    return str(getattr(operator, "key_id", "?"))


__all__ = ["BudgetIn", "create_spend_router"]
