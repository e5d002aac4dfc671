"""How ``onceflow demo --trace`` picks the trace it prints: spans sent by OpenTelemetry's SDK
and OTLP exporter to the demo's receiver, as the demo's process and a worker send them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, Span, SpanKind, Tracer

from onceflow.demo.trace_view import DEMO_SERVICE, describe, slowest_trace
from onceflow.demo.traces import TraceReceiver

MS = 1_000_000
T0 = 1_700_000_000_000 * MS  # a fixed start: the spans' times are given, not measured


@pytest.fixture
def receiver() -> Iterator[TraceReceiver]:
    with TraceReceiver() as r:
        yield r


@pytest.fixture
def tracers(receiver: TraceReceiver) -> Iterator[dict[str, Tracer]]:
    providers = {}
    for service in (DEMO_SERVICE, "onceflow-worker-llm"):
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.traces_url))
        )
        providers[service] = provider
    yield {s: p.get_tracer("test") for s, p in providers.items()}
    for provider in providers.values():
        provider.shutdown()


def enqueue(
    tracer: Tracer, request_id: str, created: bool, at: int, links: Sequence[Link] = ()
) -> Span:
    """A demo client's root span and its enqueue, ``at`` ms after T0; returns the enqueue."""
    root = tracer.start_span("demo", start_time=T0 + at * MS)
    context = trace.set_span_in_context(root)
    span = tracer.start_span(
        "onceflow.enqueue", context=context, kind=SpanKind.PRODUCER, start_time=T0 + at * MS,
        links=list(links),
        attributes={"onceflow.request_id": request_id, "onceflow.stage": "evaluate",
                    "onceflow.created": int(created), "onceflow.joined": int(not created)},
    )  # fmt: skip
    span.end(end_time=T0 + (at + 1) * MS)
    root.end(end_time=T0 + (at + 2) * MS)
    return span


def run(tracer: Tracer, request_id: str, parent: Span, start: int, end: int) -> None:
    """The worker's run of a request, under its enqueue, from ``start`` to ``end`` ms."""
    span = tracer.start_span(
        "onceflow.run evaluate", context=trace.set_span_in_context(parent),
        kind=SpanKind.CONSUMER, start_time=T0 + start * MS,
        attributes={"onceflow.request_id": request_id},
    )  # fmt: skip
    span.end(end_time=T0 + end * MS)


def test_it_prints_the_slowest_request_once_a_worker_sent_each_request_run(
    receiver: TraceReceiver, tracers: dict[str, Tracer]
) -> None:
    demo, worker = tracers[DEMO_SERVICE], tracers["onceflow-worker-llm"]
    fast = enqueue(demo, "r-fast", created=True, at=0)
    slow = enqueue(demo, "r-slow", created=True, at=1)
    # A duplicate of the slow one: its own trace, linked to the row it joined; not a candidate.
    enqueue(demo, "r-slow", created=False, at=2, links=[Link(slow.get_span_context())])
    run(worker, "r-fast", fast, 3, 10)
    run(worker, "r-slow", slow, 4, 900)

    found = slowest_trace(receiver, settle=30)

    assert found["request_id"] == "r-slow" and found["complete"] is True
    assert found["trace_id"] == format(slow.get_span_context().trace_id, "032x")
    assert found["stage"] == "evaluate" and found["spans"] == 3
    assert found["services"] == [DEMO_SERVICE, "onceflow-worker-llm"]
    assert found["seconds"] == 0.899  # from the root's start (1 ms) to the run's end (900 ms)
    lines = found["tree"].splitlines()
    assert lines[1:] == [
        "demo [onceflow-demo]  +0.0 ms, 2.0 ms",
        "  onceflow.enqueue [onceflow-demo]  +0.0 ms, 1.0 ms",
        "    onceflow.run evaluate [onceflow-worker-llm]  +3.0 ms, 896.0 ms",
    ]
    text = describe(found)
    assert text.startswith("Trace of the slowest request, r-slow (evaluate): 0.899 s")
    assert "had not arrived" not in text


def test_a_request_whose_run_never_arrives_is_printed_as_far_as_it_got(
    receiver: TraceReceiver, tracers: dict[str, Tracer]
) -> None:
    enqueue(tracers[DEMO_SERVICE], "r-lost", created=True, at=0)
    found = slowest_trace(receiver, settle=0.2)
    assert found["request_id"] == "r-lost" and found["complete"] is False
    assert describe(found).splitlines()[0].endswith("(some processes' spans had not arrived)")


def test_without_any_enqueue_span_it_says_so(receiver: TraceReceiver) -> None:
    found = slowest_trace(receiver, settle=0.05)
    assert found["trace_id"] is None
    assert describe(found) == "Trace: (no enqueue span received)"
