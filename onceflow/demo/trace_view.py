"""``onceflow demo --trace``: every process of the run exports its spans to a local OTLP
receiver, and the run ends by printing one request's trace as a tree.

The demo's own process traces too (service ``onceflow-demo``): each enqueue runs under a
``demo`` span, the root of that request's trace. The processes it starts get the receiver's
endpoint through the standard ``OTEL_*`` variables and a service name each (``OTEL_SERVICE_NAME``);
their ``onceflow`` commands set the SDK up from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

if TYPE_CHECKING:  # the receiver needs opentelemetry-proto: imported once it is checked for
    from onceflow.demo.traces import Span, TraceReceiver

#: The demo process's service name; the workers', beat's and the API's are set per process.
DEMO_SERVICE = "onceflow-demo"
#: How long the end of the run waits for the workers' last spans (they export every 200 ms).
SETTLE_SECONDS = 15.0

_tracer = trace.get_tracer("onceflow.demo")


def missing_sdk() -> str | None:
    """Why ``--trace`` cannot run here (the SDK or the OTLP exporter is not installed), or None."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return (
            f"--trace needs the OpenTelemetry SDK and its OTLP exporter ({exc.name} is missing): "
            "pip install 'onceflow[otel]'"
        )
    return None


def otel_env(receiver: TraceReceiver) -> dict[str, str]:
    """The variables every process of the run gets: export to ``receiver``, in small batches."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_SERVICE_NAME": DEMO_SERVICE,  # each process the run starts gets its own
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }


def named(env: dict[str, str], service: str) -> dict[str, str]:
    """``env`` with ``OTEL_SERVICE_NAME`` set to ``service`` when the run is traced."""
    return {**env, "OTEL_SERVICE_NAME": service} if "OTEL_TRACES_EXPORTER" in env else env


def configure_demo() -> bool:
    """Set the SDK up in the demo's own process (after :func:`otel_env` is in ``os.environ``)."""
    from onceflow import tracing

    return tracing.configure(DEMO_SERVICE)


def shutdown_demo() -> None:
    """Export the demo process's last spans and stop its exporter (before the receiver stops,
    so that nothing is left retrying against a closed port at exit)."""
    provider: Any = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


@contextlib.contextmanager
def enqueue_span(client: str, stage: str) -> Iterator[None]:
    """The root span of one enqueue by a demo client (a no-op unless the run is traced)."""
    with _tracer.start_as_current_span(
        "demo", attributes={"demo.client": client, "onceflow.stage": stage}
    ):
        yield


def created_requests(spans: list[Span]) -> dict[str, str]:
    """request id → trace id of the requests the demo's enqueues created."""
    return {
        str(s.attributes["onceflow.request_id"]): s.trace_id
        for s in spans
        if s.name == "onceflow.enqueue"
        and s.service == DEMO_SERVICE
        and s.attributes.get("onceflow.created") == 1
        and "onceflow.request_id" in s.attributes
    }


def served(spans: list[Span], request_id: str, trace_id: str) -> bool:
    """Whether a span of another process than the demo's, in the request's trace, names it
    (the run that served it)."""
    return any(
        s.trace_id == trace_id
        and s.service != DEMO_SERVICE
        and s.attributes.get("onceflow.request_id") == request_id
        for s in spans
    )


def extent_ns(spans: list[Span], trace_id: str) -> int:
    """How long the trace lasted: its first span's start to its last span's end."""
    mine = [s for s in spans if s.trace_id == trace_id]
    return max(s.end_ns for s in mine) - min(s.start_ns for s in mine) if mine else 0


def slowest_trace(receiver: TraceReceiver, settle: float = SETTLE_SECONDS) -> dict[str, Any]:
    """The trace of the slowest request the demo created (enqueue to its last span), once the
    workers' spans of every created request arrived (or after ``settle`` seconds): its ids,
    stage, services and the tree. Called while the workers still run."""
    from onceflow import tracing

    tracing.flush()  # the demo's own enqueue spans

    def complete(spans: list[Span]) -> bool:
        requests = created_requests(spans)
        return bool(requests) and all(served(spans, r, t) for r, t in requests.items())

    arrived = False
    with contextlib.suppress(TimeoutError):
        arrived = receiver.wait_for(complete, timeout=settle)
    spans = receiver.spans()
    requests = created_requests(spans)
    if not requests:
        return {"request_id": None, "trace_id": None, "spans": len(spans),
                "tree": "(no enqueue span received)", "complete": False}  # fmt: skip
    request_id, trace_id = max(requests.items(), key=lambda rt: extent_ns(spans, rt[1]))
    mine = receiver.trace(trace_id)
    stage = next((s.attributes.get("onceflow.stage") for s in mine
                  if s.name == "onceflow.enqueue"), None)  # fmt: skip
    return {
        "request_id": request_id,
        "trace_id": trace_id,
        "stage": stage,
        "seconds": round(extent_ns(spans, trace_id) / 1e9, 3),
        "services": sorted({s.service for s in mine if s.service}),
        "spans": len(mine),
        "spans_received": len(spans),
        "complete": arrived,
        "tree": receiver.tree(trace_id),
    }


def describe(found: dict[str, Any]) -> str:
    """The chosen trace as printed after the report."""
    if found.get("trace_id") is None:
        return f"Trace: {found['tree']}"
    head = (
        f"Trace of the slowest request, {found['request_id']} ({found['stage']}): "
        f"{found['seconds']} s from enqueue to its last span, {found['spans']} spans from "
        f"{', '.join(found['services'])}"
    )
    if not found["complete"]:
        head += " (some processes' spans had not arrived)"
    return f"{head}\n{found['tree']}"
