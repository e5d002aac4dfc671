"""A cap on request bodies, enforced before anything parses them (413, 422).

Starlette reads a whole body into memory with no cap; a chunked body also
bypasses a check of ``Content-Length`` alone. This ASGI middleware refuses a
declared length over the limit at once, and counts the bytes of a streamed
body as they arrive, answering 413 as soon as the count passes the limit. What
it lets through is at most ``max_body_bytes``, replayed to the app. A body that
has not arrived whole within ``body_timeout`` seconds gets 408 (a client dripping
a body byte by byte cannot hold a connection, and a worker thread, for long).

A JSON body is then scanned, without parsing it, and refused with 422
``invalid_request`` if its arrays/objects nest deeper than ``max_json_depth``
(Python's json parser would recurse on it, and pydantic's serializer fail on
what it stored), or if it holds ``NaN``/``Infinity`` literals or a number too
large for a float (``1e400``): standard JSON has none of them, Python's json
reads them as floats that no store can hold.
"""

from __future__ import annotations

import email.message
import json
import math
import re

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from onceflow.payloads import bracket_depth, strip_json_strings
from onceflow.settings import get_settings

# An oversize body is read and thrown away up to this many times the limit, so that a
# well-behaved client that is still sending gets to read the 413 instead of a reset.
_DRAIN_FACTOR = 8
#: Levels a request body adds around a payload (``{"then": [{"input": …}]}``): the body may
#: nest this much deeper than ``ONCEFLOW_MAX_PAYLOAD_DEPTH``; the payload's own limit is
#: checked exactly where it is stored.
BODY_ENVELOPE_DEPTH = 4

_NON_FINITE = re.compile(rb"NaN|Infinity")
_DIGITS_TO_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_BIG_EXPONENTS = tuple(e + sign + b"000" for e in (b"e", b"E") for sign in (b"", b"+"))
_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


class BodyLimitMiddleware:
    """ASGI middleware: 413 for bodies over ``max_body_bytes`` (declared or streamed)."""

    # Parameters alike only by shape to other constructors' signatures.
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_json_depth: int | None = None,
        *,
        body_timeout: float | None = None,
    ) -> None:
        """``max_json_depth``: deepest nesting of a JSON body; by default the settings'
        ``max_payload_depth`` plus :data:`BODY_ENVELOPE_DEPTH`. ``body_timeout``: seconds
        a client has to send its whole body (None: no bound)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        if max_json_depth is None:
            max_json_depth = get_settings().max_payload_depth + BODY_ENVELOPE_DEPTH
        self.max_json_depth = max_json_depth
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
                with anyio.move_on_after(self.body_timeout):  # a slow sender is not waited for
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
        if buffered and _is_json(scope):
            if json.detect_encoding(buffered) not in _UTF8:
                # UTF-16 or UTF-32, which Python's json reads but this scan cannot: refused
                # (RFC 8259: JSON between systems is UTF-8), never parsed unscanned.
                await _reply(send, 400, "bad_request", "the request body is not UTF-8 JSON")
                return
            problem = json_body_problem(buffered, self.max_json_depth)
            if problem is not None:
                await _reply(send, 422, "invalid_request", problem)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": buffered, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the app expects

        await self.app(scope, replay, send)


def json_body_problem(body: bytes, max_depth: int) -> str | None:
    """Why a JSON body must be refused before it is parsed, or None (a scan, not a parse)."""
    maybe_deep = body.count(b"[") + body.count(b"{") > max_depth
    maybe_nan = b"NaN" in body or b"Infinity" in body
    maybe_huge = _maybe_huge(body)
    if not (maybe_deep or maybe_nan or maybe_huge):
        return None  # the common case: three C-speed searches
    bare = strip_json_strings(body)
    depth = bracket_depth(bare) if maybe_deep else 0
    if depth > max_depth:
        return (
            f"the request body nests {depth} levels deep, over the limit of {max_depth} "
            f"(ONCEFLOW_MAX_PAYLOAD_DEPTH plus {BODY_ENVELOPE_DEPTH} for the request's own fields)"
        )
    if maybe_nan and _NON_FINITE.search(bare):
        return "the request body holds NaN or Infinity, which JSON does not allow"
    if maybe_huge and _maybe_huge(bare):
        for match in _NUMBER.finditer(bare):
            number = match.group()
            if any(c in number for c in b".eE") and math.isinf(float(number)):
                shown = number[:20].decode() + ("…" if len(number) > 20 else "")
                return f"the request body holds a number too large for a float: {shown}"
    return None


def _maybe_huge(data: bytes) -> bool:
    """Whether ``data`` may hold a number that overflows a float: an exponent of three
    digits or more, or a run of 309 digits."""
    zeros = data.translate(_DIGITS_TO_ZERO)
    return b"0" * 309 in zeros or any(e in zeros for e in _BIG_EXPONENTS)


#: What ``json.detect_encoding`` calls a UTF-8 body (with or without a byte-order mark).
_UTF8 = ("utf-8", "utf-8-sig")


def _is_json(scope: Scope) -> bool:
    """Whether FastAPI would parse this body as JSON: no (or an empty) content type, or a
    JSON one — read as FastAPI reads it (``email.message``, the header as latin-1), so that
    no spelling it parses as JSON (``application/json\xa0``) escapes the scan."""
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            text = value.decode("latin-1")
            if not text:
                return True
            message = email.message.Message()
            message["content-type"] = text
            if message.get_content_maintype() != "application":
                return False
            subtype = message.get_content_subtype()
            return subtype == "json" or subtype.endswith("+json")
    return True


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
