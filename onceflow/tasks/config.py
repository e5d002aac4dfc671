"""The Celery configuration onceflow ships (users may override any key).

The Postgres table is the source of truth; a Celery message is only a wake-up
naming a request id. So: JSON only (pickle refused), late acks and requeue on
worker loss (a redelivered wake-up is harmless: the claim decides), one message
prefetched at a time, task events on for Flower, and no result backend.
"""

from __future__ import annotations

from typing import Any

from onceflow.errors import InvalidRequest
from onceflow.settings import Settings

SWEEP_TASK = "onceflow.sweep"
#: The maintenance queue (beat's sweeps) of a Flow with the default name; every onceflow
#: worker also consumes its Flow's: see :func:`maintenance_queue_for`.
MAINTENANCE_QUEUE = "onceflow"
DEFAULT_FLOW_NAME = "onceflow"


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


def celery_config(
    settings: Settings, *, maintenance_queue: str = MAINTENANCE_QUEUE
) -> dict[str, Any]:
    """Celery settings for ``settings`` (lower-case Celery 4+ names); beat sends the
    sweeps to ``maintenance_queue`` (the Flow's: :func:`maintenance_queue_for`)."""
    interval = settings.sweep_interval_seconds
    return {
        "broker_url": settings.celery_broker_url,
        "broker_connection_retry_on_startup": True,
        # Explicit, so stage time limits can be checked against it (see Flow.stage).
        "broker_transport_options": {
            "visibility_timeout": settings.broker_visibility_timeout_seconds
        },
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
        "beat_schedule": {
            "onceflow-sweep": {
                "task": SWEEP_TASK,
                "schedule": interval,
                # No `expires` (nor eta/countdown): Celery checks those against the wall
                # clock of the worker that receives the message, and a worker whose clock
                # runs ahead would discard every sweep. Late sweeps do not pile up because
                # each begins with a compare-and-set on the database clock: one that
                # arrives within half an interval of the last sweep does nothing.
                "options": {"queue": maintenance_queue},
            }
        },
    }
