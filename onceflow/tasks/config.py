"""The Celery configuration onceflow ships, and what it asks of an app it is a guest in.

The Postgres table is the source of truth; a Celery message is only a wake-up
naming a request id. So: JSON only (pickle refused), late acks and requeue on
worker loss (a redelivered wake-up is harmless: the claim decides), one message
prefetched at a time, task events on for Flower, and no result backend.

The broker is Redis or RabbitMQ (:func:`is_amqp`). What hands a wake-up whose run is
still going to another worker differs (:func:`redelivery_bound`): Redis's visibility
timeout, RabbitMQ's ``consumer_timeout``; every stage's hard time limit stays below it.

Two cases (docs/celery.md, "Your own Celery app"):

* a Flow that builds its own app gets all of :func:`celery_config` as the app's
  defaults (any key can still be overridden);
* a Flow given *your* app (``Flow(app=…)``) leaves your settings alone: its tasks
  carry their own options (:data:`TASK_OPTIONS`; their queue is chosen when a
  wake-up is sent), and :func:`guest_config` sets only what has no per-task
  knob, only where your app leaves it unset, logging each key once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from onceflow.errors import InvalidRequest
from onceflow.redis_clients import require_one_server
from onceflow.settings import Settings

SWEEP_TASK = "onceflow.sweep"
#: The maintenance queue (beat's sweeps) of a Flow with the default name; every onceflow
#: worker also consumes its Flow's: see :func:`maintenance_queue_for`.
MAINTENANCE_QUEUE = "onceflow"
DEFAULT_FLOW_NAME = "onceflow"
#: The key of the sweeper's entry in ``beat_schedule``.
SWEEP_SCHEDULE_KEY = "onceflow-sweep"

#: Options each of onceflow's tasks carries itself (Celery task options), so they hold on
#: any app — including yours, whose own tasks keep your settings. The wake-up is only a
#: pointer to a Postgres row: a late ack with requeue on worker loss lets a redelivery
#: reach a worker (the claim decides whether anything runs), no result is stored (the
#: row holds it), and the message is JSON whatever your ``task_serializer`` says.
TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "ignore_result": True,
    "serializer": "json",
}

log = logging.getLogger("onceflow.celery")

#: URL schemes of kombu's AMQP transports: a broker of one of them is RabbitMQ.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp", "pyamqps", "librabbitmq"})


def is_amqp(broker_url: str | None) -> bool:
    """Whether ``broker_url`` names an AMQP broker (RabbitMQ); of failover URLs
    (``a;b``), the first decides."""
    first = (broker_url or "").split(";", 1)[0].strip()
    scheme, sep, _ = first.partition("://")
    return bool(sep) and scheme.lower() in AMQP_SCHEMES


def effective_broker_url(settings: Settings) -> str:
    """The broker an app of onceflow's connects to: ``CELERY_BROKER_URL`` (Celery reads it
    before any configuration), else ``ONCEFLOW_BROKER_URL``, else ``ONCEFLOW_REDIS_URL``."""
    return os.environ.get("CELERY_BROKER_URL") or settings.celery_broker_url


def redelivery_bound(settings: Settings, broker_url: str | None) -> tuple[str, float]:
    """What hands a wake-up whose run is still going to another worker, and after how many
    seconds: ``(what, seconds)``. Every stage's hard time limit must stay below it.

    Redis (and SQS): the visibility timeout — kombu restores an unacknowledged message
    after it. RabbitMQ: its ``consumer_timeout`` (a server setting, 30 min by default) —
    a delivery unacknowledged that long makes RabbitMQ close the worker's channel
    (``PRECONDITION_FAILED``), requeueing every delivery of it, and Celery stops the worker
    unless ``broker_channel_error_retry`` is on. The redelivered wake-ups are harmless (the
    claim decides); the stopped worker and the interrupted deliveries are not.
    """
    if is_amqp(broker_url):
        return (
            "RabbitMQ's consumer_timeout (ONCEFLOW_BROKER_CONSUMER_TIMEOUT_SECONDS)",
            settings.broker_consumer_timeout_seconds,
        )
    return (
        "the broker's visibility timeout (ONCEFLOW_BROKER_VISIBILITY_TIMEOUT_SECONDS)",
        settings.broker_visibility_timeout_seconds,
    )


def maintenance_queue_for(flow_name: str) -> str:
    """The queue beat sends a Flow's sweeps to, and that Flow's workers consume.

    ``onceflow`` for the default name, else ``onceflow.<name>``: two Flows on one broker
    (with different names, as their worker classes differ) never take each other's sweeps.
    """
    if flow_name == DEFAULT_FLOW_NAME:
        return MAINTENANCE_QUEUE
    if flow_name.startswith("wc."):
        # onceflow.wc.<class> are the worker classes' queues (onceflow.keys.queue_name).
        raise InvalidRequest(f"a Flow's name must not start with 'wc.': {flow_name[:60]!r}")
    return f"{MAINTENANCE_QUEUE}.{flow_name[:200]}"


def time_limits(max_runtime: float) -> tuple[float, float]:
    """Celery's (soft, hard) time limits for a stage bounded by ``max_runtime`` seconds.

    The soft limit raises inside the body at ``max_runtime`` (the lease ends then too);
    the hard limit kills a body that ignores it, a little later.
    """
    return max_runtime, max_runtime + max(5.0, 0.1 * max_runtime)


def sweep_schedule_entry(settings: Settings, maintenance_queue: str) -> dict[str, Any]:
    """The sweeper's ``beat_schedule`` entry: every sweep interval, to ``maintenance_queue``."""
    return {
        "task": SWEEP_TASK,
        "schedule": settings.sweep_interval_seconds,
        # No `expires` (nor eta/countdown): Celery checks those against the wall
        # clock of the worker that receives the message, and a worker whose clock
        # runs ahead would discard every sweep. Late sweeps do not pile up because
        # each begins with a compare-and-set on the database clock: one that
        # arrives within half an interval of the last sweep does nothing.
        "options": {"queue": maintenance_queue, "serializer": "json"},
    }


