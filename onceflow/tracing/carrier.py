"""The trace context a request row keeps: the W3C ``traceparent`` (and ``tracestate``) of the
span that enqueued it, as one short text, and back.

Always W3C Trace Context, whatever propagator the application configured for its own HTTP
calls: the row is read by other processes, maybe other languages (the JavaScript SDK), and
one format keeps them all able to continue the trace. Nothing is stored without a valid span
context (no SDK); a sampled-out trace's context is stored too, its flags saying so, so the
run keeps the caller's sampling decision.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

_W3C = TraceContextTextMapPropagator()

#: Longest stored text accepted back (a traceparent is 55 characters; tracestate at most 512
#: list members, kept short in practice). Anything longer is ignored, never an error.
MAX_STORED = 1024


def carrier_of(span: Span | SpanContext) -> str | None:
    """``span``'s context as stored text: ``traceparent``, then ``\\n`` and ``tracestate`` when
    there is one; None for an invalid (no-op) span."""
    span_context = span if isinstance(span, SpanContext) else span.get_span_context()
    if not span_context.is_valid:
        return None
    headers: dict[str, str] = {}
    _W3C.inject(headers, trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    parent = headers.get("traceparent")
    if parent is None:
        return None
    state = headers.get("tracestate")
    return f"{parent}\n{state}" if state else parent


def current_carrier() -> str | None:
    """The current span's context as stored text (None when no span is current)."""
    return carrier_of(trace.get_current_span())


def context_from(stored: str | None) -> Context | None:
    """The context of ``stored`` text, a remote parent to start a span under; None when there
    is none or it does not parse (a bad value is ignored, never an error)."""
    span_context = span_context_from(stored)
    if span_context is None:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def span_context_from(stored: str | None) -> SpanContext | None:
    """The span context of ``stored`` text (what a link points at); None as ``context_from``."""
    if not stored or not isinstance(stored, str) or len(stored) > MAX_STORED:
        return None
    parent, _, state = stored.partition("\n")
    headers = {"traceparent": parent}
    if state:
        headers["tracestate"] = state
    span_context = trace.get_current_span(_W3C.extract(headers)).get_span_context()
    return span_context if span_context.is_valid else None


def link_to(stored: str | None, attributes: Attributes = None) -> list[Link]:
    """A link to the span of ``stored`` text, as a list for ``links=`` (empty when none)."""
    span_context = span_context_from(stored)
    return [] if span_context is None else [Link(span_context, attributes)]


def headers_of(stored: str | None) -> dict[str, str]:
    """The W3C headers (``traceparent``, and ``tracestate`` when there is one) that carry
    ``stored`` text on an HTTP call; empty when there is none or it does not parse (a bad
    value is never sent)."""
    span_context = span_context_from(stored)
    if span_context is None:
        return {}
    headers: dict[str, str] = {}
    _W3C.inject(headers, trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    return headers


def current_headers() -> dict[str, str]:
    """:func:`headers_of` the current span (empty when none is current)."""
    return headers_of(current_carrier())
