"""A cap on request bodies, enforced before anything parses them (413).

Starlette reads a whole body into memory with no cap; a chunked body also
bypasses a check of ``Content-Length`` alone. This ASGI middleware refuses a
declared length over the limit at once, and counts the bytes of a streamed
body as they arrive, answering 413 as soon as the count passes the limit. What
it lets through is at most ``max_body_bytes``, replayed to the app. A body that
has not arrived whole within ``body_timeout`` seconds gets 408 (a client dripping
a body byte by byte cannot hold a connection, and a worker thread, for long).
"""

from __future__ import annotations

import json

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# An oversize body is read and thrown away up to this many times the limit, so that a
# well-behaved client that is still sending gets to read the 413 instead of a reset.
_DRAIN_FACTOR = 8


class BodyLimitMiddleware:
    """ASGI middleware: 413 for bodies over ``max_body_bytes`` (declared or streamed)."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, *, body_timeout: float | None = None
    ) -> None:
        """``body_timeout``: seconds a client has to send its whole body (None: no bound)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Buffer the body up to the limit, then hand it to the app; 413 past the limit."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared == -1:
            await _reply(send, 400, "bad_request", "Content-Length is not a number")
            return
        if declared is not None and declared > limit:
            if declared <= limit * _DRAIN_FACTOR:
                await _drain(receive, limit * _DRAIN_FACTOR)
            await _too_large(send, limit)
            return
        chunks: list[bytes] = []
        total = 0
        more = True
        with anyio.move_on_after(self.body_timeout) as waiting:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client went away; nothing to answer
                body = message.get("body", b"")
                total += len(body)
                more = bool(message.get("more_body", False))
                if total > limit:
                    if more:
                        await _drain(receive, limit * _DRAIN_FACTOR - total)
                    await _too_large(send, limit)
                    return
                chunks.append(body)
        if waiting.cancelled_caught:
            detail = f"the request body did not arrive within {self.body_timeout:g} s"
            await _reply(send, 408, "request_timeout", detail)
            return
        buffered = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": buffered, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the app expects

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None if not declared, -1 if malformed."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                n = int(value)
            except ValueError:
                return -1
            return n if n >= 0 else -1
    return None


async def _drain(receive: Receive, budget: int) -> None:
    """Read and discard what the client still sends, up to ``budget`` bytes."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _too_large(send: Send, limit: int) -> None:
    await _reply(send, 413, "payload_too_large", f"the request body is over {limit} bytes")


async def _reply(send: Send, status: int, code: str, detail: str) -> None:
    body = json.dumps({"detail": detail, "code": code}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