def broker_url(settings: Settings) -> str:
    """A Flow's Celery broker: ``ONCEFLOW_BROKER_URL``, else ``ONCEFLOW_REDIS_URL``.

    Kombu has no Redis Cluster transport: a cluster URL here is
    :class:`~onceflow.errors.InvalidRedisUrl`, raised when Celery first reads its
    configuration (a worker's or beat's start; :func:`check_broker`).
    """
    if settings.broker_url:
        return require_one_server(settings.broker_url, "ONCEFLOW_BROKER_URL (Celery's broker)")
    return require_one_server(
        settings.redis_url,
        "Celery's broker (ONCEFLOW_BROKER_URL is unset, so it would be ONCEFLOW_REDIS_URL)",
    )


def check_broker(app: Any) -> None:
    """Refuse, at start-up, a Celery app whose broker is a Redis Cluster (:class:`InvalidRedisUrl`).

    Reads the app's ``broker_url`` (onceflow's default, :func:`broker_url`, or yours).
    """
    url = app.conf.broker_url
    if isinstance(url, str):
        require_one_server(url, "the Celery app's broker_url")


def celery_config(
    settings: Settings, *, maintenance_queue: str = MAINTENANCE_QUEUE
) -> dict[str, Any]:
    """Celery settings for ``settings`` (lower-case Celery 4+ names); beat sends the
    sweeps to ``maintenance_queue`` (the Flow's: :func:`maintenance_queue_for`).

    The defaults of an app a Flow builds itself; never applied to an app you pass in
    (see :func:`guest_config`).

    On RabbitMQ (:func:`is_amqp`) there is no visibility timeout: a wake-up unacknowledged
    when its worker's connection drops is requeued at once. ``broker_channel_error_retry``
    is on there: a channel error (``consumer_timeout`` exceeded: ``PRECONDITION_FAILED``)
    restarts the worker's consumer, where Celery would stop the worker
    ("Unrecoverable error"); the channel's deliveries are requeued and the claim decides.
    """
    if is_amqp(effective_broker_url(settings)):
        broker: dict[str, Any] = {"broker_channel_error_retry": True}
    else:
        # Explicit, so stage time limits can be checked against it (see Flow.stage).
        visibility = settings.broker_visibility_timeout_seconds
        broker = {"broker_transport_options": {"visibility_timeout": visibility}}
    return {
        "broker_url": broker_url(settings),
        "broker_connection_retry_on_startup": True,
        **broker,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_ignore_result": True,
        "result_backend": None,
        "task_default_queue": "default",
        "task_routes": {SWEEP_TASK: {"queue": maintenance_queue}},
        "worker_hijack_root_logger": False,
        "beat_schedule": {SWEEP_SCHEDULE_KEY: sweep_schedule_entry(settings, maintenance_queue)},
    }


