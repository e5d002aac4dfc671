"""A small OTLP/HTTP trace receiver: where ``onceflow demo --trace`` (and the tests, and
``bench/tracing_bench.py``) send their spans, to read them back as plain objects.

It answers ``POST /v1/traces`` as an OpenTelemetry collector does: the body is an
``ExportTraceServiceRequest`` in the protobuf wire format (``application/x-protobuf``,
plain or ``gzip``/``deflate`` per ``Content-Encoding``), the answer an empty
``ExportTraceServiceResponse``. Bodies are kept as they arrive and decoded when spans are
read, so a busy exporter costs the receiving process little more than reading the socket.

Development only: it needs ``opentelemetry-proto`` (which the ``otel`` extra's exporter
brings), keeps everything in memory and listens on the loopback interface.
"""

from __future__ import annotations

import functools
import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple, TypeVar

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

T = TypeVar("T")

#: OTLP's span kinds by their wire number (``SPAN_KIND_…`` without the prefix).
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
#: OTLP's status codes by their wire number.
STATUSES = {0: "UNSET", 1: "OK", 2: "ERROR"}
#: The largest body accepted (the SDK's batches are far smaller).
MAX_BODY = 64 * 1024 * 1024


class Link(NamedTuple):
    """A span's link: the span it points at, and the link's own attributes."""

    trace_id: str
    span_id: str
    attributes: dict[str, Any]


class Event(NamedTuple):
    """An event recorded on a span."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One received span; ids in lowercase hex (``parent_span_id`` None for a root)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    service: str | None
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[Link, ...] = ()
    events: tuple[Event, ...] = ()
    status: str = "UNSET"
    status_message: str = ""

    @property
    def duration_ms(self) -> float:
        """How long the span lasted, in milliseconds."""
        return (self.end_ns - self.start_ns) / 1e6


def value_of(value: AnyValue) -> Any:
    """An OTLP attribute value as Python: str, bool, int, float, bytes, tuple or dict."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(value_of(v) for v in value.array_value.values)
    if which == "kvlist_value":
        return attributes_of(value.kvlist_value.values)
    return getattr(value, which)


