"""A user's own Celery app, with its own settings, and a Flow on it (docs/celery.md).

Its settings come from ``config_from_object`` (the layer a Flow's defaults used to
override): a YAML task serializer, no late acks, results kept in Redis, prefetch 4, its
own default queue, and routes — one of them for an onceflow stage by its documented name.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from celery import Celery
from pydantic import BaseModel

from onceflow.tasks import Flow

REDIS = os.environ.get("ONCEFLOW_REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_QUEUE = "guest-default"
STAGE_ROUTE_QUEUE = "guest-stage-q"


class UserConfig:
    broker_url = REDIS
    result_backend = REDIS
    task_serializer = "yaml"
    accept_content: ClassVar = ["yaml", "json"]
    task_acks_late = False
    task_ignore_result = False
    worker_prefetch_multiplier = 4
    task_default_queue = DEFAULT_QUEUE
    task_routes: ClassVar = {
        "guest.routed": {"queue": "guest-routed"},
        "onceflow.stage.guest_routed": {"queue": STAGE_ROUTE_QUEUE},
    }


app = Celery("guest", set_as_current=False)
app.config_from_object(UserConfig)


@app.task(name="guest.add")
def add(x: int, y: int) -> int:
    return x + y


flow = Flow(app=app)


class Empty(BaseModel):
    pass


@flow.stage("guest_plain", input=Empty, worker_class="guest-wc")
def plain(ctx: Any, data: Empty) -> dict[str, Any]:
    return {"pid": os.getpid()}


@flow.stage("guest_routed", input=Empty, worker_class="guest-wc2")
def routed(ctx: Any, data: Empty) -> dict[str, Any]:
    return {"routed": True}


@flow.stage("guest_slow", input=Empty, worker_class="guest-slow", lease_seconds=1.0)
def slow(ctx: Any, data: Empty) -> dict[str, Any]:
    """Runs until killed on its first attempt (a ``revoke(terminate=True)`` target)."""
    if ctx.claim.attempt == 1:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return {"attempt": ctx.claim.attempt}
