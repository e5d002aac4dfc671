"""The tasks bench/cost_bench.py runs in real Celery worker processes.

* ``flow`` / ``flow_app``: the demo's Flow (``onceflow.demo.stages``), whose ``evaluate``
  stage makes one LLM call per column under the compute lock ``eval:<column>``
  (``ctx.compute_once``); task events turned off, like every side here.
* ``capp``: a plain Celery app with the same shipped settings
  (``onceflow.tasks.config.celery_config``, events off) and one task per side, each making
  the same one LLM call per cell, with the same prompt (so the stand-in counts per cell):
  ``cost.naive`` (plain), ``cost.once`` (``celery_once.QueueOnce``, its Redis backend) and
  ``cost.singleton`` (``celery_singleton.Singleton``). The two peers are imported only
  if installed (bench/cost_bench.py puts them in a venv of their own).

Every finished Celery task (any side) is counted with one Redis ``INCR`` under
``COST_KEYS`` (its run tag in the key), and every worker says it is ready with another.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from celery.signals import task_postrun, worker_ready

from bench.harness import process_redis as r
from onceflow.demo.providers import llm_from_env
from onceflow.demo.stages import app as flow_app
from onceflow.demo.stages import flow
from onceflow.settings import get_settings
from onceflow.tasks.config import celery_config

__all__ = ["capp", "flow", "flow_app"]

#: Prefix of the bench's own Redis keys (counters, the peers' locks).
KEYS = os.environ.get("COST_KEYS", "onceflow-cost")
#: Broker key prefix of the Celery sides (the onceflow side uses the demo's, by run id).
BROKER_PREFIX = os.environ.get("COST_BROKER_PREFIX", KEYS + ":broker:")
QUEUES = {"naive": "cost-naive", "once": "cost-once", "singleton": "cost-singleton"}

_QUIET = {"worker_send_task_events": False, "task_send_sent_event": False}
#: kombu's Redis transport sweeps the unacked messages of a dead worker back into the queue
#: every ``unacked_restore_interval * unacked_restore_throttle`` s (100 s by default) once they
#: are older than the visibility timeout: every side here sweeps every 5 s.
_RESTORE = {"unacked_restore_interval": 5, "unacked_restore_throttle": 1}
flow_app.conf.update(_QUIET)


def _flow_transport() -> dict[str, Any]:
    from onceflow.demo.stages import _broker_namespace

    base = celery_config(flow.settings, maintenance_queue=flow.maintenance_queue)
    transport = {**base["broker_transport_options"], **_RESTORE}
    transport.update(_broker_namespace().get("broker_transport_options", {}))
    return {"broker_transport_options": transport}


flow_app.add_defaults(_flow_transport)


def _capp_config() -> dict[str, Any]:
    settings = get_settings()
    conf = celery_config(settings)
    conf["broker_transport_options"] = {
        **conf["broker_transport_options"],
        "global_keyprefix": BROKER_PREFIX,
        **_RESTORE,
    }
    conf.update(_QUIET)
    conf["task_routes"] = {f"cost.{side}": {"queue": q} for side, q in QUEUES.items()}
    # celery-once: its Redis backend on the bench's database; a lock lives 1 h by default.
    conf["ONCE"] = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": settings.redis_url, "default_timeout": 60 * 60},
    }
    conf["singleton_backend_url"] = settings.redis_url
    conf["singleton_key_prefix"] = KEYS + ":singleton:"
    return conf


capp = Celery("onceflow-cost", set_as_current=False)
capp.add_defaults(_capp_config)


def call_llm(job: str, column: str) -> float:
    """The one LLM call of a cell: the demo's prompt, through the demo's client."""
    prompt = f"cell: {job}/eval:{column}\nScore job {job} on '{column}' from 0 to 1."
    return float(json.loads(llm_from_env().complete(prompt))["score"])


def _cell(run: str, job: str, column: str) -> float:
    value = call_llm(job, column)
    r().hset(f"{KEYS}:{run}:cells", f"{job}/{column}", repr(value))
    return value


@capp.task(name="cost.naive", ignore_result=True)
def naive(run: str, job: str, column: str) -> float:
    return _cell(run, job, column)


try:
    from celery_once import QueueOnce

    @capp.task(name="cost.once", base=QueueOnce, ignore_result=True)
    def once(run: str, job: str, column: str) -> float:
        return _cell(run, job, column)

except ImportError:  # pragma: no cover - the peer is not installed here
    once = None

try:
    from celery_singleton import Singleton

    @capp.task(name="cost.singleton", base=Singleton, ignore_result=True)
    def singleton(run: str, job: str, column: str) -> float:
        return _cell(run, job, column)

except ImportError:  # pragma: no cover
    singleton = None


@task_postrun.connect
def _finished(task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    """One INCR per finished cost task, under its run's tag."""
    name = getattr(task, "name", "")
    if not name.startswith("cost."):
        return
    run = (args or [None])[0] if args else (kwargs or {}).get("run")
    r().incr(f"{KEYS}:{run}:done")


@worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    r().incr(f"{KEYS}:ready:{os.environ.get('COST_WORKER_TAG', '')}")
