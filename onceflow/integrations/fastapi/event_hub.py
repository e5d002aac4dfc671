"""The event hub behind the API's server-sent events (:mod:`.events` has the whole story).

One :class:`EventHub` per event loop holds ONE Redis pub/sub connection, subscribed to the
channels of the workspaces that have listeners, and fans each message out to the streams'
own bounded queues (:class:`Listener`).

On a Redis Cluster (``redis_url`` is ``redis+cluster://…``) the hub holds one connection
per primary that carries a subscribed channel, with sharded pub/sub (``SSUBSCRIBE``) on
the channel's slot: a workspace's commits never cross the cluster bus, and a node that
is lost ends only its own channels' streams (their clients resync).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from onceflow.loops import drop_redis_sockets, shut_redis_connection
from onceflow.redis_clients import (
    PLAIN,
    REDIS_OR_OS_ERRORS,
    SHARDED,
    AsyncRedis,
    Kinds,
    async_client,
    is_cluster_url,
    node_client,
    shard_node,
)

log = logging.getLogger("onceflow.api.events")

SUBSCRIBE_TIMEOUT = 5.0
# After a failed connect, new streams get 503 at once for this long (no connect storm).
RECONNECT_BACKOFF = 1.0
CLIENT_NAME = "onceflow-events"
# Streams handed one message per pass of the event loop. Each stream's task writes to its
# socket in the pass after its delivery, so a message for thousands of streams held the
# loop for the whole fan-out (about half a second at 5,000 streams), and every request
# that arrived meanwhile waited behind it. Slices let the loop read and answer other
# requests between them; each stream still gets its channel's messages in order.
FAN_OUT_SLICE = 64


class HubUnavailable(Exception):
    """Redis did not answer (connect, subscribe or its confirmation): 503."""


class StreamLimit(Exception):
    """Too many open streams for this key (or this process): 429."""

    def __init__(self, detail: str, limit: int) -> None:
        super().__init__(detail)
        self.detail = detail
        self.limit = limit


_END = object()  # queued to a listener whose stream must end


@dataclass(eq=False)
class Listener:
    """One stream's membership of a channel: its bounded queue of messages."""

    channel: bytes
    key_id: str
    queue: asyncio.Queue[Any]
    state: _Channel | None = None
    released: bool = False
    ended: str | None = None  # why the hub ended the stream: "slow" or "redis"
    dropped: asyncio.Event = field(default_factory=asyncio.Event)  # set for a slow consumer
    on_drop: Callable[[], Any] | None = None  # the response's cancel, for a slow consumer
    #: Which messages this stream carries (None: all of its channel's): a claim's stream
    #: carries only its own request's news. A message it refuses is never queued.
    accept: Callable[[bytes], bool] | None = None

    def deliver(self, data: bytes) -> bool:
        """Queue ``data`` if the stream carries it; False when the queue is full (a slow
        consumer)."""
        if self.ended is not None:
            return True
        if self.accept is not None and not self.accept(data):
            return True
        try:
            self.queue.put_nowait(data)
        except asyncio.QueueFull:
            return False
        return True

    def end(self, reason: str) -> None:
        """End the stream: queued messages are dropped (the client resyncs), then the end mark."""
        if self.ended is not None:
            return
        self.ended = reason
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_END)
        if reason == "slow":
            self.dropped.set()
            if self.on_drop is not None:
                self.on_drop()

    async def next(self, timeout: float) -> bytes | None:
        """The next message; None after ``timeout`` idle seconds; raises EOFError at the end."""
        try:
            async with asyncio.timeout(timeout):
                item = await self.queue.get()
        except TimeoutError:
            return None
        if item is _END:
            raise EOFError
        data: bytes = item
        return data


@dataclass(eq=False)
class _Channel:
    confirmed: asyncio.Future[None]
    link: str  # the name of the link (node) it is subscribed on
    listeners: set[Listener] = field(default_factory=set)


