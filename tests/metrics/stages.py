"""Stages the metrics tests run in real Celery worker processes (prefork, recycled children).

Every pool child runs one task and exits (``worker_max_tasks_per_child = 1``), so the
test sees many child pids come and go in the multiprocess directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from pydantic import BaseModel

from onceflow.errors import OpIdConflict
from onceflow.tasks import Flow, StageContext
from tests.integration.standin import call_provider, store_get, store_put

flow = Flow(name="metrics-test")
app = flow.app
app.conf.worker_max_tasks_per_child = 1

WC = "m-work"
IDLE = "m-idle"  # no worker consumes it: its rows stay queued (the gauges' live rows)


class Value(BaseModel):
    value: int = 0


class Cell(BaseModel):
    standin: str
    cell: str


@flow.stage("m_ok", input=Value, worker_class=WC)
def ok(ctx: StageContext, data: Value) -> dict[str, Any]:
    return {"value": data.value}


@flow.stage("m_flaky", input=Value, worker_class=WC, max_attempts=3)
def flaky(ctx: StageContext, data: Value) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")
    return {"attempt": ctx.attempt}


@flow.stage("m_dead", input=Value, worker_class=WC, max_attempts=2)
def dead(ctx: StageContext, data: Value) -> None:
    raise RuntimeError(f"always fails (attempt {ctx.attempt})")


@flow.stage("m_kill", input=Value, worker_class=WC, lease_seconds=1.0, max_crash_attempts=3)
def kill(ctx: StageContext, data: Value) -> dict[str, Any]:
    """Its first run dies with its process mid-body (a stage in progress, never finished)."""
    if ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"attempt": ctx.attempt}


@flow.stage("m_lock", input=Cell, worker_class=WC)
def lock(ctx: StageContext, data: Cell) -> dict[str, Any]:
    """Every request of one job asks the same compute: the provider is paid once."""
    value = ctx.compute_once(
        data.cell,
        check=lambda: store_get(data.standin, data.cell),
        compute=lambda: call_provider(data.standin, data.cell),
        store=lambda v: store_put(data.standin, data.cell, v),
    )
    return {"value": str(value.value if hasattr(value, "value") else value)}


@flow.stage("m_op", input=Value, worker_class=WC)
def op(ctx: StageContext, data: Value) -> dict[str, Any]:
    """One op of each outcome: applied, duplicate (its retry), conflict, refused."""
    doc = f"doc-{data.value}"
    ctx.apply_op(doc, {"type": "cell.set", "column": "c", "value": 1}, key="a")
    ctx.apply_op(doc, {"type": "cell.set", "column": "c", "value": 1}, key="a")
    with contextlib.suppress(OpIdConflict):
        ctx.apply_op(doc, {"type": "cell.set", "column": "c", "value": 2}, key="a")
    refused = ctx.apply_op(doc, {"type": "node.delete", "node": "missing"}, key="b")
    return {"refused": refused.error is not None}


@flow.stage("m_idle", input=Value, worker_class=IDLE)
def idle(ctx: StageContext, data: Value) -> None:
    raise AssertionError("no worker serves this class")


def standalone(ctx: StageContext) -> dict[str, Any]:
    """A standalone worker's handler (``onceflow work tests.metrics.stages:standalone``)."""
    if ctx.request.input.get("fail"):
        raise RuntimeError("fails on purpose")
    return {"ok": True}
