"""A stand-in LLM provider that enforces its limits the way real providers do.

A local HTTP server, run as a process of its own (``python -m bench.harness.provider``), so
that its timing does not share a GIL with the callers it measures. One account: requests
and tokens are counted over a sliding window (60 s by default, shorter for a quick run,
with limits scaled alike); a call beyond either limit answers **429** with ``Retry-After``
(whole seconds, rounded up) and ``Retry-After-Ms`` (what OpenAI's API also sends), and a
refused call takes nothing from the window. An accepted call answers after ``latency``.

``POST /v1/complete`` with JSON ``{"workspace": …, "prompt": …, "max_tokens": n}``: the
input tokens are the prompt's words (:func:`count_tokens`, the client's "tokenizer"), the
output tokens a deterministic share of ``max_tokens`` (half to all of it, by the prompt's
hash), and both count toward the token limit at arrival. The answer is
``{"text", "input_tokens", "output_tokens"}``.

``GET /stats``: requests, 429s and tokens, per workspace (calls, tokens, last arrival),
calls per distinct ``(workspace, prompt)``, the accepted arrivals' times and tokens, and
the most requests and tokens accepted within any one window. ``POST /reset`` forgets it
all, windows included. Times are seconds on the server's monotonic clock.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.harness.processes import Proc, wait_for
from bench.harness.redis_server import free_port


def count_tokens(prompt: str) -> int:
    """A prompt's input tokens as the stand-in counts them: its whitespace-separated words
    (what a client's tokenizer would tell it before the call)."""
    return len(prompt.split())


def output_tokens(prompt: str, max_tokens: int) -> int:
    """The output tokens the stand-in answers ``prompt`` with: half to all of ``max_tokens``."""
    digest = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big")
    half = max_tokens // 2
    return half + digest % (max_tokens - half + 1)


class Window:
    """Requests and tokens accepted within the last ``seconds``: an exact sliding log."""

    def __init__(self, rpm: int, tpm: int, seconds: float) -> None:
        self.rpm, self.tpm, self.seconds = rpm, tpm, seconds
        self.log: deque[tuple[float, int]] = deque()
        self.tokens = 0

    def admit(self, now: float, tokens: int) -> float:
        """Take the call if both limits allow it (0.0), else the seconds until they would."""
        while self.log and self.log[0][0] <= now - self.seconds:
            self.tokens -= self.log.popleft()[1]
        if len(self.log) + 1 <= self.rpm and self.tokens + tokens <= self.tpm:
            self.log.append((now, tokens))
            self.tokens += tokens
            return 0.0
        wait = 0.0
        if len(self.log) + 1 > self.rpm:
            wait = self.log[len(self.log) - self.rpm][0] + self.seconds - now
        if self.tokens + tokens > self.tpm:
            freed, need = 0, self.tokens + tokens - self.tpm
            for at, n in self.log:
                freed += n
                if freed >= need:
                    wait = max(wait, at + self.seconds - now)
                    break
        return max(wait, 0.001)


class Account:
    """The stand-in's one account: its window and everything it counts."""

    def __init__(self, rpm: int, tpm: int, window: float) -> None:
        self.limits = (rpm, tpm, window)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        rpm, tpm, window = self.limits
        self.window = Window(rpm, tpm, window)
        self.requests = 0
        self.rejected = 0
        self.accepted: list[tuple[float, int]] = []
        self.per_workspace: dict[str, dict[str, Any]] = {}
        self.per_prompt: Counter[str] = Counter()
        self.first_arrival: float | None = None

    def call(self, workspace: str, prompt: str, tokens: int) -> float:
        """One arriving call: 0.0 when accepted, else the Retry-After in seconds."""
        now = time.monotonic()
        with self.lock:
            self.requests += 1
            if self.first_arrival is None:
                self.first_arrival = now
            wait = self.window.admit(now, tokens)
            ws = self.per_workspace.setdefault(
                workspace, {"calls": 0, "tokens": 0, "rejected": 0, "last": None}
            )
            if wait:
                self.rejected += 1
                ws["rejected"] += 1
                return wait
            self.accepted.append((now, tokens))
            ws["calls"] += 1
            ws["tokens"] += tokens
            ws["last"] = now
            self.per_prompt[f"{workspace}\n{prompt}"] += 1
            return 0.0

    def stats(self) -> dict[str, Any]:
        rpm, tpm, window = self.limits
        with self.lock:
            accepted = list(self.accepted)
            out = {
                "rpm": rpm,
                "tpm": tpm,
                "window_seconds": window,
                "requests": self.requests,
                "rejected": self.rejected,
                "accepted": len(accepted),
                "tokens": sum(n for _, n in accepted),
                "first_arrival": self.first_arrival,
                "per_workspace": {k: dict(v) for k, v in self.per_workspace.items()},
                "distinct_prompts": len(self.per_prompt),
                "max_calls_per_prompt": max(self.per_prompt.values(), default=0),
                "arrivals": accepted,
            }
        out["most_in_a_window"] = most_in_a_window(accepted, window)
        return out


def most_in_a_window(arrivals: list[tuple[float, int]], window: float) -> dict[str, int]:
    """The most requests and tokens among ``arrivals`` (time, tokens) within any ``window``."""
    most_calls = most_tokens = tokens = 0
    start = 0
    for end, (at, n) in enumerate(arrivals):
        tokens += n
        while arrivals[start][0] <= at - window:
            tokens -= arrivals[start][1]
            start += 1
        most_calls = max(most_calls, end - start + 1)
        most_tokens = max(most_tokens, tokens)
    return {"calls": most_calls, "tokens": most_tokens}


class _Handler(BaseHTTPRequestHandler):
    server: ProviderServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the counts are the log."""

    def _send(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/stats":
            self._send(200, self.server.account.stats())
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if self.path == "/reset":
            self.rfile.read(length)
            self.server.account.reset()
            self._send(200, {"reset": True})
            return
        if self.path != "/v1/complete":
            self._send(404, {"error": "not found"})
            return
        try:
            body = json.loads(self.rfile.read(length))
            workspace, prompt = str(body["workspace"]), str(body["prompt"])
            max_tokens = int(body["max_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"error": f"bad request: {exc}"})
            return
        n_in, n_out = count_tokens(prompt), output_tokens(prompt, max_tokens)
        wait = self.server.account.call(workspace, prompt, n_in + n_out)
        if wait:
            headers = {
                "Retry-After": str(math.ceil(wait)),
                "Retry-After-Ms": str(math.ceil(wait * 1000)),
            }
            self._send(429, {"error": "rate limit exceeded"}, headers)
            return
        time.sleep(self.server.latency)
        text = hashlib.sha256(prompt.encode()).hexdigest()[:16]
        self._send(200, {"text": text, "input_tokens": n_in, "output_tokens": n_out})


class ProviderServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, port: int, account: Account, latency: float) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.account = account
        self.latency = latency


# ----------------------------------------------------------------------------- the client


class RateLimited(Exception):
    """The stand-in answered 429; ``retry_after`` is its Retry-After in seconds."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(f"429: retry after {retry_after:.3f} s")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.retry_after,))


@dataclass(frozen=True)
class Reply:
    text: str
    input_tokens: int
    output_tokens: int


def complete(url: str, workspace: str, prompt: str, max_tokens: int, timeout: float = 30) -> Reply:
    """One call; :class:`RateLimited` on a 429 (with ``Retry-After-Ms``, else ``Retry-After``)."""
    data = json.dumps({"workspace": workspace, "prompt": prompt, "max_tokens": max_tokens})
    req = urllib.request.Request(  # noqa: S310 - the stand-in's own http URL
        url + "/v1/complete", data=data.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own URL
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:
        if err.code != 429:
            raise
        ms = err.headers.get("Retry-After-Ms")
        seconds = int(ms) / 1000 if ms else float(err.headers.get("Retry-After", 1))
        raise RateLimited(seconds) from None
    return Reply(body["text"], int(body["input_tokens"]), int(body["output_tokens"]))


def _json(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)  # noqa: S310
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - our own URL
        return json.loads(resp.read())


def provider_stats(url: str) -> dict[str, Any]:
    return _json(url + "/stats")


def provider_reset(url: str) -> None:
    _json(url + "/reset", "POST")


@contextlib.contextmanager
def standin_provider(
    *, rpm: int, tpm: int, window: float, latency: float, logdir: Path
) -> Iterator[str]:
    """The stand-in as a process of its own on a free port: its URL, once it answers."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.harness.provider", "--port", str(port), "--rpm", str(rpm),
            "--tpm", str(tpm), "--window", str(window), "--latency", str(latency)]  # fmt: skip
    proc = Proc("provider", argv, logdir, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        proc.check_alive()
        with contextlib.suppress(OSError):
            return "requests" in provider_stats(url)
        return False

    try:
        wait_for(answers, 30, "the stand-in provider")
        yield url
    finally:
        proc.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rpm", type=int, required=True, help="requests per window")
    p.add_argument("--tpm", type=int, required=True, help="tokens per window")
    p.add_argument("--window", type=float, default=60.0, help="the window, in seconds")
    p.add_argument("--latency", type=float, default=0.05, help="seconds per accepted call")
    args = p.parse_args()
    server = ProviderServer(args.port, Account(args.rpm, args.tpm, args.window), args.latency)
    print(f"stand-in provider on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
