"""The demo's OTLP/HTTP receiver, fed by OpenTelemetry's own SDK and OTLP exporter over a
real HTTP connection: what it decodes, how it answers, and the tree it prints.

Each test makes a tracer provider of its own (never the global one), so nothing here
depends on what another test installed.
"""

from __future__ import annotations

import gzip
import http.client
from collections.abc import Callable, Iterator

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, StatusCode, Tracer

from onceflow.demo.traces import Span, TraceReceiver, render_tree


@pytest.fixture
def receiver() -> Iterator[TraceReceiver]:
    with TraceReceiver() as r:
        yield r


def tracer_for(
    receiver: TraceReceiver, service: str, compression: Compression = Compression.NoCompression
) -> tuple[Tracer, TracerProvider]:
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    exporter = OTLPSpanExporter(endpoint=receiver.traces_url, compression=compression)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), provider


def named(*names: str) -> Callable[[list[Span]], dict[str, Span]]:
    def seen(spans: list[Span]) -> dict[str, Span]:
        found = {s.name: s for s in spans if s.name in names}
        return found if len(found) == len(names) else {}

    return seen


def test_spans_arrive_with_ids_kinds_attributes_links_events_status_and_service(
    receiver: TraceReceiver,
) -> None:
    producer, p1 = tracer_for(receiver, "svc-api")
    consumer, p2 = tracer_for(receiver, "svc-worker")
    try:
        with producer.start_as_current_span("enqueue", kind=SpanKind.PRODUCER) as enqueue:
            enqueue.set_attributes({
                "onceflow.request_id": "r-1", "onceflow.created": 1, "flag": True,
                "ratio": 0.5, "stages": ["a", "b"],
            })  # fmt: skip
        with consumer.start_as_current_span(
            "run", kind=SpanKind.CONSUMER,
            links=[Link(enqueue.get_span_context(), {"onceflow.link": "enqueue"})],
        ) as run:  # fmt: skip
            run.add_event("retry", {"attempt": 2})
            with consumer.start_as_current_span("claim") as claim:
                claim.set_status(StatusCode.ERROR, "refused")
        spans = receiver.wait_for(named("enqueue", "run", "claim"))
    finally:
        p1.shutdown()
        p2.shutdown()

    e, r, c = spans["enqueue"], spans["run"], spans["claim"]
    ctx = enqueue.get_span_context()
    assert (e.trace_id, e.span_id) == (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"))
    assert e.parent_span_id is None and e.kind == "PRODUCER" and e.service == "svc-api"
    assert e.attributes == {
        "onceflow.request_id": "r-1", "onceflow.created": 1, "flag": True, "ratio": 0.5,
        "stages": ("a", "b"),
    }  # fmt: skip
    assert r.kind == "CONSUMER" and r.service == "svc-worker"
    assert r.links == ((e.trace_id, e.span_id, {"onceflow.link": "enqueue"}),)
    assert [(ev.name, ev.attributes) for ev in r.events] == [("retry", {"attempt": 2})]
    assert c.parent_span_id == r.span_id and c.trace_id == r.trace_id
    assert (c.status, c.status_message) == ("ERROR", "refused")
    assert c.start_ns >= r.start_ns and c.end_ns <= r.end_ns and r.duration_ms >= 0
    assert receiver.trace(r.trace_id) == sorted([r, c], key=lambda s: s.start_ns)


def test_gzip_bodies_are_decoded(receiver: TraceReceiver) -> None:
    tracer, provider = tracer_for(receiver, "svc-gzip", Compression.Gzip)
    try:
        with tracer.start_as_current_span("compressed") as span:
            span.set_attribute("n", 7)
        (got,) = receiver.wait_for(lambda spans: [s for s in spans if s.name == "compressed"])
    finally:
        provider.shutdown()
    assert got.attributes == {"n": 7} and got.service == "svc-gzip"
    assert receiver.bad_bodies == 0


def test_the_tree_nests_children_with_durations_and_names_linked_spans(
    receiver: TraceReceiver,
) -> None:
    api, p1 = tracer_for(receiver, "svc-api")
    worker, p2 = tracer_for(receiver, "svc-worker")
    try:
        with api.start_as_current_span("demo"), api.start_as_current_span("onceflow.enqueue"):
            pass
        with worker.start_as_current_span("holder compute") as holder:
            pass
        with (
            api.start_as_current_span("demo2"),
            worker.start_as_current_span(
                "onceflow.run evaluate", links=[Link(holder.get_span_context())]
            ),
            worker.start_as_current_span("onceflow.claim"),
        ):
            pass
        spans = receiver.wait_for(named("demo2", "onceflow.run evaluate", "onceflow.claim"))
    finally:
        p1.shutdown()
        p2.shutdown()

    text = receiver.tree(spans["demo2"].trace_id)
    lines = text.splitlines()
    assert lines[0] == f"trace {spans['demo2'].trace_id}"
    assert lines[1].startswith("demo2 [svc-api]  +0.0 ms, ")
    assert lines[2].startswith("  onceflow.run evaluate [svc-worker]  +")
    assert lines[3] == "    ↔ linked to holder compute in svc-worker"
    assert lines[4].startswith("    onceflow.claim [svc-worker]  +") and lines[4].endswith(" ms")
    assert len(lines) == 5  # the other traces' spans are not in it


def test_a_span_whose_parent_was_not_received_is_a_root_of_its_own() -> None:
    child = Span("t" * 32, "c" * 16, "p" * 16, "child", "INTERNAL", 10, 2_000_010, "svc")
    text = render_tree([child])
    assert text.splitlines()[1] == "child [svc]  +0.0 ms, 2.0 ms (parent not received)"
    assert render_tree([]) == "(no spans)"


def _post(
    receiver: TraceReceiver, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_it_answers_as_a_collector_and_keeps_no_undecodable_body(
    receiver: TraceReceiver,
) -> None:
    protobuf = {"Content-Type": "application/x-protobuf"}
    status, body = _post(receiver, "/v1/traces", b"", protobuf)
    assert status == 200
    response = ExportTraceServiceResponse()
    response.ParseFromString(body)  # an empty, well-formed response
    assert not response.HasField("partial_success")
    assert _post(receiver, "/v1/metrics", b"", protobuf)[0] == 404
    assert _post(receiver, "/v1/traces", b"{}", {"Content-Type": "application/json"})[0] == 415
    bad_gzip = {**protobuf, "Content-Encoding": "gzip"}
    assert _post(receiver, "/v1/traces", b"not gzip", bad_gzip)[0] == 400
    assert _post(receiver, "/v1/traces", gzip.compress(b"\xff\xff\xff"), bad_gzip)[0] == 200
    assert receiver.spans() == []
    assert receiver.bad_bodies == 1  # the body that was not a trace request


def test_wait_for_gives_up_at_its_timeout(receiver: TraceReceiver) -> None:
    with pytest.raises(TimeoutError, match="0 received"):
        receiver.wait_for(lambda spans: spans, timeout=0.05)