@dataclass(eq=False)
class _Link:
    name: str  # "" for one server; a cluster node's "host:port"
    client: aioredis.Redis
    pubsub: PubSub
    kinds: Kinds
    reader: asyncio.Task[None] | None = None
    # Commands on this connection are sent one at a time (a slow node holds up only its own).
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EventHub:
    """One Redis pub/sub connection of an event loop, fanned out to per-stream queues.

    Commands (SUBSCRIBE, UNSUBSCRIBE, PING) are sent under one lock; one reader task
    reads the connection. Redis answers a connection's commands in order, so each
    ``subscribe`` confirmation is matched to the command that asked for it through a
    FIFO per channel: a stream is ``ready`` only once its own SUBSCRIBE is confirmed.
    On a Redis Cluster each primary that carries a channel has such a connection (a
    *link*, with ``SSUBSCRIBE``), its own reader and its own fate.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        max_streams: int = 1000,
        max_per_key: int = 100,
        queue_size: int = 100,
        ping_seconds: float = 15.0,
        subscribe_timeout: float = SUBSCRIBE_TIMEOUT,
    ) -> None:
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
        self.redis_url = redis_url
        self.max_streams = max_streams
        self.max_per_key = max_per_key
        self.queue_size = queue_size
        self.ping_seconds = ping_seconds
        self.subscribe_timeout = subscribe_timeout
        self._links: dict[str, _Link] = {}
        self._topology: AsyncRedis | None = None  # a cluster's: which node has which slot
        self._channels: dict[bytes, _Channel] = {}
        self._expected: dict[bytes, deque[asyncio.Future[None] | None]] = {}
        self._per_key: dict[str, int] = {}
        self._open = 0
        self._connect_lock = asyncio.Lock()
        self._down_until: dict[str, float] = {}
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()

    # -------------------------------------------------------------- public

    @property
    def open_streams(self) -> int:
        """Streams open now (all keys)."""
        return self._open

    def streams_of(self, key_id: str) -> int:
        """Streams open now for ``key_id``."""
        return self._per_key.get(key_id, 0)

    async def open(
        self, channel: str, key_id: str, accept: Callable[[bytes], bool] | None = None
    ) -> Listener:
        """A listener on ``channel`` whose subscription is confirmed live; with ``accept``,
        it is given only the messages ``accept`` says yes to.

        Raises :class:`StreamLimit` past a bound, :class:`HubUnavailable` when Redis
        does not answer. Give the listener back with :meth:`close`.
        """
        if self._open >= self.max_streams:
            raise StreamLimit("too many event streams on this server", self.max_streams)
        if self._per_key.get(key_id, 0) >= self.max_per_key:
            raise StreamLimit("too many event streams for this key", self.max_per_key)
        self._open += 1
        self._per_key[key_id] = self._per_key.get(key_id, 0) + 1
        listener = Listener(
            channel.encode(), key_id, asyncio.Queue(maxsize=self.queue_size), accept=accept
        )
        try:
            await self._join(listener)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close(listener)
            raise
        return listener

    async def close(self, listener: Listener) -> None:
        """Give back a listener (idempotent): the last one of a channel unsubscribes."""
        link = self._release(listener)
        if link is not None:
            with contextlib.suppress(HubUnavailable):
                await self._send(link, "unsubscribe", listener.channel, None)

    def drop_sockets(self) -> None:
        """Shut the Redis sockets of a hub whose event loop has closed (no loop needed)."""
        for link in list(self._links.values()):
            drop_redis_sockets(link.client)
            shut_redis_connection(getattr(link.pubsub, "connection", None))
        if self._topology is not None:
            drop_redis_sockets(self._topology)

    async def aclose(self) -> None:
        """End every stream and close the connections (the app's shutdown)."""
        self._closed = True
        for link in list(self._links.values()):
            self._reset(link, "shutdown")
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        topology, self._topology = self._topology, None
        if topology is not None:
            with contextlib.suppress(*REDIS_OR_OS_ERRORS, RuntimeError):
                await topology.aclose()

    # ------------------------------------------------------------ internals

    def _release(self, listener: Listener) -> _Link | None:
        """Free the listener's slots; the link to unsubscribe on if its channel emptied."""
        if listener.released:
            return None
        listener.released = True
        self._open -= 1
        left = self._per_key.get(listener.key_id, 1) - 1
        if left > 0:
            self._per_key[listener.key_id] = left
        else:
            self._per_key.pop(listener.key_id, None)
        state = listener.state
        if state is None:
            return None
        state.listeners.discard(listener)
        link = self._links.get(state.link)
        if state.listeners or self._channels.get(listener.channel) is not state or link is None:
            return None
        del self._channels[listener.channel]
        return link

    def _client(self) -> AsyncRedis:
        # One server: the link's own client. A cluster: the topology client, whose nodes'
        # connection options the links copy. No retry: a lost connection ends the streams
        # (no silent gap).
        return async_client(
            self.redis_url,
            timeout=self.subscribe_timeout,
            connect_timeout=2,
            retries=0,
            client_name=CLIENT_NAME,
        )

    async def _where(self, channel: bytes) -> tuple[str, Any]:
        """The link name and cluster node of ``channel``: ``("", None)`` on one server."""
        if not is_cluster_url(self.redis_url):
            return "", None
        if self._topology is None:
            self._topology = self._client()
        try:
            async with asyncio.timeout(self.subscribe_timeout):
                node = await shard_node(self._topology, channel.decode())
        except REDIS_OR_OS_ERRORS as exc:
            raise HubUnavailable(f"Redis: {type(exc).__name__}") from exc
        if node is None:  # not a cluster client after all (cannot happen for a cluster URL)
            raise HubUnavailable("Redis: no node for the channel")
        return str(node.name), node

    async def _link(self, channel: bytes) -> _Link:
        if self._closed:
            raise HubUnavailable("the event hub is closed")
        name, node = await self._where(channel)
        link = self._links.get(name)
        if link is not None:
            return link
        async with self._connect_lock:
            link = self._links.get(name)
            if link is not None:
                return link
            loop = asyncio.get_running_loop()
            if loop.time() < self._down_until.get(name, 0.0):
                raise HubUnavailable("Redis did not answer a moment ago")
            if node is not None:
                client = node_client(node, client_name=CLIENT_NAME)
            else:  # one server (a cluster URL always has a node here)
                client = cast(aioredis.Redis, self._client())
            pubsub = client.pubsub()
            try:
                async with asyncio.timeout(self.subscribe_timeout):
                    await cast(Any, pubsub).connect()  # untyped in redis-py
            except REDIS_OR_OS_ERRORS as exc:
                self._down_until[name] = loop.time() + RECONNECT_BACKOFF
                await _quietly_close(pubsub, client)
                raise HubUnavailable(f"Redis: {type(exc).__name__}") from exc
            link = _Link(name, client, pubsub, PLAIN if node is None else SHARDED)
            link.reader = loop.create_task(self._read(link))
            self._links[name] = link
            return link

    async def _join(self, listener: Listener) -> None:
        link = await self._link(listener.channel)
        state = self._channels.get(listener.channel)
        if state is None:
            state = _Channel(asyncio.get_running_loop().create_future(), link.name)
            state.confirmed.add_done_callback(_retrieve)
            self._channels[listener.channel] = state
            listener.state = state
            state.listeners.add(listener)
            await self._send(link, "subscribe", listener.channel, state.confirmed)
        else:
            listener.state = state
            state.listeners.add(listener)
        try:
            async with asyncio.timeout(self.subscribe_timeout):
                await asyncio.shield(state.confirmed)
        except TimeoutError:
            self._reset(link, "no subscribe confirmation")
            raise HubUnavailable("Redis did not confirm the subscription") from None

    async def _send(
        self, link: _Link, verb: str, channel: bytes, confirmed: asyncio.Future[None] | None
    ) -> None:
        # Shielded: a command cut in half by a cancelled request would break the connection
        # for every stream (a send is bounded by the client's socket timeout).
        with anyio.CancelScope(shield=True):
            await self._send_shielded(link, verb, channel, confirmed)

    async def _send_shielded(
        self, link: _Link, verb: str, channel: bytes, confirmed: asyncio.Future[None] | None
    ) -> None:
        async with link.send_lock:
            if link is not self._links.get(link.name):
                raise HubUnavailable("the connection to Redis was lost")
            if verb == "unsubscribe" and channel in self._channels:
                # A stream joined the channel again after the last one left (its SUBSCRIBE
                # went out first): unsubscribing now would silence it after its `ready`.
                return
            # Redis answers in order: this command's confirmation is the next one queued.
            self._expected.setdefault(channel, deque()).append(confirmed)
            try:
                sharded = link.kinds is SHARDED
                if verb == "subscribe":
                    await (link.pubsub.ssubscribe if sharded else link.pubsub.subscribe)(channel)
                else:
                    await (link.pubsub.sunsubscribe if sharded else link.pubsub.unsubscribe)(
                        channel
                    )
            except REDIS_OR_OS_ERRORS as exc:
                self._reset(link, type(exc).__name__)
                raise HubUnavailable(f"Redis: {type(exc).__name__}") from exc

    async def _read(self, link: _Link) -> None:
        pubsub = link.pubsub
        awaiting_pong = False
        try:
            while link is self._links.get(link.name):
                message = await pubsub.get_message(timeout=self.ping_seconds)
                if link is not self._links.get(link.name):
                    return
                if message is None:  # idle: is the connection still alive?
                    if awaiting_pong:
                        raise HubUnavailable("Redis did not answer a PING")
                    async with link.send_lock:
                        await pubsub.ping()
                    awaiting_pong = True
                    continue
                awaiting_pong = False
                await self._dispatch(link, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis gone, or anything unexpected: every stream ends
            self._reset(link, type(exc).__name__)

    async def _dispatch(self, link: _Link, message: dict[str, Any]) -> None:
        kind = message.get("type")
        channel = message.get("channel")
        if not isinstance(channel, bytes):
            return
        if kind == link.kinds.message:
            state = self._channels.get(channel)
            if state is None:
                return
            listeners = list(state.listeners)
            for start in range(0, len(listeners), FAN_OUT_SLICE):
                if start:
                    await asyncio.sleep(0)  # one slice per pass of the loop
                for listener in listeners[start : start + FAN_OUT_SLICE]:
                    self._deliver(listener, channel, message["data"])
        elif kind in (link.kinds.subscribe, link.kinds.unsubscribe):
            expected = self._expected.get(channel)
            if not expected:
                if kind == link.kinds.unsubscribe:
                    self._lost(channel)  # the server ended it: a cluster slot moved
                return
            confirmed = expected.popleft()
            if not expected:
                del self._expected[channel]
            if kind == link.kinds.subscribe and confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

    def _deliver(self, listener: Listener, channel: bytes, data: bytes) -> None:
        if listener.deliver(data):
            return
        log.warning(
            "event stream dropped: its client reads too slowly (%d queued)", self.queue_size
        )
        listener.end("slow")
        owner = self._release(listener)
        if owner is not None:
            self._spawn(self._send_quietly(owner, channel))

    def _lost(self, channel: bytes) -> None:
        """End the streams of a channel the server unsubscribed (they reconnect and resync)."""
        state = self._channels.pop(channel, None)
        if state is None:
            return
        for listener in state.listeners:
            listener.end("redis")
        ended = len(state.listeners)
        log.warning("event hub: Redis ended a subscription; %d streams resync", ended)
        self._forget_topology()  # its slot moved: read the cluster's slots again

    def _forget_topology(self) -> None:
        """A cluster's slot map may be stale (a node lost, a slot moved): the next stream
        reads it again from the cluster."""
        topology, self._topology = self._topology, None
        if topology is not None:
            self._spawn(_quietly_close(None, topology))

    async def _send_quietly(self, link: _Link, channel: bytes) -> None:
        with contextlib.suppress(HubUnavailable):
            await self._send(link, "unsubscribe", channel, None)

    def _reset(self, link: _Link, reason: str) -> None:
        """The connection is lost: end its streams, close it; the next stream reconnects.

        On a cluster only the streams of that node's channels end.
        """
        if self._links.get(link.name) is not link:
            return
        del self._links[link.name]
        ended = 0
        for channel, state in list(self._channels.items()):
            if state.link != link.name:
                continue
            if not state.confirmed.done():
                state.confirmed.set_exception(HubUnavailable(f"Redis: {reason}"))
            for listener in state.listeners:
                listener.end("redis")
                ended += 1
            del self._channels[channel]
            self._expected.pop(channel, None)
        if reason != "shutdown":
            log.warning("event hub lost Redis (%s): %d streams end and resync", reason, ended)
            self._forget_topology()
        self._spawn(self._dispose(link))

    async def _dispose(self, link: _Link) -> None:
        reader = link.reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        await _quietly_close(link.pubsub, link.client)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed subscription is reported to its waiters


async def _quietly_close(pubsub: PubSub | None, client: AsyncRedis) -> None:
    if pubsub is not None:
        with contextlib.suppress(*REDIS_OR_OS_ERRORS, RuntimeError):
            await cast(Any, pubsub).aclose()
    with contextlib.suppress(*REDIS_OR_OS_ERRORS, RuntimeError):
        await client.aclose()