def attributes_of(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP key-value pairs as a dict."""
    return {kv.key: value_of(kv.value) for kv in pairs}


def decode(body: bytes) -> list[Span]:
    """The spans of one ``ExportTraceServiceRequest`` body (protobuf wire format)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[Span] = []
    for resource_spans in request.resource_spans:
        service = attributes_of(resource_spans.resource.attributes).get("service.name")
        for scope_spans in resource_spans.scope_spans:
            spans.extend(_span_of(s, service) for s in scope_spans.spans)
    return spans


def _span_of(s: Any, service: str | None) -> Span:
    """One OTLP ``Span`` message as a :class:`Span`."""
    return Span(
        trace_id=s.trace_id.hex(),
        span_id=s.span_id.hex(),
        parent_span_id=s.parent_span_id.hex() or None,
        name=s.name,
        kind=KINDS.get(s.kind, str(s.kind)),
        start_ns=s.start_time_unix_nano,
        end_ns=s.end_time_unix_nano,
        service=service,
        attributes=attributes_of(s.attributes),
        links=tuple(
            Link(link.trace_id.hex(), link.span_id.hex(), attributes_of(link.attributes))
            for link in s.links
        ),
        events=tuple(
            Event(e.name, e.time_unix_nano, attributes_of(e.attributes)) for e in s.events
        ),
        status=STATUSES.get(s.status.code, str(s.status.code)),
        status_message=s.status.message,
    )


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the spans are the log."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0 or length > MAX_BODY:
            self._answer(413)
            return
        body = self.rfile.read(length)
        if self.path.split("?", 1)[0] != "/v1/traces":
            self._answer(404)
            return
        kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if kind != "application/x-protobuf":
            self._answer(415)
            return
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding != "identity":
                self._answer(415)
                return
        except (OSError, EOFError, zlib.error):
            self._answer(400)
            return
        self.server.receiver.received(body)
        self._answer(200, ExportTraceServiceResponse().SerializeToString())

    def _answer(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, receiver: TraceReceiver, port: int) -> None:
        self.receiver = receiver
        super().__init__(("127.0.0.1", port), _Handler)


class TraceReceiver:
    """An OTLP/HTTP trace receiver on ``127.0.0.1`` (a free port unless ``port`` is given).

    Use it as a context manager, or :meth:`start` and :meth:`stop`. :attr:`endpoint` is
    what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes (the exporter appends ``/v1/traces``).
    """

    def __init__(self, port: int = 0) -> None:
        self._server = _Server(self, port)
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()
        self._pending: list[bytes] = []
        self._spans: list[Span] = []
        #: Bodies and bytes received (``bytes_received`` after decompression).
        self.requests = 0
        self.bytes_received = 0
        #: Bodies that did not decode (dropped).
        self.bad_bodies = 0

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """The base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_url(self) -> str:
        """The full traces URL (an exporter's ``endpoint=`` argument)."""
        return f"{self.endpoint}/v1/traces"

    def start(self) -> TraceReceiver:
        """Serve in a daemon thread; returns itself."""
        self._thread = threading.Thread(
            target=functools.partial(self._server.serve_forever, poll_interval=0.05),
            name="otlp-receiver",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (the spans received stay readable)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> TraceReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def received(self, body: bytes) -> None:
        """Keep one request's body (decoded when spans are read) and wake the waiters."""
        with self._changed:
            self._pending.append(body)
            self.requests += 1
            self.bytes_received += len(body)
            self._changed.notify_all()

    def _decode_pending(self) -> None:
        """Decode the bodies received since the last read (the caller holds the lock)."""
        pending, self._pending = self._pending, []
        for body in pending:
            try:
                self._spans.extend(decode(body))
            except Exception:  # a body that is not a trace request is dropped, and counted
                self.bad_bodies += 1

    def spans(self) -> list[Span]:
        """Every span received so far, in arrival order."""
        with self._changed:
            self._decode_pending()
            return list(self._spans)

    def wait_for(self, predicate: Callable[[list[Span]], T], timeout: float = 30.0) -> T:
        """Wait until ``predicate(spans)`` is truthy (checked on each arrival) and return
        its value; :class:`TimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                self._decode_pending()
                value = predicate(list(self._spans))
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no spans matched within {timeout}s ({len(self._spans)} received)"
                    )
                self._changed.wait(left)

    def trace(self, trace_id: str) -> list[Span]:
        """The spans of one trace, by start time."""
        return sorted((s for s in self.spans() if s.trace_id == trace_id),
                      key=lambda s: s.start_ns)  # fmt: skip

    def tree(self, trace_id: str) -> str:
        """The trace as an indented tree (see :func:`render_tree`)."""
        return render_tree(self.trace(trace_id), self.spans())


def render_tree(spans: list[Span], known: Iterable[Span] = ()) -> str:
    """``spans`` (one trace) as an indented tree, a line per span: its offset from the
    trace's start, its duration, its name and service, then a line per link
    (``↔ linked to <name> in <service>``; the linked span looked up in ``known``).

    A span whose parent was not received (a remote parent, a span still open) starts a
    root of its own, marked so.
    """
    if not spans:
        return "(no spans)"
    by_id = {s.span_id: s for s in known}
    by_id.update({s.span_id: s for s in spans})
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[Span]] = {}
    for s in spans:
        parent = s.parent_span_id if s.parent_span_id in ids else None
        children.setdefault(parent, []).append(s)
    for group in children.values():
        group.sort(key=lambda s: (s.start_ns, s.name))
    start = min(s.start_ns for s in spans)
    lines = [f"trace {spans[0].trace_id}"]

    def walk(span: Span, depth: int) -> None:
        pad = "  " * depth
        offset = (span.start_ns - start) / 1e6
        where = f" [{span.service}]" if span.service else ""
        orphan = " (parent not received)" if span.parent_span_id and depth == 0 else ""
        error = " ERROR" if span.status == "ERROR" else ""
        lines.append(
            f"{pad}{span.name}{where}  +{offset:.1f} ms, {span.duration_ms:.1f} ms{error}{orphan}"
        )
        for link in span.links:
            target = by_id.get(link.span_id)
            if target is None:
                lines.append(f"{pad}  ↔ linked to span {link.span_id} (not received)")
            else:
                service = target.service or "unknown service"
                lines.append(f"{pad}  ↔ linked to {target.name} in {service}")
        for child in children.get(span.span_id, []):
            walk(child, depth + 1)

    for root in children.get(None, []):
        walk(root, 0)
    return "\n".join(lines)


__all__ = [
    "Event",
    "Link",
    "Span",
    "TraceReceiver",
    "attributes_of",
    "decode",
    "render_tree",
    "value_of",
]
