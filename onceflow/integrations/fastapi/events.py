"""Server-sent events: a workspace's commit broadcasts, as a browser tab listens to them.

The stream subscribes to the workspace's Redis channel
(:func:`onceflow.keys.workspace_channel`) and forwards each message as an event
named by its ``kind`` (``commit`` for op-log commits), with the message's JSON
as ``data``. It opens with ``event: ready`` once the subscription is live, so a
client that waits for it cannot miss a commit made after; it sends a comment
(``: keep-alive``) when idle, and stops when the client goes away. A client
that reconnects catches up with ``GET …/ops?since=<clock>``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis
import redis.asyncio as aioredis
from starlette.responses import JSONResponse, Response, StreamingResponse

from onceflow.keys import workspace_channel

log = logging.getLogger("onceflow.api.events")

SUBSCRIBE_TIMEOUT = 5.0


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


async def event_stream(
    client: aioredis.Redis, workspace_id: str, keepalive_seconds: float
) -> Response:
    """Subscribe, wait until the subscription is live, then stream; 503 if Redis is down."""
    pubsub = client.pubsub()
    channel = workspace_channel(workspace_id)
    try:
        with anyio.fail_after(SUBSCRIBE_TIMEOUT):
            await pubsub.subscribe(channel)
            while True:  # the server's confirmation: PUBLISHes from now on reach us
                message = await pubsub.get_message(timeout=1.0)
                if message is not None and message.get("type") == "subscribe":
                    break
    except (redis.RedisError, OSError, TimeoutError) as exc:
        with anyio.CancelScope(shield=True):
            await _close(pubsub)
        log.warning("event stream for a workspace unavailable: %s", type(exc).__name__)
        return JSONResponse(
            {"detail": "the event stream is unavailable (Redis)", "code": "unavailable"},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    async def body() -> AsyncIterator[str]:
        try:
            ready = json.dumps({"kind": "ready", "workspace_id": workspace_id})
            yield f"retry: 2000\nevent: ready\ndata: {ready}\n\n"
            while True:
                message = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=keepalive_seconds
                )
                if message is None:
                    yield ": keep-alive\n\n"
                elif message.get("type") == "message":
                    yield format_event(message["data"])
        except (redis.RedisError, OSError) as exc:
            # The stream ends; the client reconnects and catches up with ops_since.
            log.warning("event stream ended: %s", type(exc).__name__)
        finally:
            with anyio.CancelScope(shield=True):  # also when the client disconnected
                await _close(pubsub)

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _close(pubsub: Any) -> None:
    try:
        await pubsub.unsubscribe()
        await pubsub.aclose()
    except (redis.RedisError, OSError):
        pass
