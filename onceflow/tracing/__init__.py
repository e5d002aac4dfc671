"""OpenTelemetry for onceflow: spans every runner sets, the trace context a request row keeps,
log lines that join the trace, and the SDK set up from the standard ``OTEL_*`` variables.

Only ``opentelemetry-api`` is required. Without an SDK its tracer is a no-op: no span is
recorded, nothing is stored with a row, and the guards here (:func:`active`) skip building
attributes. ``pip install 'onceflow[otel]'`` adds the SDK and the OTLP exporter, which
:func:`configure` installs when ``OTEL_TRACES_EXPORTER`` or an ``OTEL_EXPORTER_OTLP_*``
endpoint is set; an application that installs its own tracer provider keeps it.
"""

from onceflow.tracing.carrier import (
    carrier_of,
    context_from,
    current_carrier,
    current_headers,
    headers_of,
    link_to,
    span_context_from,
)
from onceflow.tracing.logs import (
    LOG_FIELDS,
    JsonFormatter,
    LogContextFilter,
    TextFormatter,
    configure_logging,
    log_fields,
)
from onceflow.tracing.setup import configure, flush
from onceflow.tracing.spans import TRACER, active, attributes, ended_with, guarded, run_parent

__all__ = [
    "LOG_FIELDS",
    "TRACER",
    "JsonFormatter",
    "LogContextFilter",
    "TextFormatter",
    "active",
    "attributes",
    "carrier_of",
    "configure",
    "configure_logging",
    "context_from",
    "current_carrier",
    "current_headers",
    "ended_with",
    "flush",
    "guarded",
    "headers_of",
    "link_to",
    "log_fields",
    "run_parent",
    "span_context_from",
]
