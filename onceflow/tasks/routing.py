"""Where a stage's wake-up goes: your ``task_routes`` first, else its worker class's queue.

A stage ``s`` is the Celery task ``onceflow.stage.s``; its wake-ups go to the queue of the
request's worker class, ``onceflow.wc.<class>`` — unless your app's ``task_routes`` (a
mapping, a glob or a router function, as Celery reads them) routes ``onceflow.stage.s``:
then Celery routes the message as you said, and onceflow names no queue. An explicit
``queue=`` at send time would override your route (Celery merges send-time options over
routes), so onceflow sends one only when no route of yours matches.

No task carries a ``queue`` attribute (Celery 5.7 deprecates it, and it too would beat
``task_routes``). docs/celery.md, "Task names and queues".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery

from onceflow.keys import queue_name

log = logging.getLogger("onceflow.routing")

#: Every stage is the Celery task ``onceflow.stage.<stage>``.
TASK_PREFIX = "onceflow.stage."
#: Route keys that decide where a message goes (a route with only, say, ``priority``
#: does not: the worker class's queue is still named).
_DESTINATION_KEYS = ("queue", "exchange", "routing_key")


def task_name(stage: str) -> str:
    """The Celery task of ``stage``: ``onceflow.stage.<stage>``."""
    return TASK_PREFIX + stage


def user_route(app: Celery, name: str, args: Sequence[Any] = ()) -> Any:
    """The route your app's ``task_routes`` gives task ``name`` if it names a destination
    (a queue, an exchange or a routing key); None when no route of yours does.

    A router function that raises is logged and treated as no route (the message still
    goes to the worker class's queue).
    """
    router = app.amqp.router
    if not router.routes:
        return None
    try:
        route = router.lookup_route(name, list(args), {}, {}, app.tasks.get(name))
    except Exception as exc:  # a user's router function: never lose the wake-up to it
        log.warning("task_routes raised for %s (%s); routing by worker class", name, exc)
        return None
    if isinstance(route, str) and route:
        return route
    if isinstance(route, dict) and any(route.get(k) for k in _DESTINATION_KEYS):
        return route
    return None


def send_options(app: Celery, stage: str, worker_class: str, args: Sequence[Any]) -> dict[str, Any]:
    """The routing options of a wake-up: ``{"queue": "onceflow.wc.<class>"}`` unless your
    ``task_routes`` routes ``onceflow.stage.<stage>`` (then ``{}``: Celery applies it)."""
    if user_route(app, task_name(stage), args) is not None:
        return {}
    return {"queue": queue_name(worker_class)}


def routed_queue(app: Celery, stage: str, worker_class: str) -> str | None:
    """The broker queue a wake-up of ``stage`` for ``worker_class`` lands in, as far as
    it can be told without a message (None: your route names an exchange, not a queue)."""
    route = user_route(app, task_name(stage))
    if route is None:
        return queue_name(worker_class)
    if isinstance(route, str):
        return route
    queue = route.get("queue")
    if isinstance(queue, str):
        return queue
    return getattr(queue, "name", None)  # a kombu Queue


__all__ = ["TASK_PREFIX", "routed_queue", "send_options", "task_name", "user_route"]
