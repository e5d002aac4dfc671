"""The stages bench/runtime_bench.py runs in real Celery worker processes.

Two apps on the same broker with the same shipped settings
(``onceflow.tasks.config.celery_config``):

* ``flow``: an onceflow Flow with one no-op stage, ``bench_noop``;
* ``bare``: a plain Celery app with one no-op task, ``bench.noop`` — the floor;
* on the same app, ``bench.floor`` (bench/drain_bench.py): the no-op between the two
  Postgres round trips that "each stage runs once" needs, hand-written — the claim of
  its row (lazy commit, as onceflow's) before the body and the durable fenced
  completion after it, on one psycopg connection per process: the design's floor.

Both bodies do nothing but, when asked to (``pickup``), push ``time.time()`` at
their start to a Redis list, for the pickup latency. Every finished task (either
app) is counted by a ``task_postrun`` handler with one Redis ``INCR``; the first
and the last finish also store their ``time.time()``, for the drain rate. The
queue names and the Redis key prefix come from the environment, so that runs of
the benchmark never share a queue.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

from celery import Celery
from celery.signals import task_postrun, worker_ready
from pydantic import BaseModel

from bench.harness import process_redis as r
from onceflow.settings import get_settings
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.config import celery_config, time_limits

#: The onceflow stage's worker class (its queue), the bare task's and the floor task's.
QUEUE = os.environ.get("ONCEFLOW_BENCH_QUEUE", "bench-runtime")
BARE_QUEUE = QUEUE + "-bare"
FLOOR_QUEUE = QUEUE + "-floor"
#: The floor's rows: their workspace and worker class (no onceflow worker consumes it).
FLOOR_WORKSPACE = "bench"
FLOOR_CLASS = "bench-floor"
#: Prefix of every Redis key the bench stages write.
KEYS = os.environ.get("ONCEFLOW_BENCH_KEYS", "onceflow-bench")
#: How many finishes make a full drain (the last one stores its time).
TOTAL = int(os.environ.get("ONCEFLOW_BENCH_TOTAL", "0"))
#: How long each body waits, in ms (both sides): 0 is the no-op drain; a few ms stand for
#: I/O-bound work (an LLM or Maps call), for scaling runs that are not CPU-bound.
BODY_SECONDS = float(os.environ.get("ONCEFLOW_BENCH_BODY_MS", "0")) / 1000

flow = Flow()
app = flow.app
bare = Celery("onceflow-bench-bare", set_as_current=False)
bare.add_defaults(lambda: celery_config(get_settings()))
#: ``ONCEFLOW_BENCH_EVENTS=0`` (bench/drain_bench.py): task events off on both apps, in the
#: workers and in the enqueuing process alike (the shipped config turns them on).
if os.environ.get("ONCEFLOW_BENCH_EVENTS") == "0":
    for _app in (app, bare):
        _app.conf.update(worker_send_task_events=False, task_send_sent_event=False)


def started(tag: str, pickup: bool) -> None:
    if pickup:
        r().rpush(f"{KEYS}:pickup:{tag}", repr(time.time()))
    if BODY_SECONDS:
        time.sleep(BODY_SECONDS)  # the stand-in for an I/O-bound body


class NoopInput(BaseModel):
    n: int = 0
    pickup: bool = False


@flow.stage("bench_noop", input=NoopInput, worker_class=QUEUE)
def bench_noop(ctx: StageContext, data: NoopInput) -> None:
    started("onceflow", data.pickup)


@bare.task(name="bench.noop", ignore_result=True)
def bare_noop(n: int = 0, pickup: bool = False) -> None:
    started("bare", pickup)


# The floor's two statements: the same row writes as onceflow's claim (CLAIM: status, token,
# worker, attempts, lease, heartbeat; commit lazy, synchronous_commit off for its own
# transaction) and completion (COMPLETE: result, token cleared, finished, fenced by the
# token; durable), addressed by the row's key; nothing read back but the input.
FLOOR_CLAIM = """
UPDATE workspace_process_requests w SET status = 'running', claim_token = %(token)s,
    claimed_by = %(worker)s, attempts = w.attempts + 1,
    lease_expires_at = now() + interval '30 seconds', heartbeat_at = now(), updated_at = now()
FROM (SELECT set_config('synchronous_commit', 'off', true)) AS lazy
WHERE w.workspace_id = %(ws)s AND w.request_id = %(rid)s AND w.status = 'queued'
RETURNING w.input
"""
FLOOR_COMPLETE = """
UPDATE workspace_process_requests SET status = 'succeeded', result = 'null'::jsonb,
    claim_token = NULL, lease_expires_at = NULL, finished_at = now(), updated_at = now()
WHERE workspace_id = %(ws)s AND request_id = %(rid)s AND claim_token = %(token)s
"""

_floor_conn: tuple[int, Any] | None = None


def floor_connection() -> Any:
    """This process's psycopg connection (autocommit) to the bench database."""
    global _floor_conn
    if _floor_conn is None or _floor_conn[0] != os.getpid():
        import psycopg
        from sqlalchemy import make_url

        url = make_url(get_settings().database_url).set(drivername="postgresql")
        conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
        _floor_conn = (os.getpid(), conn)
    return _floor_conn[1]


#: ``ONCEFLOW_BENCH_FLOOR_SHAPE=stage`` (a diagnostic): the floor's task gets what onceflow's
#: stage task has at the Celery level and the floor had not: Celery's soft and hard time
#: limits (the default ``max_runtime``'s) and an outcome dict returned through the pool.
FLOOR_AS_STAGE = os.environ.get("ONCEFLOW_BENCH_FLOOR_SHAPE") == "stage"
_SOFT, _HARD = time_limits(get_settings().max_runtime_seconds)
_FLOOR_OPTIONS: dict[str, Any] = (
    {"soft_time_limit": _SOFT, "time_limit": _HARD} if FLOOR_AS_STAGE else {}
)


@bare.task(name="bench.floor", ignore_result=True, **_FLOOR_OPTIONS)
def floor_noop(request_id: str, pickup: bool = False) -> dict[str, Any] | None:
    conn = floor_connection()
    key = {"ws": FLOOR_WORKSPACE, "rid": request_id, "token": secrets.token_hex(16)}
    row = conn.execute(FLOOR_CLAIM, {**key, "worker": f"floor-{os.getpid()}"}).fetchone()
    if row is None:
        raise RuntimeError(f"floor: {request_id} was not queued")
    started("floor", pickup)
    done = conn.execute(FLOOR_COMPLETE, key)
    if done.rowcount != 1:
        raise RuntimeError(f"floor: {request_id} not completed")
    if FLOOR_AS_STAGE:
        return {"request_id": request_id, "attempt": 1, "outcome": "succeeded"}
    return None


_TAGS = {"onceflow.stage.bench_noop": "onceflow", "bench.noop": "bare", "bench.floor": "floor"}


@worker_ready.connect
def _ready(**_: Any) -> None:
    """A worker's main process is consuming: counted, so a bench can wait for all of them."""
    r().incr(f"{KEYS}:ready")


@task_postrun.connect
def _finished(task: Any = None, **_: Any) -> None:
    """One INCR per finished task; the first and the last finish store their time."""
    tag = _TAGS.get(getattr(task, "name", ""))
    if tag is None:
        return
    now = time.time()
    count = r().incr(f"{KEYS}:done:{tag}")
    if count == 1:
        r().set(f"{KEYS}:first:{tag}", repr(now))
    if count == TOTAL:
        r().set(f"{KEYS}:last:{tag}", repr(now))
