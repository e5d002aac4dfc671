"""The ``/v1`` op routes: write an op once, read a sub-document, catch up on ops since a clock."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.responses import _responses
from onceflow.integrations.fastapi.services import OnceflowServices
from onceflow.oplog import ApplyResult

REPLAY_HEADER = "Idempotent-Replayed"


# Route decorators alike by shape on purpose: FastAPI builds the OpenAPI contract from each one.
def _op_routes(router: APIRouter, svc: OnceflowServices) -> None:
    @router.post(
        "/workspaces/{ws}/sub-docs/{sub_doc}/ops",
        operation_id="apply_op",
        tags=["ops"],
        status_code=201,
        response_description="Recorded by this call",
        response_model=s.ApplyOut,
        responses={
            200: {
                "model": s.ApplyOut,
                "description": "A replay of a known op id: the original clock and result",
                "headers": {REPLAY_HEADER: {"description": "true", "schema": {"type": "string"}}},
            },
            **_responses(409, 413, 503),
        },
    )
    async def apply_op(
        ws: s.WorkspacePath, sub_doc: s.SubDocPath, body: s.OpIn, response: Response
    ) -> s.ApplyOut:
        """Apply an op once by its op id: 201 when recorded now, 200 for a replay.

        The same op id with another payload is 409 op_id_conflict; an op the state
        cannot take is recorded with its error (``applied=false``), so its retry
        gets the same answer.
        """
        result = await svc.async_oplog.apply_op(
            ws, sub_doc, body.op, body.op_id, base_clock=body.base_clock
        )
        return _apply_out(result, response)

    @router.get(
        "/workspaces/{ws}/sub-docs/{sub_doc}",
        operation_id="get_sub_doc",
        tags=["ops"],
        response_model=s.SubDocOut,
        responses=_responses(503),
    )
    async def get_sub_doc(ws: s.WorkspacePath, sub_doc: s.SubDocPath) -> s.SubDocOut:
        """The sub-doc's state and commit clock."""
        doc = await svc.async_oplog.get_sub_doc(ws, sub_doc)
        return s.SubDocOut(
            workspace_id=doc.workspace_id, sub_doc=doc.sub_doc, clock=doc.clock, state=doc.state
        )

    @router.get(
        "/workspaces/{ws}/sub-docs/{sub_doc}/ops",
        operation_id="ops_since",
        tags=["ops"],
        response_model=s.OpsOut,
        responses=_responses(503),
    )
    async def ops_since(
        ws: s.WorkspacePath,
        sub_doc: s.SubDocPath,
        since: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> s.OpsOut:
        """Applied ops with a clock above ``since``, in clock order (a tab catching up)."""
        records = await svc.async_oplog.ops_since(ws, sub_doc, since, limit=limit)
        return s.OpsOut(
            ops=[
                s.OpOut(
                    op_id=r.op_id,
                    clock=r.clock,
                    op_type=r.op_type,
                    payload=r.payload,
                    result=r.result,
                    fence=r.fence,
                    committed_at=r.committed_at,
                )
                for r in records
            ]
        )


def _apply_out(result: ApplyResult, response: Response) -> s.ApplyOut:
    if result.duplicate:
        response.status_code = 200
        response.headers[REPLAY_HEADER] = "true"
    else:
        response.status_code = 201
    return s.ApplyOut(
        workspace_id=result.workspace_id,
        sub_doc=result.sub_doc,
        op_id=result.op_id,
        clock=result.clock,
        duplicate=result.duplicate,
        applied=result.applied,
        result=result.result,
        error=result.error,
        committed_at=result.committed_at,
    )
