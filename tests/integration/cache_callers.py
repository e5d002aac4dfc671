"""Callers of ``compute_once(..., cache=...)`` for the result-cache tests, importable by
spawned processes: each asks a stand-in LLM provider (a local HTTP server that counts
requests) under a provider permit, and stores the answer in a cell of its own."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from onceflow.cache import CacheKey
from onceflow.locks import compute_once
from onceflow.spend import Price, Provider, Usage


class CountingProvider:
    """A stand-in provider: answers each POST after ``delay`` seconds, counting them."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.prompts: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.prompts.append(body["prompt"])
                time.sleep(owner.delay)  # the call's own latency: callers overlap in flight
                answer = {"text": f"answer to {body['prompt']}", "input_tokens": 1000,
                          "output_tokens": 200}  # fmt: skip
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/complete"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def calls(self) -> int:
        with self.lock:
            return len(self.prompts)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: $2.50 / $10 per million tokens: an answer of 1000 in, 200 out costs 0.0045.
PRICE = Price("2.50", "10.00")


def provider(redis_url: str, name: str = "cache-llm") -> Provider:
    return Provider(name, redis_url=redis_url, price=PRICE, model="stand-in", cold_start="empty")


def ask(url: str, llm: Provider, workspace_id: str, prompt: str) -> str:
    """One provider call under a permit, settled with its usage."""
    with llm.permit(workspace_id, tokens=1500, timeout=30) as permit:
        data = json.dumps({"prompt": prompt}).encode()
        request = urllib.request.Request(url, data=data, method="POST")  # noqa: S310 (local http)
        with urllib.request.urlopen(request, timeout=30) as reply:  # noqa: S310
            answer = json.loads(reply.read())
        permit.settle(Usage(answer["input_tokens"], answer["output_tokens"]))
    return str(answer["text"])


def summarise(
    url: str,
    redis_url: str,
    workspace_id: str,
    job_id: str,
    scope: str,
    prompt: str,
    ttl: float,
    barrier: Any = None,
) -> tuple[str, str, bool]:
    """``compute_once`` of one cell with the prompt as the cache key, in a process of its
    own: (the path that served it, the value, whether the cell was filled with it)."""
    cells: dict[str, str] = {}
    llm = provider(redis_url)
    if barrier is not None:
        barrier.wait(timeout=60)  # every process calls at once
    outcome = compute_once(
        workspace_id, job_id, "summary",
        check=lambda: cells.get("summary"),
        compute=lambda: ask(url, llm, workspace_id, prompt),
        store=lambda value: cells.setdefault("summary", value),
        cache=CacheKey(scope, prompt, ttl),  # type: ignore[arg-type]
    )  # fmt: skip
    return outcome.path.value, outcome.value, cells.get("summary") == outcome.value
