"""The lifecycle contract: the same bodies under every runner give the same rows.

Each case's body (``tests/contract/bodies.py``; ``js_worker.mjs`` for Node) runs under a
real Celery worker process (with ``onceflow beat`` for retries), the standalone
:class:`~onceflow.worker.Worker`, the Python :class:`~onceflow.integrations.pull.PullWorker`
against a real ``onceflow api``, and the JS ``PullWorker`` in Node against the same API. The
row each leaves — status, attempts, crash_attempts, the retry's due time relative to the
failure (``run_after - updated_at``, both set by the database's clock in the failure's
statement) and the error's kind — is asserted to be the same.

The budget cases call a provider through ``ctx.permit`` in a workspace whose daily budget
is 0 tokens (``on_exceeded="fail"``): the stage's ``on_budget`` decides, in this process
and on the API server alike (the ``fail`` route reads the claimed stage's declaration).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.integrations.fastapi import hash_key
from onceflow.integrations.pull import PullWorker
from onceflow.keys import queue_name
from onceflow.models import Request
from onceflow.spend import set_budget
from onceflow.worker import Worker
from tests.acceptance.procs import ROOT, free_port, started_together, wait_for, worker_args
from tests.contract import bodies
from tests.contract.bodies import CASES, CELERY, JS, PULL, WORKER, body_of, flow

pytestmark = pytest.mark.slow

APP = "tests.contract.bodies:flow"
KEY = "of_test_worker_key_contract_0123456789"
WS = "w-contract"
SDK = ROOT / "onceflow" / "sdk" / "js" / "index.js"
NODE = shutil.which("node")
BACKOFF_MAX = 600.0
ENV = {
    "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
    "ONCEFLOW_BACKOFF_MAX_SECONDS": str(int(BACKOFF_MAX)),
    "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.5",
    "ONCEFLOW_REDISPATCH_AFTER_SECONDS": "30",
    "ONCEFLOW_PAYLOAD_LIMIT_BYTES": str(bodies.PAYLOAD_LIMIT),
    "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(KEY): [PULL, JS]}),
}
#: Errors that say "the store refused what was sent": one kind, whichever layer refused.
REFUSED = {"PayloadTooLarge", "PayloadTooDeep", "InvalidRequest"}


@dataclass(frozen=True)
class Row:
    """What the contract compares: one request's row once its runs are over."""

    status: str
    attempts: int
    crash_attempts: int = 0
    error: str | None = None  # the error's kind
    retry_in: float | None = None  # run_after - updated_at, for a retry not yet due


EXPECTED = {
    "succeed": Row("succeeded", 1),
    "retry_later": Row("queued", 1, error="RetryLater", retry_in=120.0),
    "retry_later_long": Row("queued", 1, error="RetryLater", retry_in=BACKOFF_MAX),
    "permanent": Row("dead", 1, error="PermanentError"),
    "retry_on_hit": Row("succeeded", 2),
    "retry_on_miss": Row("dead", 1, error="ValueError"),
    "exhausted": Row("dead", 3, error="RuntimeError"),
    "refused_result": Row("dead", 1, error="refused"),
    # Past max_runtime: a failed attempt (not a crash), retried after the backoff, dead at
    # max_attempts — whether the runner recorded it (Celery's soft time limit) or the
    # sweeper did once the lease ended at the run deadline (the others).
    "overruns": Row("dead", 2, error="MaxRuntimeExceeded"),
    # A budget wait is retried when the period turns (at most the longest retry delay),
    # its attempt given back: queued with no attempt counted, even at max_attempts=1.
    "budget_wait": Row("queued", 0, error="BudgetExceeded", retry_in=BACKOFF_MAX),
    "budget_fail": Row("dead", 1, error="BudgetExceeded"),
}
assert set(EXPECTED) == set(CASES)


def observed(row: Request) -> Row:
    kind = row.error.get("type") if isinstance(row.error, dict) else None
    if kind in REFUSED:
        kind = "refused"
    retry_in = None
    if row.status.value == "queued":
        retry_in = round((row.run_after - row.updated_at).total_seconds())
        if kind == "BudgetExceeded" and at_the_period_start(row):
            retry_in = round(BACKOFF_MAX)  # the period turns within the longest delay
    if row.status.value == "succeeded":
        kind = None  # what an earlier attempt left is not part of a success's row
    return Row(row.status.value, row.attempts, row.crash_attempts, kind, retry_in)


