"""A stand-in LLM provider for the cascade tests: a local HTTP server that counts every
request and enforces a limit of its own, answering 429 with ``Retry-After`` beyond it.

``POST /complete`` answers ``{"text", "input_tokens", "output_tokens"}``; ``mode`` makes it
answer 503 (``"fail"``) or hold past any client's timeout (``"hang"``).
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

from onceflow.errors import ProviderError
from onceflow.spend import Permit, Usage


class LimitedProvider:
    """The server; ``limit`` requests per ``window`` seconds, then 429 (Retry-After)."""

    def __init__(self, limit: int, window: float, retry_after: float = 1.0) -> None:
        self.limit = limit
        self.window = window
        self.retry_after = retry_after
        self.mode = "ok"
        self.lock = threading.Lock()
        self.answered: Counter[int] = Counter()
        self.seen: list[float] = []
        self.served: list[float] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, body = owner.answer()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/complete"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        now = time.monotonic()
        with self.lock:
            self.seen.append(now)
            mode = self.mode
            recent = [t for t in self.served if t > now - self.window]
            over = len(recent) >= self.limit
            if mode == "ok" and not over:
                self.served.append(now)
            status = 503 if mode == "fail" else 429 if over else 200
            if mode != "hang":
                self.answered[status] += 1
        if mode == "hang":
            time.sleep(2.0)
            return 504, {}, b""
        if status == 429:
            return 429, {"Retry-After": f"{self.retry_after:g}"}, b'{"error": "rate limited"}'
        if status == 503:
            return 503, {}, b'{"error": "overloaded"}'
        body = json.dumps({"text": "ok", "input_tokens": 12, "output_tokens": 8}).encode()
        return 200, {"Content-Type": "application/json"}, body

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def complete(url: str, permit: Permit, timeout: float = 0.5) -> str:
    """One call as a caller writes it: a 429, a 5xx or a timeout raised as ProviderError,
    the usage settled on success."""
    name = permit.provider.name
    request = urllib.request.Request(url, data=b"{}", method="POST")  # noqa: S310 (local http)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        retry_after = exc.headers.get("Retry-After")
        raise ProviderError(
            name, exc.code, retry_after=None if retry_after is None else float(retry_after)
        ) from exc
    except TimeoutError as exc:
        raise ProviderError(name, None, "no answer in time") from exc
    permit.settle(Usage(answer["input_tokens"], answer["output_tokens"]))
    return f"{name}:{answer['text']}"
