"""An MCP server over stdio, so an agent can submit work with no browser present.

``pip install onceflow[mcp]``, then ``onceflow mcp --app myproject.stages:flow``
(or ``ONCEFLOW_APP``). Built on the official ``mcp`` SDK (``MCPServer`` in 2.x,
``FastMCP`` in 1.x). Tools:

* ``enqueue_stage`` — validate the input against the stage's model, write the
  request (duplicates collapse onto one row) and send its Celery wake-up, exactly
  as :meth:`onceflow.tasks.Flow.enqueue` does; returns ``{request_id, created,
  status, input_mismatch}``;
* ``get_request`` — one request (status, attempts, result, error, …), by its id and,
  optionally, its workspace (then found by its key, not by its id alone);
* ``list_requests`` — a workspace's requests, newest first, optionally by status;
* ``list_stages`` — the stages the flow declares, with their input JSON schemas.

Bad input is a tool error (``isError``) with a clear message, and nothing is
written. Every setting, secrets included, comes from the environment
(``ONCEFLOW_DATABASE_URL``, ``ONCEFLOW_REDIS_URL``, …), never from tool
arguments; stdout carries only the protocol.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from onceflow.errors import OnceflowError
from onceflow.tasks import Flow

_Server: Any
ToolError: type[Exception]
try:
    from mcp.server.mcpserver import MCPServer as _Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x: the same decorator API under its first name
    _Server = importlib.import_module("mcp.server.fastmcp").FastMCP
    ToolError = importlib.import_module("mcp.server.fastmcp.exceptions").ToolError

T = TypeVar("T")

INSTRUCTIONS = """\
onceflow runs each stage of work once. `enqueue_stage` asks for stage S on job J at
branch path P of workspace W; asking again for the same (W, J, P, S) returns the same
request_id with created=false, so retrying is safe. Poll `get_request` until its status
is succeeded, dead or cancelled; `list_stages` shows each stage's input schema."""

LIST_LIMIT_DEFAULT = 50


async def _run(call: Callable[[], T]) -> T:
    """Run a blocking onceflow call off the event loop; its errors become tool errors."""
    try:
        return await anyio.to_thread.run_sync(call)
    except OnceflowError as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from None


def build_server(flow: Flow, *, name: str = "onceflow") -> Any:
    """The MCP server for ``flow`` (not started): call ``.run("stdio")`` or use :func:`serve`."""

    async def enqueue_stage(
        workspace_id: str,
        job_id: str,
        stage: str,
        branch_path: str = "",
        input: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        result = await _run(
            lambda: flow.enqueue(stage, workspace_id, job_id, branch_path, input or {})
        )
        return {
            "request_id": result.request_id,
            "created": result.created,
            "status": result.status.value,
            "input_mismatch": result.input_mismatch,
        }

    async def get_request(request_id: str, workspace_id: str | None = None) -> dict[str, Any]:
        return await _run(lambda: flow.queue.get(request_id, workspace_id=workspace_id).as_json())

    async def list_requests(
        workspace_id: str,
        status: list[str] | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> dict[str, Any]:
        rows = await _run(
            lambda: flow.queue.list(workspace_id=workspace_id, status=status or None, limit=limit)
        )
        return {"requests": [row.as_json() for row in rows]}

    async def list_stages() -> dict[str, Any]:
        return {
            "stages": [
                {
                    "name": spec.name,
                    "worker_class": spec.worker_class,
                    "input_schema": spec.input_model.model_json_schema(),
                }
                for spec in flow.stages.values()
            ]
        }

    server = _Server(name, instructions=INSTRUCTIONS)
    tools: list[tuple[Callable[..., Any], str]] = [
        (
            enqueue_stage,
            "Enqueue a stage request for a workspace; idempotent per (workspace_id, job_id, "
            "branch_path, stage): asking again returns the same request_id with created=false. "
            "Returns request_id, created, status.",
        ),
        (
            get_request,
            "One request by id: status, attempts, input, result, error, timestamps. Give its "
            "workspace_id (as enqueue_stage was given) to find it by its key; a request of "
            "another workspace is then not found.",
        ),
        (
            list_requests,
            "A workspace's requests, newest first; optionally only some statuses "
            "(queued, running, succeeded, dead, cancelled).",
        ),
        (
            list_stages,
            "The stages this server can enqueue, with their worker class and the JSON schema "
            "of their input.",
        ),
    ]
    for fn, description in tools:
        server.add_tool(fn, name=fn.__name__, description=description)
    return server


def serve(flow: Flow, *, name: str = "onceflow") -> None:
    """Serve the tools for ``flow`` over stdio until the client closes the stream.

    Every request gets an answer, one the SDK cannot read included (a lone
    surrogate, JSON nested too deep, a line that is not JSON): see
    :mod:`onceflow.integrations.mcp_stdio`.
    """
    from onceflow.integrations.mcp_stdio import run_stdio

    anyio.run(run_stdio, build_server(flow, name=name))


__all__ = ["INSTRUCTIONS", "build_server", "serve"]
