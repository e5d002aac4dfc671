"""A stand-in LLM provider and result store: a local HTTP server that counts every request.

The provider's request counter is the truth of "how many calls were paid for",
not onceflow's own counters. One server (stdlib ``http.server``, threaded, on
127.0.0.1 and a free port) serves:

- ``POST /provider/<cell>``: one paid call; answers ``answer-<cell>-<n>`` for the
  n-th call of the cell after ``?hold=<s>`` seconds of simulated latency. A cell
  marked with :meth:`StandIn.block_next` holds its next call until
  :meth:`StandIn.unblock`; one marked with :meth:`StandIn.fail_next` answers 500.
- ``GET /store/<cell>`` / ``PUT /store/<cell>``: the result store, first writer
  wins (``PUT`` answers 201 when it stored, 200 when it kept an earlier value).
- ``POST /mark/<cell>``: a caller says it is now waiting for the holder.

The client functions below are what caller processes use.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

BLOCK_LIMIT_SECONDS = 120.0


class StandIn:
    """The server and its counters (thread-safe), for the test process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.store: dict[str, str] = {}
        self.store_writes: Counter[str] = Counter()
        self.marks: Counter[str] = Counter()
        self._blocked: dict[str, threading.Event] = {}  # cell -> gate of its next call
        self._gates: dict[str, threading.Event] = {}  # every gate handed out, for unblock
        self._failing: set[str] = set()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> StandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.unblock()
        self.server.shutdown()
        self.server.server_close()

    def block_next(self, cell: str) -> None:
        """Hold the cell's next provider call until :meth:`unblock`."""
        with self.lock:
            self._blocked[cell] = self._gates[cell] = threading.Event()

    def unblock(self, cell: str | None = None) -> None:
        with self.lock:
            cells = list(self._gates) if cell is None else [cell]
            events = [self._gates.pop(c) for c in cells if c in self._gates]
            for c in cells:
                self._blocked.pop(c, None)
        for event in events:
            event.set()

    def fail_next(self, cell: str) -> None:
        """Answer the cell's next provider call with a 500 (it is still counted)."""
        with self.lock:
            self._failing.add(cell)

    def total_calls(self) -> int:
        with self.lock:
            return sum(self.calls.values())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # 64+ processes connect at once; the stdlib default is 5

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a caller killed with kill -9 mid-call leaves a broken pipe: expected


def _handler(standin: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _reply(self, status: int, body: Any = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[str, str, dict[str, list[str]]]:
            parts = urlsplit(self.path)
            _, kind, cell = parts.path.split("/", 2)
            return kind, cell, parse_qs(parts.query)

        def do_POST(self) -> None:
            kind, cell, query = self._route()
            if kind == "mark":
                with standin.lock:
                    standin.marks[cell] += 1
                return self._reply(200)
            with standin.lock:
                standin.calls[cell] += 1
                n = standin.calls[cell]
                gate = standin._blocked.pop(cell, None)  # only the next call
                fail = cell in standin._failing
                standin._failing.discard(cell)
            if gate is not None:
                gate.wait(BLOCK_LIMIT_SECONDS)
            hold = float(query.get("hold", ["0"])[0])
            if hold:
                time.sleep(hold)  # simulated provider latency, not a test condition
            if fail:
                return self._reply(500, {"error": "provider failed"})
            self._reply(200, {"value": f"answer-{cell}-{n}"})

        def do_GET(self) -> None:
            _, cell, _ = self._route()
            with standin.lock:
                value = standin.store.get(cell)
            if value is None:
                return self._reply(404)
            self._reply(200, {"value": value})

        def do_PUT(self) -> None:
            _, cell, _ = self._route()
            value = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["value"]
            with standin.lock:
                standin.store_writes[cell] += 1
                created = cell not in standin.store
                if created:
                    standin.store[cell] = value
            self._reply(201 if created else 200)

    return Handler


# ----------------------------------------------------------------- client side


class ProviderError(Exception):
    """The stand-in provider answered an error."""


def _request(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - our http URL
    try:
        with urllib.request.urlopen(req, timeout=BLOCK_LIMIT_SECONDS + 30) as resp:  # noqa: S310
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None


def call_provider(base: str, cell: str, hold: float = 0.0) -> str:
    """One paid call: the provider's answer for ``cell``."""
    status, body = _request("POST", f"{base}/provider/{cell}?hold={hold}", {})
    if status != 200:
        raise ProviderError(f"provider answered {status}")
    return str(body["value"])


def store_get(base: str, cell: str) -> str | None:
    """The stored value of ``cell``, or None."""
    status, body = _request("GET", f"{base}/store/{cell}")
    return str(body["value"]) if status == 200 else None


def store_put(base: str, cell: str, value: str) -> bool:
    """Store ``value``; False if an earlier value was kept (first writer wins)."""
    status, _ = _request("PUT", f"{base}/store/{cell}", {"value": value})
    return status == 201


def mark_waiting(base: str, cell: str) -> None:
    """Tell the test that a caller of ``cell`` is now waiting for the holder."""
    _request("POST", f"{base}/mark/{cell}", {})