def at_the_period_start(row: Request) -> bool:
    """Whether a budget wait is due when its period turns (``retry_at`` in the error),
    less than the longest retry delay after the failure (a run in the day's last minutes)."""
    turns = row.error.get("retry_at") if isinstance(row.error, dict) else None
    if not isinstance(turns, str) or row.run_after is None:
        return False
    due = datetime.fromisoformat(turns)
    return due < row.updated_at + timedelta(seconds=BACKOFF_MAX) and (
        abs((row.run_after - due).total_seconds()) < 2
    )


def runs_of(case: str) -> int:
    """How many runs a case takes (a budget wait's one run leaves no attempt counted)."""
    return max(EXPECTED[case].attempts, 1)


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """A real `onceflow api`, a real Celery worker of the Celery class and `onceflow beat`
    (which sends a retry's wake-up once it is due), started side by side; the API's URL."""
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # the standalone worker and the pull clients run in this process
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    tmp = tmp_path_factory.mktemp("contract")
    port = free_port()
    try:
        with started_together(
            tmp,
            ("api.log", ["api", "--app", APP, "--port", str(port)], "Application startup complete"),
            ("worker.log", worker_args(CELERY, app=APP, name="contract"), " ready."),
            ("beat.log", ["beat", "--app", APP], "beat: Starting"),
            env=ENV,
        ):
            yield f"http://127.0.0.1:{port}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()
        client = redis_lib.Redis.from_url(redis_url)
        client.delete(queue_name(CELERY))


def settle(rid: str, case: str, runner: str, timeout: float = 60) -> Request:
    """The row once its runs are over (the expected status and attempts, no lease held)."""
    want = EXPECTED[case]

    def check() -> Request | None:
        row = flow.queue.get(rid)
        done = row.status.value == want.status and row.attempts >= want.attempts
        done = done and (want.error is None or row.error is not None)  # it ran
        return row if done and row.lease_expires_at is None else None

    row = wait_for(check, timeout=timeout, what=f"{case} under {runner}")
    assert row is not None
    return row


def _enqueue(case: str, runner: str, worker_class: str) -> str:
    made = flow.enqueue(f"k_{case}", WS, f"j-{runner}-{case}", "main", {},
                        worker_class=worker_class)  # fmt: skip
    return str(made.request_id)


def run_celery(case: str, api: str) -> Request:
    rid = _enqueue(case, "celery", CELERY)
    return settle(rid, case, "Celery")


def run_worker(case: str, api: str) -> Request:
    rid = _enqueue(case, "worker", WORKER)
    spec = flow.spec(f"k_{case}")
    retry_on = spec.retry_on

    def handler(ctx: Any) -> Any:
        return body_of(ctx.stage)(ctx)

    def decides(exc: BaseException) -> bool:
        return retry_on is None or isinstance(exc, retry_on)

    # The stage's terms, as a Celery worker takes them from its declaration. Beat sweeps.
    with Worker(None, WORKER, handler, concurrency=1, sweep=False, max_wait=0.5,
                retry_on=decides, lease_seconds=spec.lease_seconds,
                max_runtime=spec.max_runtime, on_budget=spec.on_budget):  # fmt: skip
        return settle(rid, case, "Worker")


def run_pull(case: str, api: str) -> Request:
    rid = _enqueue(case, "pull", PULL)
    retry_on = flow.spec(f"k_{case}").retry_on
    with PullWorker(api, KEY, PULL, lease_seconds=10, retry_on=retry_on) as worker:
        runs = 0
        while runs < runs_of(case):
            if worker.run_once(body_of(f"k_{case}"), wait=5) is not None:
                runs += 1
    return settle(rid, case, "PullWorker", timeout=30)


def run_js(case: str, api: str) -> Request:
    if NODE is None:
        pytest.skip("node is not installed")
    rid = _enqueue(case, "js", JS)
    runs = str(runs_of(case))
    done = subprocess.run(
        [NODE, str(Path(__file__).with_name("js_worker.mjs")), SDK.as_uri(), api, KEY, JS,
         case, runs],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return settle(rid, case, "the JS worker", timeout=30)


RUNNERS = {"celery": run_celery, "worker": run_worker, "pull": run_pull, "js": run_js}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("case", CASES)
def test_every_runner_leaves_the_same_row(
    case: str, runner: str, api: str, clean_db: Engine
) -> None:
    # An empty table each time: a row an earlier case left due is never claimed by this one.
    set_budget(WS, "day", limit_tokens=0, on_exceeded="fail", allow_new=True)
    row = RUNNERS[runner](case, api)
    assert observed(row) == EXPECTED[case], (row.error, row.run_after, row.updated_at)
