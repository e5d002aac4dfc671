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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from onceflow import tracing
from onceflow.errors import OnceflowError
from onceflow.tasks import Flow

_Server: Any
Context: Any
ToolError: type[Exception]
try:
    from mcp.server.mcpserver import Context
    from mcp.server.mcpserver import MCPServer as _Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x: the same decorator API under its first name
    _Server = importlib.import_module("mcp.server.fastmcp").FastMCP
    Context = importlib.import_module("mcp.server.fastmcp").Context
    ToolError = importlib.import_module("mcp.server.fastmcp.exceptions").ToolError

_W3C = TraceContextTextMapPropagator()

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


def _trace_meta(ctx: Any) -> dict[str, str]:
    """The W3C ``traceparent`` / ``tracestate`` of the call's ``params._meta`` (MCP's trace
    context keys), as strings; empty when it has none. ``_meta`` is a mapping in mcp 2.x and
    a model keeping unknown keys as extras in 1.x."""
    try:
        meta = ctx.request_context.meta
    except (AttributeError, ValueError, LookupError):  # no request: called outside one
        return {}
    if meta is None:
        return {}
    fields = meta if isinstance(meta, Mapping) else (getattr(meta, "model_extra", None) or {})
    return {
        key: value
        for key in ("traceparent", "tracestate")
        if isinstance(value := fields.get(key), str)
    }


@contextmanager
def _tool_span(ctx: Any, tool: str) -> Iterator[None]:
    """A tool call under a ``tools/call {tool}`` server span, a child of the caller's span
    that the call's ``_meta`` names (a new trace when it names none), so the requests it
    enqueues keep the caller's trace. Nothing when tracing is off, or when a span is already
    current (mcp 2.x makes that same span itself from ``_meta``)."""
    current = trace.get_current_span().get_span_context()
    if not tracing.active() or (current.is_valid and not current.is_remote):
        yield
        return
    span = tracing.TRACER.start_span(
        f"tools/call {tool}",
        context=_W3C.extract(_trace_meta(ctx)),
        kind=SpanKind.SERVER,
        attributes={"mcp.method.name": "tools/call", "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": tool},
    )  # fmt: skip
    try:
        with trace.use_span(span, record_exception=False, set_status_on_exception=False):
            yield
    except BaseException as exc:  # its type only: a tool error's message quotes the input
        tracing.ended_with(span, exc)
        raise
    finally:
        span.end()


def build_server(flow: Flow, *, name: str = "onceflow") -> Any:
    """The MCP server for ``flow`` (not started): call ``.run("stdio")`` or use :func:`serve`."""

    async def enqueue_stage(
        workspace_id: str,
        job_id: str,
        stage: str,
        ctx: Any,
        branch_path: str = "",
        input: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        with _tool_span(ctx, "enqueue_stage"):
            result = await _run(
                lambda: flow.enqueue(stage, workspace_id, job_id, branch_path, input or {})
            )
        return {
            "request_id": result.request_id,
            "created": result.created,
            "status": result.status.value,
            "input_mismatch": result.input_mismatch,
        }

    # The SDK hands a tool its request's context through the parameter typed Context (left
    # out of the tool's input schema); the class itself, not its name, for every SDK version.
    enqueue_stage.__annotations__["ctx"] = Context

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
