"""A server span for each HTTP request of the API, in the caller's trace.

When tracing is on (:func:`onceflow.tracing.active`), :class:`ServerSpanMiddleware` reads
the W3C ``traceparent`` / ``tracestate`` headers of each request and runs the request under
a ``SERVER`` span named ``{METHOD} {route}`` (``POST /v1/workspaces/{workspace_id}/requests``),
a child of the caller's span when the headers name one, else the root of a new trace. What
the route does happens inside it: an enqueue stores the span's trace with the row (the stage
that runs it continues that trace), and a pull worker's claim calls, which send their run's
``traceparent``, join the run's trace.

Attributes follow OpenTelemetry's HTTP conventions: ``http.request.method``, ``http.route``
(the template), ``http.response.status_code``, ``url.scheme``; ``error.type`` (the status
code) on a 5xx. ``url.path`` only with ``ONCEFLOW_TRACE_WORKSPACE_IDS`` (a path names a
workspace). No query string, header or body is recorded.

An application that traces its HTTP requests itself (OpenTelemetry's ASGI or FastAPI
instrumentation) already has a span current when the request reaches the app: then no
second span is made, and the route runs under the application's span.

FastAPI's own OpenTelemetry (newer FastAPI versions trace every request when a tracer
provider is set) is turned off in onceflow's app (:func:`native_telemetry_off`): its spans
record the path and the query string, and its log records the messages of errors, which may
quote an input.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from onceflow import tracing
from onceflow.settings import get_settings

_W3C = TraceContextTextMapPropagator()

#: The methods a span names as they are; any other is ``_OTHER`` (HTTP conventions).
_KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)


class ServerSpanMiddleware:
    """ASGI middleware: each HTTP request under a ``SERVER`` span continuing the caller's
    W3C trace context (see the module). Does nothing while tracing is off, or when a span is
    already current (the application's own instrumentation made the request's span)."""

    def __init__(self, app: ASGIApp, *, record_path: bool | None = None) -> None:
        """``record_path``: put ``url.path`` on the spans (it names workspaces); by default
        when ``ONCEFLOW_TRACE_WORKSPACE_IDS`` is set."""
        self.app = app
        self.record_path = (
            get_settings().trace_workspace_ids if record_path is None else record_path
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request under its span (or as it is: see the class)."""
        if scope["type"] != "http" or not tracing.active() or _span_current():
            await self.app(scope, receive, send)
            return
        method = _method(scope.get("method", ""))
        attributes = {"http.request.method": method, "url.scheme": scope.get("scheme", "http")}
        if self.record_path:
            attributes["url.path"] = scope.get("path", "")
        span = tracing.TRACER.start_span(
            method,
            context=_W3C.extract(_trace_headers(scope)),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        status: list[int] = []

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
                _named(span, method, scope)
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            _named(span, method, scope)
            tracing.ended_with(span, exc)
            raise
        else:
            if status:
                _ended(span, status[0])
        finally:
            otel_context.detach(token)
            span.end()


def native_telemetry_off() -> dict[str, Any]:
    """``FastAPI(**native_telemetry_off())``: FastAPI's own OpenTelemetry spans, metrics and
    logs off, where the installed FastAPI has them (nothing to pass where it has not)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    return {"telemetry": off}


def _span_current() -> bool:
    """A span of this process is current: the application's instrumentation made one."""
    span_context = trace.get_current_span().get_span_context()
    return span_context.is_valid and not span_context.is_remote


def _method(raw: str) -> str:
    method = raw.upper()
    return method if method in _KNOWN_METHODS else "_OTHER"


def _trace_headers(scope: Scope) -> dict[str, str]:
    """The request's ``traceparent`` and ``tracestate`` (several ``tracestate`` lines
    joined, as HTTP reads a repeated list header)."""
    found: dict[str, list[str]] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").lower()
        if name in ("traceparent", "tracestate"):
            found.setdefault(name, []).append(raw_value.decode("latin-1"))
    out: dict[str, str] = {}
    if len(found.get("traceparent", ())) == 1:  # two parents: neither is believed
        out["traceparent"] = found["traceparent"][0]
        if "tracestate" in found:
            out["tracestate"] = ",".join(found["tracestate"])
    return out


def _named(span: Any, method: str, scope: Scope) -> None:
    """Name the span after the route the request matched (known once it was routed)."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if isinstance(template, str) and template:
        span.set_attribute("http.route", template)
        span.update_name(f"{method} {template}")


def _ended(span: Any, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(StatusCode.ERROR)


__all__ = ["ServerSpanMiddleware", "native_telemetry_off"]
