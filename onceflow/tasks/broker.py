"""A Redis broker transport that a hostile or malformed message cannot stop.

kombu's Redis transport lets a worker die ("Unrecoverable error") on things any
client of the broker's Redis can put there: an item of a queue that is not JSON
or not a kombu envelope, an envelope Celery cannot read (``timelimit: "x"``, a
body that is not ``[args, kwargs, embed]``), a key of the worker's with the wrong
type (a queue that is a string, ``unacked`` that is a list: ``WRONGTYPE``). For
onceflow a broker message is only a wake-up — the Postgres row is the truth and
the sweeper re-sends what is missing — so such a message is safe to drop:

* a queue item that is not a JSON kombu envelope is logged and dropped;
* a message whose delivery raises (Celery could not take it) is logged and
  rejected without requeue, so it is not redelivered forever — also when it
  raises on its way to the pool (``timelimit: "x"``), where Celery would keep
  the pool slot it took for it and the worker would never run another task;
* a key of the worker's with the wrong type is renamed aside
  (``<key>.wrongtype.<unix ms>``, kept for inspection, never deleted) and
  logged; the worker goes on serving, and the sweeper re-sends lost wake-ups.

Installed per Celery app by :func:`harden` (a :class:`~onceflow.tasks.Flow` does
it for its app): only the app's connections to a ``redis://``/``rediss://``
broker use it. On other transports (RabbitMQ) kombu delivers the message itself, and
the same holds one step later (:class:`TaskMessageGuard`): a task message Celery's
consumer raises on (a body that is not ``[args, kwargs, embed]``: ``ValueError``, which
Celery lets stop the worker — and, requeued, every next worker it reaches) is logged and
rejected without requeue. A Flow given your own app (``Flow(app=…)``) hardens all of
it: a malformed message of one of *your* tasks is dropped or rejected too — where
kombu would have stopped the worker — but no sweeper re-sends it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from queue import Empty  # what kombu's channels raise when nothing was read
from typing import Any

import redis
from celery import Celery, bootsteps
from celery.signals import worker_init

# Typed as Any: kombu's transports are untyped, and these classes extend them.
kombu_redis: Any = importlib.import_module("kombu.transport.redis")
KombuConnection: Any = importlib.import_module("kombu.connection").Connection

log = logging.getLogger("onceflow.broker")

#: The apps :func:`harden` was applied to (their workers guard ``_process_task``).
_hardened: weakref.WeakSet[Celery] = weakref.WeakSet()

#: The keys an envelope must have for kombu to make a message of it.
_ENVELOPE_PROPERTIES = ("delivery_tag", "delivery_info")


def envelope_problem(raw: object) -> str | None:
    """Why ``raw`` (a decoded queue item) is not a message kombu can deliver; None if it is."""
    if not isinstance(raw, dict):
        return f"not a JSON object ({type(raw).__name__})"
    props = raw.get("properties")
    if not isinstance(props, dict):
        return "no properties object"
    if not isinstance(props.get("delivery_tag"), str) or not props["delivery_tag"]:
        return "no delivery tag"
    if not isinstance(props.get("delivery_info"), dict):
        return "no delivery_info object"
    if not isinstance(raw.get("headers", {}), dict | None):
        return "headers is not an object"
    for name in ("body", "content-type", "content-encoding"):
        if not isinstance(raw.get(name, ""), str | None):
            return f"{name} is not a string"
    return None


def _is_wrongtype(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and "WRONGTYPE" in str(exc)


class QoS(kombu_redis.QoS):
    """Ack emulation that heals a wrong-typed ``unacked`` / ``unacked_index`` and retries once."""

    def append(self, message: Any, delivery_tag: str) -> None:
        self._healing(lambda: super(QoS, self).append(message, delivery_tag))

    def ack(self, delivery_tag: str) -> None:
        self._healing(lambda: super(QoS, self).ack(delivery_tag))

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self._healing(lambda: super(QoS, self).reject(delivery_tag, requeue=requeue))

    def restore_visible(self, *args: Any, **kwargs: Any) -> None:
        self._healing(lambda: super(QoS, self).restore_visible(*args, **kwargs))

    def _healing(self, call: Callable[[], None]) -> None:
        try:
            call()
        except redis.ResponseError as exc:
            if not _is_wrongtype(exc) or not self.channel.set_aside_wrong_types():
                raise
            call()


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, hardened: see the module docstring."""

    QoS = QoS

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        """Register the consumer, then guard the delivery of each of its messages."""
        ret = super().basic_consume(queue, *args, **kwargs)
        # kombu's virtual transport keeps each queue's delivery callback in the connection's
        # private map and offers no hook around a delivery: the guard wraps the entry.
        callbacks = self.connection._callbacks  # noqa: SLF001
        inner = callbacks.get(queue)
        if inner is not None and not isinstance(inner, functools.partial):
            callbacks[queue] = functools.partial(self._deliver_guarded, queue, inner)
        return ret

    def _deliver_guarded(self, queue: str, inner: Callable[[Any], Any], raw: Any) -> Any:
        problem = envelope_problem(raw)
        if problem is not None:
            log.error(
                "queue %s: dropped a broker message that is not a kombu message: %s", queue, problem
            )
            return None
        try:
            return inner(raw)
        except Exception as exc:
            if _is_wrongtype(exc) and self.set_aside_wrong_types():
                return None  # the message is lost with the healed key: the sweeper re-sends
            if isinstance(exc, self.connection_errors):
                raise
            headers = raw.get("headers") or {}
            task = headers.get("task") if isinstance(headers, dict) else None
            log.error(
                "queue %s: rejected a message Celery could not take (task %r): %s: %s",
                queue,
                task if isinstance(task, str) else None,
                type(exc).__name__,
                exc,
            )
            self._reject_quietly(raw["properties"]["delivery_tag"])
            return None

    def _reject_quietly(self, delivery_tag: str) -> None:
        try:
            # kombu's QoS has no public "is this tag still unacknowledged"; reject() of a tag
            # already gone raises, so its private map of delivered tags is asked first.
            if delivery_tag in self.qos._delivered:  # noqa: SLF001
                self.qos.reject(delivery_tag, requeue=False)
        except Exception as exc:  # the message may be gone already: nothing more to do
            log.warning("could not reject a malformed message: %s", type(exc).__name__)

    def _brpop_read(self, **options: Any) -> Any:
        return self._reading(lambda: super(Channel, self)._brpop_read(**options), "queue")

    def _get(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        return self._reading(lambda: super(Channel, self)._get(queue, *args, **kwargs), queue)

    def _receive(self) -> bool:
        # kombu's, except that a dropped broadcast in the middle of a batch does not leave
        # the rest unread in the client's buffer (the socket would not wake the poller).
        c = self.subclient
        delivered = []
        while True:
            with contextlib.suppress(Empty):
                delivered.append(self._receive_one(c))
            if c.connection is None or not c.connection.can_read(timeout=0):
                return any(delivered)

    def _receive_one(self, c: Any) -> Any:
        # A broadcast (pidbox, events): kombu catches only TypeError/ValueError from its
        # decoder, which also raises AttributeError and RecursionError.
        return self._reading(lambda: super(Channel, self)._receive_one(c), "broadcast")

    def _reading(self, read: Callable[[], Any], where: str) -> Any:
        """``read()``, with what a hostile item can make it raise turned into "nothing read".

        The item was taken from Redis already (BRPOP, RPOP, a pub/sub message): it is
        logged as dropped. Connection errors propagate (kombu reconnects); a ``WRONGTYPE``
        renames the wrong-typed key aside; any other Redis error propagates.
        """
        try:
            return read()
        except Empty:
            raise
        except redis.ResponseError as exc:
            if not _is_wrongtype(exc) or not self.set_aside_wrong_types():
                raise
            raise Empty() from None
        except Exception as exc:
            if isinstance(exc, self.connection_errors):
                raise
            # kombu's decoder failed on the item (not JSON, nested too deep, a
            # {"__type__": …} object it cannot build).
            log.error(
                "%s: dropped a broker message that is not a kombu message: %s",
                where,
                type(exc).__name__,
            )
            raise Empty() from None

    def _own_keys(self) -> Iterable[tuple[str, set[str]]]:
        """The keys this channel reads and writes, with the types they may have."""
        for queue in list(self.active_queues):
            for pri in self.priority_steps:
                yield self._q_for_pri(queue, pri), {"list", "none"}
        yield self.unacked_key, {"hash", "none"}
        yield self.unacked_index_key, {"zset", "none"}
        yield self.unacked_mutex_key, {"string", "none"}

    def set_aside_wrong_types(self) -> bool:
        """Rename each of this channel's keys that has the wrong type; True if one was."""
        prefix = self.global_keyprefix or ""
        moved = False
        stamp = str(int(time.time() * 1000))
        with self.conn_or_acquire() as client:
            for key, allowed in self._own_keys():
                full = prefix + key
                # One script: check the type and rename (to a name not taken) atomically, so
                # a good key another worker made meanwhile is never moved, nor one overwritten.
                found = client.eval(_SET_ASIDE_LUA, 1, full, stamp, *sorted(allowed))
                if not found:
                    continue
                kind, aside = (v.decode() if isinstance(v, bytes) else str(v) for v in found)
                moved = True
                log.error(
                    "broker key %r had type %s, not %s: renamed to %r and serving on "
                    "(lost wake-ups are re-sent by the sweeper)",
                    full,
                    kind,
                    "/".join(sorted(allowed - {"none"})),
                    aside,
                )
        return moved


#: KEYS[1]: a key; ARGV[1]: a stamp; ARGV[2..]: the types it may have. Renames it to
#: ``<key>.wrongtype.<stamp>[.<n>]`` (a name not taken) if its type is another; returns
#: {type, new name}, or nil.
_SET_ASIDE_LUA = """
local kind = redis.call('TYPE', KEYS[1])['ok']
for i = 2, #ARGV do
    if kind == ARGV[i] then return nil end
end
local aside = KEYS[1] .. '.wrongtype.' .. ARGV[1]
local n = 0
while redis.call('EXISTS', aside) == 1 do
    n = n + 1
    aside = KEYS[1] .. '.wrongtype.' .. ARGV[1] .. '.' .. n
end
redis.call('RENAME', KEYS[1], aside)
return {kind, aside}
"""


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the hardened :class:`Channel`."""

    Channel = Channel


class Connection(KombuConnection):
    """A kombu connection that uses the hardened transport where kombu would use Redis's."""

    def get_transport_cls(self) -> Any:
        """kombu's choice, with its Redis transport replaced by ours."""
        cls = super().get_transport_cls()
        return Transport if cls is kombu_redis.Transport else cls


class TaskMessageGuard(bootsteps.Step):
    """A worker consumer's bootstep: a task message Celery raises on is rejected, not fatal.

    Celery's consumer turns an undecodable body, an unknown task or a bad ``eta`` into a
    logged ack or reject, but lets anything else its strategy raises stop the worker
    ("Unrecoverable error"): a body that is JSON but not ``[args, kwargs, embed]``
    (``[]``, ``{"a": 1}``) is one. On RabbitMQ the unacknowledged message is then requeued
    and stops the next worker too. Wraps the handler the consumer makes for its task
    messages (``create_task_handler``, called on every (re)connection): such a message is
    logged and rejected without requeue (a wake-up lost so is re-sent by the sweeper).
    Connection and channel errors still propagate (Celery reconnects). Redis connections
    of the hardened :class:`Transport` are left to its :class:`Channel`, which does the
    same one step earlier.
    """

    label = "onceflow task-message guard"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        make_handler = parent.create_task_handler

        def create_task_handler(*args: Any, **kw: Any) -> Any:
            handler = make_handler(*args, **kw)
            transport = getattr(getattr(parent, "connection", None), "transport", None)
            if isinstance(transport, Transport):
                return handler
            return functools.partial(_take_task_message, parent, handler)

        parent.create_task_handler = create_task_handler


def _take_task_message(consumer: Any, handler: Callable[[Any], Any], message: Any) -> Any:
    """``handler(message)``; a message it raises on (not a broker error) is rejected."""
    try:
        return handler(message)
    except Exception as exc:
        if isinstance(exc, tuple(consumer.connection_errors) + tuple(consumer.channel_errors)):
            raise
        headers = getattr(message, "headers", None)
        task = headers.get("task") if isinstance(headers, dict) else None
        log.error(
            "queue %s: rejected a message Celery could not take (task %r): %s: %s",
            (getattr(message, "delivery_info", None) or {}).get("routing_key", "?"),
            task if isinstance(task, str) else None,
            type(exc).__name__,
            exc,
        )
        if not message.acknowledged:
            message.reject_log_error(log, consumer.connection_errors, requeue=False)
        return None


def harden(app: Celery) -> None:
    """Make ``app``'s broker connections use the hardened Redis transport, its workers'
    consumers reject a task message they cannot take (:class:`TaskMessageGuard`, every
    transport), and its workers reject a task they cannot start instead of losing a pool
    slot to it.

    Leaves the app's connections alone if its ``amqp`` has its own connection class.
    """
    amqp = app.amqp
    if amqp.Connection is KombuConnection:
        amqp.Connection = Connection
    if app not in _hardened:
        app.steps["consumer"].add(TaskMessageGuard)
    _hardened.add(app)


def hardened(app: object) -> bool:
    """Whether :func:`harden` was applied to ``app`` (a Flow's app; None: no)."""
    return app in _hardened  # (a WeakSet answers False for what it cannot hold)


@worker_init.connect
def _guard_process_task(sender: Any = None, **_: Any) -> None:
    """Wrap the worker's ``_process_task`` (the step that hands a request to the pool).

    Celery takes a pool slot (its semaphore) before it and gives it back only when the
    pool reports; a request that raises on its way there (a hostile header) kept the
    slot forever — with one slot, the worker never ran another task. Runs in
    ``worker_init``, before the worker's Pool step binds ``process_task``.
    """
    if sender is None or not hardened(getattr(sender, "app", None)):
        return
    # Celery's WorkController binds its pool's entry point as the private _process_task and
    # offers no hook around it (task_prerun runs in the pool, after the slot is taken).
    original = sender._process_task  # noqa: SLF001

    def process_task(req: Any) -> None:
        try:
            original(req)
        except Exception as exc:
            log.error(
                "rejected task %s (%s): it could not be handed to the pool: %s: %s",
                getattr(req, "id", "?"),
                getattr(req, "name", "?"),
                type(exc).__name__,
                exc,
            )
            try:
                req.reject(requeue=False)
            except Exception as reject_exc:  # the message may be gone: nothing to do
                log.warning("could not reject it: %s", type(reject_exc).__name__)
            # Celery's semaphore variant (_process_task_sem) took a pool slot; only its
            # private _quick_release gives that slot back outside the pool's callbacks.
            if sender.process_task == sender._process_task_sem:  # noqa: SLF001
                sender._quick_release()  # noqa: SLF001

    sender._process_task = process_task  # noqa: SLF001 (the wrapped entry point, as above)


__all__ = [
    "Channel",
    "Connection",
    "QoS",
    "TaskMessageGuard",
    "Transport",
    "envelope_problem",
    "harden",
    "hardened",
]
