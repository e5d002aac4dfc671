"""Install OpenTelemetry's SDK in an onceflow process from the standard ``OTEL_*`` variables.

``onceflow worker``, ``work``, ``api`` and ``beat`` call :func:`configure` at start-up. It does
nothing unless ``onceflow[otel]`` (the SDK and the OTLP exporter) is installed and tracing is
asked for: ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``; ``none`` turns it off), or an
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``. ``OTEL_SDK_DISABLED``
wins over both. A tracer provider that the application installed first is kept: onceflow's
spans go to it. An application that installs its own later (in Celery's
``worker_process_init``, say) sets ``ONCEFLOW_OTEL_SETUP=false``: onceflow then sets nothing up.

The SDK reads the rest itself: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the
resource), ``OTEL_TRACES_SAMPLER`` (the sampler), ``OTEL_EXPORTER_OTLP_*`` (where and how to
export), ``OTEL_BSP_*`` (the batch processor). Spans leave through a batch processor, off the
thread that made them; the SDK restarts its thread in a forked child (Celery's prefork pool).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from opentelemetry import trace

from onceflow.settings import get_settings
from onceflow.tracing.spans import active

log = logging.getLogger("onceflow.tracing")

_TRUE = {"true", "1", "yes", "on"}


def wanted(environ: dict[str, str] | None = None) -> str | None:
    """The exporter the environment asks for (``otlp``, ``console``), or None for none."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        first = exporter.split(",")[0].strip()
        return None if first == "none" else first
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return None


def configure(service_name: str) -> bool:
    """Install the SDK's tracer provider with a batch exporter when the environment asks for
    one (see the module); ``service_name`` when ``OTEL_SERVICE_NAME`` does not name one.
    True when onceflow's spans are recorded afterwards (also when the application had set a
    provider of its own)."""
    if active():
        return True
    kind = wanted()
    if kind is None or not get_settings().otel_setup:
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "tracing: OTEL_* asks for %s, but the OpenTelemetry SDK is not installed "
            "(pip install 'onceflow[otel]'); no spans are exported",
            kind,
        )
        return False
    exporter = _exporter(kind)
    if exporter is None:
        return False
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = Resource.create({SERVICE_NAME: service_name})  # neither names one
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans (%s) as service %s", kind,
             resource.attributes.get(SERVICE_NAME))  # fmt: skip
    return True


def _exporter(kind: str) -> Any:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        log.warning("tracing: OTEL_TRACES_EXPORTER=%s is not one onceflow sets up (otlp, "
                    "console); no spans are exported", kind)  # fmt: skip
        return None
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
    except ImportError:
        log.warning(
            "tracing: the OTLP %s exporter is not installed (pip install 'onceflow[otel]'%s); "
            "no spans are exported",
            protocol,
            " and opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "",
        )
        return None
    return OTLPSpanExporter()


def flush(timeout_seconds: float = 5.0) -> None:
    """Export the spans still buffered (before a process exits without ``atexit``, as a
    Celery prefork child does)."""
    provider: Any = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        force_flush(int(timeout_seconds * 1000))
