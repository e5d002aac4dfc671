"""The ``/v1`` request routes: enqueue, read, list, count, and the workspace's event stream.

``async def`` on the services' :class:`~onceflow.AsyncQueue`: a request waiting on the
database holds no thread of the pool; only the Celery wake-up (a blocking kombu publish)
is sent from a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from onceflow.errors import NotFound, WaitTimeout
from onceflow.ids import WORKER_CLASS_MAX, check_id
from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.auth import PrincipalDep
from onceflow.integrations.fastapi.events import event_stream
from onceflow.integrations.fastapi.responses import _responses
from onceflow.integrations.fastapi.services import OnceflowServices
from onceflow.models import NewRequest, Status
from onceflow.models import Request as StageRequest
from onceflow.tasks import Flow


# Route decorators alike by shape on purpose: FastAPI builds the OpenAPI contract from each one.
def _request_routes(router: APIRouter, svc: OnceflowServices) -> None:
    @router.post(
        "/workspaces/{ws}/requests",
        operation_id="enqueue_request",
        tags=["requests"],
        status_code=201,
        response_description="Created by this call",
        response_model=s.EnqueueOut,
        responses={
            200: {"model": s.EnqueueOut, "description": "The request existed already"},
            **_responses(409, 413, 503),
        },
    )
    async def enqueue(
        ws: s.WorkspacePath, body: s.EnqueueIn, request: Request, response: Response
    ) -> s.EnqueueOut:
        """Enqueue a stage request: 201 for the one caller that created it, 200 for the others.

        The input is validated against the stage's model; the row is committed, then
        the wake-up is sent to the worker class's queue (a pull-worker class claims it
        over HTTP instead).
        """
        check_id("workspace_id", ws)
        result = await svc.enqueue(
            body.stage,
            ws,
            body.job_id,
            body.branch_path,
            body.input,
            priority=body.priority,
            strict=body.strict,
            worker_class=body.worker_class,
        )
        if result.created:
            response.status_code = 201
            raw_path = request.scope.get("raw_path") or request.url.path.encode()
            response.headers["Location"] = f"{raw_path.decode('latin-1')}/{result.request_id}"
        else:
            response.status_code = 200
        return s.EnqueueOut(
            request_id=result.request_id,
            created=result.created,
            status=result.status,
            input_mismatch=result.input_mismatch,
        )

    @router.get(
        "/workspaces/{ws}/requests/{request_id}",
        operation_id="get_request",
        tags=["requests"],
        response_model=s.RequestOut,
        responses=_responses(404, 503),
    )
    async def get_request(
        ws: s.WorkspacePath,
        request_id: s.RequestIdPath,
        request: Request,
        wait: Annotated[
            float,
            Query(
                ge=0,
                le=60,
                description="Long poll: while the request has not ended (succeeded, dead, "
                "cancelled), wait up to this many seconds for it to end, woken by the "
                "database; then answer it as it is (200 either way). 0: answer at once.",
            ),
        ] = 0,
    ) -> s.RequestOut:
        """A request of this workspace (404 also when the id belongs to another workspace).

        With ``wait`` > 0, a long poll that holds no thread: the answer comes as soon as the
        request ends, or as it is when ``wait`` seconds have passed.
        """
        check_id("workspace_id", ws)
        if wait > 0:
            found = await _wait_or_leave(svc, request_id, ws, wait, request)
        else:
            found = await svc.async_queue.get(request_id, workspace_id=ws)
        if found.workspace_id != ws:
            raise NotFound(request_id)
        return _request_out(found)

    @router.get(
        "/workspaces/{ws}/requests",
        operation_id="list_requests",
        tags=["requests"],
        response_model=s.RequestList,
        responses=_responses(503),
    )
    async def list_requests(
        ws: s.WorkspacePath,
        status: Annotated[list[Status] | None, Query()] = None,
        stage: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        job_id: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        worker_class: Annotated[
            str | None,
            Query(
                min_length=1,
                max_length=WORKER_CLASS_MAX,
                pattern=s.WORKER_CLASS_PATTERN,
                description=f"Only requests of this worker class: {s.WORKER_CLASS_RULES}",
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> s.RequestList:
        """The workspace's requests, newest first, filtered by every parameter given."""
        check_id("workspace_id", ws)
        rows = await svc.async_queue.list(
            workspace_id=ws,
            status=[st.value for st in status] if status else None,
            stage=stage,
            job_id=job_id,
            worker_class=worker_class,
            limit=limit,
        )
        return s.RequestList(requests=[_request_out(r) for r in rows])

    @router.get(
        "/workspaces/{ws}/counts",
        operation_id="count_requests",
        tags=["requests"],
        response_model=s.CountsOut,
        responses=_responses(503),
    )
    async def counts(ws: s.WorkspacePath) -> s.CountsOut:
        """The workspace's requests counted by worker class and status."""
        check_id("workspace_id", ws)
        out = await svc.async_queue.counts(workspace_id=ws)
        total = sum(sum(per.values()) for per in out.values())
        return s.CountsOut(workspace_id=ws, counts=out, total=total)

    @router.get(
        "/workspaces/{ws}/events",
        operation_id="workspace_events",
        tags=["ops"],
        response_class=Response,
        responses={
            200: {
                "description": "An event stream: `ready`, then one `commit` event per op "
                "committed in the workspace (data: JSON); `: keep-alive` comments when idle",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            **_responses(503),
        },
    )
    async def events(ws: s.WorkspacePath, principal: PrincipalDep) -> Response:
        """Server-sent events of the workspace's commit broadcasts (what a browser tab follows)."""
        check_id("workspace_id", ws)
        keepalive = svc.settings.api_sse_keepalive_seconds
        return await event_stream(svc.event_hub(), ws, principal.key_id, keepalive)


async def _wait_or_leave(
    svc: OnceflowServices, request_id: str, ws: str, wait: float, request: Request
) -> StageRequest:
    """The request once it has ended, or as it is after ``wait`` s; a client that leaves
    meanwhile stops the wait (its LISTEN connection closed) and is answered as it is now."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    waiter = asyncio.ensure_future(svc.async_queue.wait(request_id, timeout=wait, workspace_id=ws))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():  # the client left: nobody reads the answer
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await waiter
            return await svc.async_queue.get(request_id, workspace_id=ws)
        try:
            return waiter.result()
        except WaitTimeout as exc:
            if isinstance(exc.request, StageRequest):
                return exc.request
            return await svc.async_queue.get(request_id, workspace_id=ws)
    finally:
        watcher.cancel()


def _request_out(request: StageRequest) -> s.RequestOut:
    return s.RequestOut.model_validate(request, from_attributes=True)


def _follow_up(flow: Flow, parent: StageRequest, item: s.FollowUp) -> NewRequest:
    """A hand-off to ``item.stage`` in the claimed request's workspace and job (the Flow's
    one builder: declared worker class, dedupe, priority, attempts; input validated)."""
    branch = parent.branch_path if item.branch_path is None else item.branch_path
    return flow.new_request(item.stage, parent.workspace_id, parent.job_id, branch, item.input)
