"""Server-sent events: a workspace's commit broadcasts, as a browser tab listens to them.

Every stream of an API process is fed by one :class:`EventHub` (one per event
loop), which holds ONE Redis pub/sub connection, subscribed to the channels
(:func:`onceflow.keys.workspace_channel`) of the workspaces that have listeners
(counted: the first listener subscribes, the last one unsubscribes), and fans
each message out to the streams' own bounded queues.

A stream forwards each message as an event named by its ``kind`` (``commit``
for op-log commits), with the message's JSON as ``data``. It opens with
``event: ready`` once the subscription is live, so a client that waits for it
cannot miss a commit made after; it sends a comment (``: keep-alive``) when
idle, and stops when the client goes away. A stream ends (the client
reconnects and catches up with ``GET …/ops?since=<clock>``) when:

* its client reads too slowly: its queue (``ONCEFLOW_API_SSE_QUEUE_SIZE``
  messages) is full — the stream is dropped rather than memory growing;
* the hub lost Redis (a restart): every open stream ends, and the hub
  reconnects and subscribes again for the streams that follow.

Bounds: ``ONCEFLOW_API_SSE_MAX_PER_KEY`` open streams per key and
``ONCEFLOW_API_SSE_MAX_STREAMS`` per process; past them a new stream gets 429
with ``Retry-After`` (other keys are unaffected). Redis down: 503.

This module holds the response side; the hub is in :mod:`.event_hub` (names re-exported).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from onceflow.integrations.fastapi.event_hub import (
    CLIENT_NAME,
    RECONNECT_BACKOFF,
    SUBSCRIBE_TIMEOUT,
    EventHub,
    HubUnavailable,
    Listener,
    StreamLimit,
)
from onceflow.keys import workspace_channel

log = logging.getLogger("onceflow.api.events")

__all__ = [
    "CLIENT_NAME",
    "RECONNECT_BACKOFF",
    "SUBSCRIBE_TIMEOUT",
    "EventHub",
    "EventStreamResponse",
    "HubUnavailable",
    "Listener",
    "StreamLimit",
    "event_stream",
    "format_event",
    "too_many_streams",
]


def format_event(data: bytes | str) -> str:
    """One SSE event from a broadcast message: ``event: <kind>`` and its JSON as ``data``."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    try:
        kind = json.loads(text).get("kind", "message")
    except (ValueError, AttributeError):
        kind = "message"
    if not isinstance(kind, str) or not kind.isidentifier():
        kind = "message"
    lines = "".join(f"data: {line}\n" for line in text.splitlines() or [""])
    return f"event: {kind}\n{lines}\n"


# ---------------------------------------------------------------- the response


def too_many_streams(exc: StreamLimit) -> JSONResponse:
    """429 for a stream over its bound (the rate limiter's body and headers)."""
    return JSONResponse(
        {"detail": exc.detail, "code": "rate_limited"},
        status_code=429,
        headers={
            "Retry-After": "5",
            "RateLimit-Limit": str(exc.limit),
            "RateLimit-Remaining": "0",
            "RateLimit-Reset": "5",
        },
    )


# Parameters alike by shape to EventStreamResponse's on purpose: checked here, handed on.
async def event_stream(
    hub: EventHub,
    workspace_id: str,
    key_id: str,
    keepalive_seconds: float,
    still_valid: Callable[[], Awaitable[bool]] | None = None,
    check_seconds: float = 5.0,
    accept: Callable[[bytes], bool] | None = None,
) -> Response:
    """Join the hub, wait until the subscription is live, then stream; 429 / 503 if not.

    With ``still_valid``, the stream asks it every ``check_seconds`` (idle or not) and
    ends with ``event: end`` the first time it says False (a claim's stream, once the
    claim is over). With ``accept``, the stream carries only the workspace's messages it
    says yes to (a claim's stream: its own request's news).
    """
    try:
        listener = await hub.open(workspace_channel(workspace_id), key_id, accept)
    except StreamLimit as exc:
        return too_many_streams(exc)
    except HubUnavailable as exc:
        log.warning("event stream for a workspace unavailable: %s", exc)
        return JSONResponse(
            {"detail": "the event stream is unavailable (Redis)", "code": "unavailable"},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    return EventStreamResponse(
        hub, listener, workspace_id, keepalive_seconds, still_valid, check_seconds
    )


class EventStreamResponse(StreamingResponse):
    """The stream of one listener; gives the listener back however the stream ends."""

    def __init__(
        self,
        hub: EventHub,
        listener: Listener,
        workspace_id: str,
        keepalive_seconds: float,
        still_valid: Callable[[], Awaitable[bool]] | None = None,
        check_seconds: float = 5.0,
    ) -> None:
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
        self.hub = hub
        self.listener = listener
        self.still_valid = still_valid
        self.check_seconds = check_seconds
        super().__init__(
            self._body(workspace_id, keepalive_seconds),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def _body(self, workspace_id: str, keepalive_seconds: float) -> AsyncIterator[str]:
        try:
            ready = json.dumps({"kind": "ready", "workspace_id": workspace_id})
            yield f"retry: 2000\nevent: ready\ndata: {ready}\n\n"
            loop = asyncio.get_running_loop()
            wait = keepalive_seconds
            if self.still_valid is not None:
                wait = min(wait, self.check_seconds)
            next_check = loop.time() + self.check_seconds
            idle = 0.0
            while True:
                data = await self.listener.next(wait)
                if data is not None:
                    idle = 0.0
                    yield format_event(data)
                else:
                    idle += wait
                    if idle >= keepalive_seconds:
                        idle = 0.0
                        yield ": keep-alive\n\n"
                if self.still_valid is not None and loop.time() >= next_check:
                    next_check = loop.time() + self.check_seconds
                    if not await self.still_valid():
                        yield 'event: end\ndata: {"kind": "end", "reason": "claim_ended"}\n\n'
                        return
        except EOFError:
            return  # ended by the hub: the client reconnects and catches up with ops_since
        finally:
            with anyio.CancelScope(shield=True):
                await self.hub.close(self.listener)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream until the body ends, the client goes, or the hub drops a slow client."""
        try:
            # A slow consumer's send may be stuck on a client that reads nothing: the hub
            # cancels the response, and the server closes the connection (uvicorn logs that
            # the response was not completed).
            with anyio.CancelScope() as cancel:
                self.listener.on_drop = cancel.cancel
                if self.listener.dropped.is_set():
                    cancel.cancel()
                await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.hub.close(self.listener)