def user_sets(conf: Any, key: str) -> bool:
    """Whether ``key`` is set on ``conf`` (a Celery app's configuration) by anyone but
    Celery's own defaults: ``conf.update``, ``config_from_object``, ``Celery(broker=…)``."""
    # Celery's own check: every layer but its defaults, under the new and old spellings
    # of the key (task_serializer, CELERY_TASK_SERIALIZER) and the app's namespace.
    return bool(conf.value_set_for(key))


def guest_config(
    conf: Any, settings: Settings, maintenance_queue: str, *, app_name: str = "?"
) -> dict[str, Any]:
    """What a Flow sets on an app you pass in (``conf``, being configured): only the keys
    Celery offers no per-task knob for, only where your app leaves them unset.

    * ``broker_url`` — the wake-ups must go somewhere: onceflow's broker
      (``ONCEFLOW_BROKER_URL``, else ``ONCEFLOW_REDIS_URL``) if your app names none;
    * ``broker_transport_options["visibility_timeout"]`` — every stage's hard time
      limit is checked against ``ONCEFLOW_BROKER_VISIBILITY_TIMEOUT_SECONDS``: set to it
      if your app leaves it unset (kombu's default, 3600 s, is also onceflow's); not on
      RabbitMQ, which has no visibility timeout;
    * ``accept_content`` — a worker decodes a message before it knows its task: if
      your list leaves out ``json``, ``json`` is added (onceflow's wake-ups are JSON);
    * ``beat_schedule["onceflow-sweep"]`` — beat's sweep entry, added beside yours.

    Returns the defaults to add (the first two); the others are written in ``conf``. Each
    key set is logged (once: this runs when the app's configuration is loaded).
    """
    added: dict[str, Any] = {}
    said: list[str] = []
    if not user_sets(conf, "broker_url") and not _env_broker():
        added["broker_url"] = broker_url(settings)
        said.append("broker_url (onceflow's broker)")
    options = conf.get("broker_transport_options") or {}
    url = _env_broker_url() or added.get("broker_url") or conf.get("broker_url")
    if "visibility_timeout" not in options and not is_amqp(url):
        visibility = settings.broker_visibility_timeout_seconds
        new = {**options, "visibility_timeout": visibility}
        if user_sets(conf, "broker_transport_options"):
            conf["broker_transport_options"] = new  # yours, with the one key added
        else:
            added["broker_transport_options"] = new
        said.append(f"broker_transport_options['visibility_timeout'] = {visibility:g}")
    accept = conf.get("accept_content")
    if accept is not None and "json" not in accept and "application/json" not in accept:
        conf["accept_content"] = [*accept, "json"]
        log.warning(
            "Celery app %r: accept_content %r left out json; added it (onceflow's "
            "wake-ups are JSON messages)",
            app_name,
            list(accept),
        )
    schedule = conf.get("beat_schedule") or {}
    if SWEEP_SCHEDULE_KEY not in schedule:
        entry = sweep_schedule_entry(settings, maintenance_queue)
        conf["beat_schedule"] = {**schedule, SWEEP_SCHEDULE_KEY: entry}
        said.append(f"beat_schedule[{SWEEP_SCHEDULE_KEY!r}]")
    if said:
        log.info(
            "Celery app %r: onceflow set %s (unset by the app; docs/celery.md)",
            app_name,
            ", ".join(said),
        )
    return added


def _env_broker_url() -> str | None:
    return os.environ.get("CELERY_BROKER_URL") or None


def _env_broker() -> bool:
    return bool(_env_broker_url())


def guest_defaults(
    app: Any, settings: Callable[[], Settings], maintenance_queue: str
) -> Callable[[], dict[str, Any]]:
    """The lazy defaults a Flow adds to your app: :func:`guest_config`, when Celery loads
    the app's configuration (never at import)."""
    return lambda: guest_config(app.conf, settings(), maintenance_queue, app_name=app.main)
