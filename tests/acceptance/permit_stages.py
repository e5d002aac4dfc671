"""The stages of the pull-permit tests (``test_pull_permits.py``): one per pull worker class.

Their bodies run in the pull workers (the Python ``PullWorker`` in the test, the JS one in
Node, ``js_permits.mjs``): the Flow only declares them for the API's claims.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from onceflow.tasks import Flow

PY = "pp-py"
JS = "pp-js"

flow = Flow(pull_worker_classes=(PY, JS))  # no Celery wake-ups for them
app = flow.app


class Empty(BaseModel):
    pass


@flow.stage("pp_py", input=Empty, worker_class=PY, lease_seconds=30, max_attempts=1)
def pp_py(ctx: Any, data: Empty) -> Any:
    raise AssertionError("run by a Python pull worker")


@flow.stage("pp_js", input=Empty, worker_class=JS, lease_seconds=30, max_attempts=1)
def pp_js(ctx: Any, data: Empty) -> Any:
    raise AssertionError("run by the JS pull worker")


# A `wait` budget's refusal is retried when the period turns, its attempt given back: it
# waits even with one attempt.
@flow.stage("pp_py_wait", input=Empty, worker_class=PY, lease_seconds=30, max_attempts=1)
def pp_py_wait(ctx: Any, data: Empty) -> Any:
    raise AssertionError("run by a Python pull worker")


@flow.stage("pp_js_wait", input=Empty, worker_class=JS, lease_seconds=30, max_attempts=1)
def pp_js_wait(ctx: Any, data: Empty) -> Any:
    raise AssertionError("run by the JS pull worker")
