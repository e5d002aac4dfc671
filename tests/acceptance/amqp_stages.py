"""The stages of the RabbitMQ tests (``tests/acceptance/test_rabbitmq.py``), on a Flow of
their own, so its app, maintenance queue and sweep row are never the Redis tests'.

Every process of it — the test's, the workers, the enqueuers — has
``ONCEFLOW_BROKER_URL=amqp://…`` (the run's vhost) when it loads the app's configuration.
Bodies record their runs in Redis, and workers count every message they processed, under
keys of this module's own (:data:`PREFIX`; the Redis tests clear theirs), read back by
:func:`executions` and :func:`processed`.

``python -m tests.acceptance.amqp_stages WORKSPACE N [CLASS]`` enqueues jobs 0…N-1 of
``amqp_noop`` in ``WORKSPACE`` (for worker class ``CLASS``) and sends a duplicate wake-up
for each; it prints how many rows it created. The test runs it in several processes at once.

``AMQP_TEST_QUEUE_TYPE=quorum`` in a process's environment sets Celery's
``task_create_missing_queue_type`` there: the queues it declares are quorum queues.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import redis
from celery.signals import task_postrun
from pydantic import BaseModel

from onceflow.keys import queue_name
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.config import maintenance_queue_for
from onceflow.tasks.routing import task_name

QUEUE_TYPE = os.environ.get("AMQP_TEST_QUEUE_TYPE", "")
# A queue keeps the type it was declared with: the quorum test's Flow has a maintenance
# queue of its own (onceflow.amqp-test-quorum), as a deployment switching types would.
flow = Flow(name=f"amqp-test-{QUEUE_TYPE}" if QUEUE_TYPE else "amqp-test")
app = flow.app
if QUEUE_TYPE:
    # What a user of quorum queues sets on the app (read when Celery loads its configuration).
    app.add_defaults(lambda: {"task_create_missing_queue_type": QUEUE_TYPE})

DEFAULT = "amqp-default"
BLOCK = "amqp-block"
PURGE = "amqp-purge"
QUORUM = "amqp-quorum"
#: Every queue these stages' wake-ups and sweeps can land in.
QUEUES = [
    *(queue_name(wc) for wc in (DEFAULT, BLOCK, PURGE, QUORUM)),
    flow.maintenance_queue,
    maintenance_queue_for("amqp-test-quorum"),
]
PREFIX = "onceflow-amqp-test:"


def _redis() -> redis.Redis:
    return redis.Redis.from_url(os.environ["ONCEFLOW_REDIS_URL"])


def record(ctx: StageContext) -> None:
    """Record one start of a body (a list per request id)."""
    entry = {"attempt": ctx.attempt, "pid": os.getpid()}
    _redis().rpush(f"{PREFIX}exec:{ctx.request.request_id}", json.dumps(entry))


def executions(request_id: str) -> list[dict[str, Any]]:
    """Every recorded start of a body for ``request_id``."""
    return [json.loads(x) for x in _redis().lrange(f"{PREFIX}exec:{request_id}", 0, -1)]


def processed(request_id: str) -> int:
    """How many messages naming ``request_id`` the workers processed (a body ran or not)."""
    return int(_redis().get(f"{PREFIX}processed:{request_id}") or 0)


def release(request_id: str, attempt: int) -> None:
    """Let run number ``attempt`` of the blocker return."""
    _redis().rpush(f"{PREFIX}release:{request_id}:{attempt}", 1)


@task_postrun.connect
def _count_messages(task_id: str, task: Any, args: Any = None, **_: Any) -> None:
    if getattr(task, "flow", None) is flow and args and isinstance(args[0], str):
        _redis().incr(f"{PREFIX}processed:{args[0]}")


class NoopInput(BaseModel):
    value: int = 0


@flow.stage(
    "amqp_noop", input=NoopInput, worker_class=DEFAULT, alternate_worker_classes=(PURGE, QUORUM)
)
def noop(ctx: StageContext, data: NoopInput) -> dict[str, Any]:
    record(ctx)
    return {"value": data.value, "pid": os.getpid()}


class ChainInput(BaseModel):
    left: int


@flow.stage("amqp_chain", input=ChainInput, worker_class=DEFAULT)
def chain(ctx: StageContext, data: ChainInput) -> dict[str, Any]:
    """Hands off to itself on the next branch until ``left`` is 0."""
    record(ctx)
    if data.left > 0:
        ctx.then("amqp_chain", {"left": data.left - 1}, branch_path=f"hop-{data.left - 1}")
    return {"left": data.left}


@flow.stage("amqp_blocker", input=NoopInput, worker_class=BLOCK, lease_seconds=2.0)
def blocker(ctx: StageContext, data: NoopInput) -> dict[str, Any]:
    """Runs until the test releases this attempt (heartbeats keep its lease)."""
    record(ctx)
    key = f"{PREFIX}release:{ctx.request.request_id}:{ctx.attempt}"
    while _redis().blpop([key], timeout=1) is None:
        pass
    return {"pid": os.getpid(), "attempt": ctx.attempt}


def main() -> None:
    """Enqueue jobs 0…N-1 of ``amqp_noop`` in a workspace, each with a duplicate wake-up."""
    workspace, n = sys.argv[1], int(sys.argv[2])
    worker_class = sys.argv[3] if len(sys.argv) > 3 else DEFAULT
    created = 0
    for i in range(n):
        result = flow.enqueue(
            "amqp_noop", workspace, f"job-{i}", "", {"value": i}, worker_class=worker_class
        )
        created += result.created
        app.send_task(task_name("amqp_noop"), args=[result.request_id],
                      queue=queue_name(worker_class), serializer="json")  # fmt: skip
    print(json.dumps({"created": created}), flush=True)


if __name__ == "__main__":
    main()
