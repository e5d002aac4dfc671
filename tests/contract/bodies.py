"""The bodies of the lifecycle contract (``tests/contract/test_outcomes.py``): one stage per
case, each declared for the Celery worker class and for the other runners' classes.

The same Python functions run under a real Celery worker, the standalone
:class:`~onceflow.worker.Worker` and the Python pull worker (each gets a context with
``attempt``); ``js_bodies.mjs`` has the same bodies for the JS pull worker.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel

from onceflow.context import WorkContext
from onceflow.errors import PermanentError, RetryLater
from onceflow.spend import Provider, register
from onceflow.tasks import Flow

flow = Flow(pull_worker_classes=("k-worker", "k-pull", "k-js"))  # no Celery wake-ups for them
app = flow.app

CELERY = "k-celery"
WORKER = "k-worker"
PULL = "k-pull"
JS = "k-js"
CLASSES = (WORKER, PULL, JS)
#: A result over the payload limit the contract's processes run with.
PAYLOAD_LIMIT = 100_000
#: The overrunning case's run bound and lease (seconds): heartbeats every 0.2 s.
OVERRUN_RUNTIME = 1.5
OVERRUN_LEASE = 0.6
#: The provider the budget cases call: declared in every process that imports this module
#: (the API's, the Celery worker's, the test's). The contract's workspace has a budget of
#: 0 tokens a day: every call is refused, before any rate limit is taken.
BUDGETED = register(Provider("k-budgeted", rpm=1000))


class Empty(BaseModel):
    pass


def succeed(ctx: WorkContext) -> Any:
    return {"ok": True}


def retry_later(ctx: WorkContext) -> Any:
    raise RetryLater(120, "rate limited")


def retry_later_long(ctx: WorkContext) -> Any:
    raise RetryLater(100_000, "come back tomorrow")  # over ONCEFLOW_BACKOFF_MAX_SECONDS


def permanent(ctx: WorkContext) -> Any:
    raise PermanentError("bad data")


def retry_on_hit(ctx: WorkContext) -> Any:
    if ctx.attempt == 1:
        raise ValueError("first attempt")
    return {"attempt": ctx.attempt}


def retry_on_miss(ctx: WorkContext) -> Any:
    raise ValueError("not in retry_on")


def exhausted(ctx: WorkContext) -> Any:
    raise RuntimeError(f"boom on attempt {ctx.attempt}")


def refused_result(ctx: WorkContext) -> Any:
    return {"blob": "x" * (2 * PAYLOAD_LIMIT)}


def over_budget(ctx: WorkContext) -> Any:
    with ctx.permit(BUDGETED.name):
        raise AssertionError("a refused permit runs no body")


def overruns(ctx: WorkContext) -> Any:
    # Works until told to stop, checking in: under Celery its soft time limit raises in
    # here at max_runtime; under the other runners ctx.check() raises once the lease ended
    # at the run deadline (claim time + max_runtime, database clock). Never returns.
    idle = threading.Event()  # never set: a pause between check-ins, not a condition
    while True:
        ctx.check()
        idle.wait(0.05)


#: case -> (body, stage options)
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "succeed": (succeed, {}),
    "retry_later": (retry_later, {"max_attempts": 3}),
    "retry_later_long": (retry_later_long, {"max_attempts": 3}),
    "permanent": (permanent, {"max_attempts": 3}),
    "retry_on_hit": (retry_on_hit, {"max_attempts": 2, "retry_on": (ValueError,)}),
    "retry_on_miss": (retry_on_miss, {"max_attempts": 2, "retry_on": (KeyError,)}),
    "exhausted": (exhausted, {"max_attempts": 3}),
    "refused_result": (refused_result, {"max_attempts": 2}),
    # The budget says "fail": the stage's on_budget overrides it, or leaves it so. One
    # max_attempts: a wait that counted its attempt would be dead.
    "budget_wait": (over_budget, {"max_attempts": 1, "on_budget": "wait"}),
    "budget_fail": (over_budget, {"max_attempts": 3}),
    "overruns": (
        overruns,
        {"max_attempts": 2, "max_runtime": OVERRUN_RUNTIME, "lease_seconds": OVERRUN_LEASE},
    ),
}


def _declare(case: str, body: Any, options: dict[str, Any]) -> None:
    @flow.stage(
        f"k_{case}", input=Empty, worker_class=CELERY, alternate_worker_classes=CLASSES,
        **{"lease_seconds": 10, **options},
    )  # fmt: skip
    def stage(ctx: Any, data: Empty) -> Any:
        return body(ctx)


for _case, (_body, _options) in CASES.items():
    _declare(_case, _body, _options)


def body_of(stage: str) -> Any:
    """The body of a stage (``k_<case>``), for the runners that take ``func(ctx)``."""
    return CASES[stage.removeprefix("k_")][0]
