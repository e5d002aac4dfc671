"""Local stand-ins for the third-party services: an LLM and a Maps commute API.

Real HTTP servers on 127.0.0.1 that answer like the real thing (an OpenAI-compatible
``POST /v1/chat/completions``; ``GET /v1/commute?origin=…&destination=…``), with a
realistic latency, and that count every request they receive — so a saving is
measured at the provider, not claimed. ``GET /stats`` returns the counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the counts are the log."""

    def handle(self) -> None:
        # Marked as carrying a request once its first byte (or its caller's close) is in: a
        # peek takes nothing off the socket, so up to the mark the socket still reads as
        # readable, and StandIn.quiesce sees no gap between the two. One request per
        # connection: HTTP/1.0 (the default protocol_version), no keep-alive.
        with contextlib.suppress(OSError):
            self.request.recv(1, socket.MSG_PEEK)
        self.server.reading(self.request)
        super().handle()

    def _count(self, key: str) -> None:
        self.server.count(key)
        self.server.settled(self.request)

    def _cors(self) -> None:
        # A browser tab may call the stand-in directly (the SDK tests' tabs do); a real
        # deployment proxies provider calls through its own back end instead.
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._cors()
        self.end_headers()
        # The caller may be gone (a worker killed mid-call): that is the demo's fault, not ours.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)

    def do_OPTIONS(self) -> None:
        """A CORS preflight: allowed, and not counted (it is no provider call)."""
        self.send_response(204)
        self._cors()
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/stats":
            self._send(200, self.server.stats())
            return
        if url.path == "/v1/commute" and self.server.kind == "maps":
            query = parse_qs(url.query)
            origin = query.get("origin", [""])[0]
            destination = query.get("destination", [""])[0]
            key = f"commute:{origin}->{destination}"
            self._count(key)
            with self.server.in_flight(key):
                time.sleep(self.server.latency)
            minutes = (
                10 + int(hashlib.sha256(f"{origin}|{destination}".encode()).hexdigest(), 16) % 50
            )
            self._send(200, {"origin": origin, "destination": destination, "minutes": minutes})
            return
        self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        if urlparse(self.path).path != "/v1/chat/completions" or self.server.kind != "llm":
            self._send(404, {"error": "not found"})
            return
        if self.headers.get("Authorization", "") != f"Bearer {self.server.api_key}":
            self._send(401, {"error": {"message": "invalid api key"}})
            return
        length = int(self.headers.get("Content-Length", "0"))
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            prompt = str(body["messages"][-1]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            self._send(400, {"error": {"message": "bad request"}})
            return
        # The demo's prompts start with a cell key line ("cell: job-3/eval:fit"), which is
        # what lets the stand-in count calls per cell.
        first = prompt.splitlines()[0] if prompt else ""
        key = first.removeprefix("cell: ") if first.startswith("cell: ") else "other"
        self._count(key)
        with self.server.in_flight(key):
            time.sleep(self.server.latency)
        score = int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 100 / 100
        self._send(
            200,
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "model": body.get("model", "standin"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": json.dumps({"score": score})},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": 8},
            },
        )


class StandIn(ThreadingHTTPServer):
    """A counting stand-in server; ``kind`` is ``"llm"`` or ``"maps"``."""

    daemon_threads = True
    # Many callers connect at once (every worker child, the demo's clients, a benchmark's
    # 64): the socketserver default of 5 queued connections would make the kernel drop
    # the rest's SYNs, a second's retransmit each, measured as the provider's latency.
    request_queue_size = 128

    #: The request handler (a subclass may stand in, e.g. a test's that stalls).
    handler: type[_Handler] = _Handler

    def __init__(self, kind: str, *, latency: float, api_key: str = "") -> None:
        super().__init__(("127.0.0.1", 0), self.handler)
        self.kind = kind
        self.latency = latency
        self.api_key = api_key
        self._counts: Counter[str] = Counter()
        self._timeline: list[float] = []
        self._inflight: Counter[str] = Counter()
        # Connections accepted and not yet counted or closed, each with whether its first
        # byte has come in: see quiesce().
        self._unsettled: dict[socket.socket, bool] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self.serve_forever, name=f"standin-{kind}", daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """Accepted (in the serving thread, in the order the kernel queued the connections)."""
        with self._lock:
            self._unsettled[request] = False
        super().process_request(request, client_address)

    def reading(self, conn: socket.socket) -> None:
        """``conn`` carries a request (its first byte is in): counted once it settles."""
        with self._lock:
            if conn in self._unsettled:
                self._unsettled[conn] = True

    def settled(self, conn: socket.socket) -> None:
        """``conn``'s request is counted (or the connection closed): no longer waited for."""
        with self._lock:
            self._unsettled.pop(conn, None)

    def shutdown_request(self, request: Any) -> None:
        """Closed (on every path: answered, refused, failed, or its thread never started)."""
        self.settled(request)
        super().shutdown_request(request)

    def quiesce(self, timeout: float = 10.0) -> bool:
        """Wait until every request already sent to this server is counted.

        For a count taken right after a caller was killed: a request it wrote just before
        it died may still be unread in the kernel's buffers, counted only once a handler
        thread reads it (under load, after the count was taken: the demo's kill fault saw
        an extra call it could not explain). A probe connection, queued behind every one
        opened before it (the kernel accepts in order), makes sure all were accepted; then
        each is waited for until its request is counted or the connection closed. One with
        no byte come in and none waiting (a browser's preconnect) holds no request and is
        not waited for. True when settled; False at ``timeout`` or if the server does not
        answer the probe.
        """
        deadline = time.monotonic() + timeout
        host, port = self.server_address[:2]
        try:
            with socket.create_connection((str(host), int(port)), timeout=timeout) as probe:
                probe.sendall(b"GET /stats HTTP/1.0\r\n\r\n")
                while True:
                    probe.settimeout(max(0.001, deadline - time.monotonic()))
                    if not probe.recv(65536):
                        break
        except OSError:
            return False
        with self._lock:
            earlier = set(self._unsettled)
        while True:
            with self._lock:
                left = [(c, self._unsettled[c]) for c in earlier if c in self._unsettled]
            if not any(started or _readable(c) for c, started in left):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def count(self, key: str) -> None:
        """Count one request (for ``key``: a cell, a commute)."""
        with self._lock:
            self._counts[key] += 1
            self._timeline.append(time.monotonic())

    @contextlib.contextmanager
    def in_flight(self, key: str) -> Iterator[None]:
        """Mark ``key`` as being answered (its caller may die meanwhile)."""
        with self._lock:
            self._inflight[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._inflight[key] -= 1

    def inflight(self) -> int:
        """Requests received and not yet answered."""
        with self._lock:
            return sum(self._inflight.values())

    def inflight_keys(self) -> list[str]:
        """The keys of the requests not yet answered."""
        with self._lock:
            return [k for k, n in self._inflight.items() for _ in range(n)]

    def stats(self) -> dict[str, Any]:
        """Requests received: total and per key."""
        with self._lock:
            return {"total": sum(self._counts.values()), "per_key": dict(self._counts)}

    def timeline(self) -> list[float]:
        """Monotonic times of every request (for the plot)."""
        with self._lock:
            return list(self._timeline)

    def start(self) -> StandIn:
        """Serve in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()


def _readable(conn: socket.socket) -> bool:
    """Bytes (or the caller's close) waiting on ``conn``; a closed socket has none."""
    fd = conn.fileno()
    if fd < 0:
        return False
    poller = select.poll()  # not select.select: any descriptor number, 1024 and over too
    poller.register(fd, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return False
