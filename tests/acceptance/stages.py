"""The stages the acceptance tests run in real Celery worker processes.

Every stage body records its executions in Redis (not in the worker's memory), so
the tests count what really ran, across processes and crashes.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from typing import Any

import redis
from celery.signals import task_postrun
from pydantic import BaseModel

from onceflow import db
from onceflow.tasks import Flow, StageContext

flow = Flow()
app = flow.app
PREFIX = "onceflow-test:"


def r() -> redis.Redis:
    return redis.Redis.from_url(os.environ["ONCEFLOW_REDIS_URL"])


def record(ctx: StageContext) -> None:
    entry = {"attempt": ctx.attempt, "pid": os.getpid(), "worker": ctx.worker_id}
    r().rpush(f"{PREFIX}exec:{ctx.request.request_id}", json.dumps(entry))


class NoopInput(BaseModel):
    value: int = 0


# A caller may route a noop only to these classes besides its own (pull workers, the
# HTTP tests' Hypothesis class, the purge, pickle and hostile-message tests' queues); any
# other is refused.
NOOP_CLASSES = ("t-pull", "t-hyp", "t-purge", "t-pickle", "tabs", "t-hostile")


# Pull workers of the HTTP tests write their job's sub-docs and `doc-…` ones under a noop
# claim, and hand off to another noop.
@flow.stage(
    "noop", input=NoopInput, worker_class="t-default", alternate_worker_classes=NOOP_CLASSES,
    sub_docs=("job:{job_id}", "job:{job_id}:*", "doc-*"), hands_off_to=("noop",),
)  # fmt: skip
def noop(ctx: StageContext, data: NoopInput) -> dict[str, Any]:
    record(ctx)
    # holding: whether this process's thread holds its connection (a prefork child does).
    # gc_frozen: objects of the parent's this process keeps out of its collections (a
    # prefork child of a Flow's worker: gc.freeze before its fork).
    return {
        "value": data.value,
        "worker": ctx.worker_id,
        "holding": db.holding(),
        "gc_frozen": gc.get_freeze_count(),
    }


class BlockInput(BaseModel):
    tag: str = ""


@flow.stage("blocker", input=BlockInput, worker_class="t-block", lease_seconds=2.0)
def blocker(ctx: StageContext, data: BlockInput) -> dict[str, Any]:
    """Runs until the test releases this attempt (a long stage; heartbeats keep its lease)."""
    record(ctx)
    key = f"{PREFIX}release:{ctx.request.request_id}:{ctx.attempt}"
    while r().blpop([key], timeout=1) is None:
        pass
    return {"worker": ctx.worker_id, "pid": os.getpid(), "attempt": ctx.attempt}


@flow.stage("always_fails", input=NoopInput, worker_class="t-fail", max_attempts=3)
def always_fails(ctx: StageContext, data: NoopInput) -> None:
    record(ctx)
    raise RuntimeError(f"boom on attempt {ctx.attempt}")


@flow.stage(
    "self_kill", input=NoopInput, worker_class="t-kill", lease_seconds=1.0, max_crash_attempts=2
)
def self_kill(ctx: StageContext, data: NoopInput) -> None:
    record(ctx)
    os.kill(os.getpid(), signal.SIGKILL)


@task_postrun.connect
def _count_messages(task_id: str, task: Any, args: Any = None, **_: Any) -> None:
    """Count every message a worker processed (stage ran or not), per request id."""
    if args and isinstance(args[0], str):
        r().incr(f"{PREFIX}processed:{args[0]}")


class CellInput(BaseModel):
    column: str
    value: int


@flow.stage("write_cell", input=CellInput, worker_class="t-default")
def write_cell(ctx: StageContext, data: CellInput) -> dict[str, Any]:
    """A stage's write goes through the op log, fenced by its claim (layer 3)."""
    record(ctx)
    op = {"type": "cell.set", "column": data.column, "value": data.value}
    result = ctx.apply_op(f"job:{ctx.request.job_id}", op, key=f"cell:{data.column}")
    return {"clock": result.clock}


@flow.stage("hand_off", input=NoopInput, worker_class="t-default")
def hand_off(ctx: StageContext, data: NoopInput) -> dict[str, Any]:
    """Hands off to ``noop`` in the same transaction as its completion."""
    record(ctx)
    ctx.then("noop", {"value": data.value + 1})  # routed by noop's declaration (t-default)
    return {"handed_off": True}


@flow.stage("sleeper", input=NoopInput, worker_class="t-default", max_runtime=1.0, max_attempts=1)
def sleeper(ctx: StageContext, data: NoopInput) -> None:
    """Hangs far past its max_runtime; Celery's soft time limit interrupts it."""
    record(ctx)
    time.sleep(120)


@flow.stage("leased_pull", input=NoopInput, worker_class="t-pull", lease_seconds=3.0)
def leased_pull(ctx: StageContext, data: NoopInput) -> dict[str, Any]:
    """A pull-class stage that declares its lease (claimed over HTTP, never run here)."""
    return {"value": data.value}
