"""The tasks and the stage bench/spend_bench.py runs in real Celery worker processes.

Everything comes from the environment the bench gives every process (``SPEND_*``):

* ``capp``: a plain Celery app with onceflow's shipped settings, task events off, and two
  tasks making one call to the stand-in provider (``bench/harness/provider.py``) per cell,
  each retried on a 429 by Celery's ``autoretry_for`` with exponential backoff and jitter:
  ``spend.naive`` as is, ``spend.rate_limit`` with Celery's ``rate_limit`` (per worker)
  set to ``SPEND_RATE_LIMIT``.
* ``flow``: an onceflow Flow with one stage, ``spend_cells``: one request per job, one call
  per cell under ``ctx.compute_once`` (so the K clients' duplicate enqueues and any rerun
  pay once per cell), the result written to the job's sub-doc. A 429 raises
  ``RetryLater(retry_after)``. With ``side="spend"`` every call first takes a permit of
  :data:`PROVIDER` (the stand-in's limits, the budgets of ``LedgerHooks``) and settles it
  with the stand-in's usage; ``side="cache"`` also passes ``cache=`` to compute_once (the
  result cache across jobs, keyed by the prompt within the workspace), when the installed
  onceflow has it (:data:`CACHE_KEY`).

Each finished Celery task (success or final failure) pushes ``[workspace, time, ok]`` to
``<SPEND_KEYS>:<run>:fin``; each worker says it is ready with one INCR.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Literal

from celery import Celery
from celery.signals import task_postrun, worker_ready
from pydantic import BaseModel, Field

from bench.harness import process_redis as r
from bench.harness.provider import RateLimited, complete, count_tokens
from onceflow.cache import CacheKey
from onceflow.errors import RetryLater
from onceflow.settings import get_settings
from onceflow.spend import LedgerHooks, Provider, Usage
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.config import celery_config

KEYS = os.environ.get("SPEND_KEYS", "onceflow-spend-bench")
URL = os.environ.get("SPEND_PROVIDER_URL", "http://127.0.0.1:1")
QUEUE = os.environ.get("SPEND_QUEUE", "spend-bench")
WINDOW = float(os.environ.get("SPEND_WINDOW", "60"))
#: The window the onceflow Provider is declared with beyond the stand-in's: a grant's
#: request reaches the provider a few ms after the grant, and not always equally late.
MARGIN = float(os.environ.get("SPEND_WINDOW_MARGIN", "0.1"))
RPM = int(os.environ.get("SPEND_RPM", "60"))
TPM = int(os.environ.get("SPEND_TPM", "60000"))
RATE_LIMIT = os.environ.get("SPEND_RATE_LIMIT") or None
BACKOFF_MAX = max(1, round(float(os.environ.get("SPEND_BACKOFF_MAX", "60"))))
MAX_RETRIES = 50

#: The stand-in's limits, shared by every worker through Redis; the ledger's budgets.
PROVIDER = Provider(
    os.environ.get("SPEND_PROVIDER_NAME", "spend-bench"),
    rpm=RPM,
    tpm=TPM,
    window_seconds=WINDOW + MARGIN,
    hooks=LedgerHooks(),
)


_QUIET = {"worker_send_task_events": False, "task_send_sent_event": False}
#: kombu's Redis transport: a dead worker's unacked messages come back within 5 s.
_RESTORE = {"unacked_restore_interval": 5, "unacked_restore_throttle": 1}


def _transport(base: dict[str, Any]) -> dict[str, Any]:
    return {
        **base["broker_transport_options"],
        **_RESTORE,
        "global_keyprefix": KEYS + ":broker:",
    }


flow = Flow()
flow_app = flow.app
flow_app.conf.update(_QUIET)
flow_app.add_defaults(
    lambda: {
        "broker_transport_options": _transport(
            celery_config(flow.settings, maintenance_queue=flow.maintenance_queue)
        )
    }
)


def _capp_config() -> dict[str, Any]:
    conf = celery_config(get_settings())
    conf["broker_transport_options"] = _transport(conf)
    conf.update(_QUIET)
    conf["task_routes"] = {"spend.*": {"queue": QUEUE + "-celery"}}
    return conf


capp = Celery("onceflow-spend-bench", set_as_current=False)
capp.add_defaults(_capp_config)

_RETRY: dict[str, Any] = {
    "autoretry_for": (RateLimited,),
    "retry_backoff": True,
    "retry_backoff_max": BACKOFF_MAX,
    "retry_jitter": True,
    "max_retries": MAX_RETRIES,
    "ignore_result": True,
}


@capp.task(name="spend.naive", **_RETRY)
def naive(run: str, workspace: str, prompt: str, max_tokens: int) -> None:
    complete(URL, workspace, prompt, max_tokens)


@capp.task(name="spend.rate_limit", rate_limit=RATE_LIMIT, **_RETRY)
def rate_limited(run: str, workspace: str, prompt: str, max_tokens: int) -> None:
    complete(URL, workspace, prompt, max_tokens)


@task_postrun.connect
def _finished(task: Any = None, args: Any = None, state: str | None = None, **_: Any) -> None:
    """A Celery side's cell ended (succeeded, or failed for good): its workspace and time."""
    if not getattr(task, "name", "").startswith("spend.") or state not in ("SUCCESS", "FAILURE"):
        return
    run, workspace = args[0], args[1]
    r().rpush(f"{KEYS}:{run}:fin", json.dumps([workspace, time.time(), state == "SUCCESS"]))


@worker_ready.connect
def _ready(**_: Any) -> None:
    r().incr(f"{KEYS}:ready")


class CellsInput(BaseModel):
    """A job's cells: one prompt each."""

    prompts: list[str] = Field(min_length=1, max_length=100)
    side: Literal["plain", "spend", "cache"]
    max_tokens: int = Field(ge=1, le=100_000)


def job_doc(job_id: str) -> str:
    return f"job:{job_id}"


@flow.stage("spend_cells", input=CellsInput, worker_class=QUEUE, max_attempts=MAX_RETRIES)
def spend_cells(ctx: StageContext, data: CellsInput) -> dict[str, int]:
    """One call per cell, paid once (compute_once); under a permit unless ``plain``."""
    ws, job = ctx.workspace_id, ctx.job_id

    def cell(i: int) -> Any:
        return ctx.read_sub_doc(job_doc(job)).state.get("cells", {}).get(str(i))

    def store(i: int, value: Any) -> None:
        op = {"type": "cell.set", "column": str(i), "value": value}
        ctx.apply_op(job_doc(job), op, key=f"cell:{i}")

    def call(i: int, prompt: str) -> str:
        if data.side == "plain":
            try:
                return complete(URL, ws, prompt, data.max_tokens).text
            except RateLimited as exc:
                raise RetryLater(exc.retry_after, "the provider answered 429") from None
        estimate = count_tokens(prompt) + data.max_tokens
        with PROVIDER.permit(
            ws, estimate, stage=ctx.stage, request_id=ctx.request_id, cell_key=f"{job}/{i}",
            claim_token=ctx.claim.token, heartbeat=ctx.heartbeat, heartbeat_every=2.0,
            timeout=4 * WINDOW,
        ) as permit:  # fmt: skip
            try:
                reply = complete(URL, ws, prompt, data.max_tokens)
            except RateLimited as exc:
                permit.rate_limited(exc.retry_after)
                raise RetryLater(exc.retry_after, "the provider answered 429") from None
            permit.settle(Usage(reply.input_tokens, reply.output_tokens))
            return reply.text

    for i, prompt in enumerate(data.prompts):
        extra: dict[str, Any] = {}
        if data.side == "cache":
            extra["cache"] = CacheKey(scope="workspace", key=prompt, ttl=3600)
        ctx.compute_once(
            f"cell:{i}",
            check=lambda i=i: cell(i),  # type: ignore[misc]
            compute=lambda i=i, p=prompt: call(i, p),  # type: ignore[misc]
            store=lambda value, i=i: store(i, value),  # type: ignore[misc]
            **extra,
        )
    return {"cells": len(data.prompts)}
