"""The Celery task of every stage: a wake-up names a request; the task claims and runs it.

Each stage a :class:`~onceflow.tasks.Flow` declares is registered on its app as the task
``onceflow.stage.<name>``, of base :class:`StageTask` and body :func:`task_body`. The
message carries only the request's key; the lifecycle (claim, run, complete, retry)
lives in :func:`onceflow.tasks.runtime.run_request`.
"""

from __future__ import annotations

from typing import Any, Protocol

from celery import Task

from onceflow.errors import InvalidRequest
from onceflow.ids import check_id
from onceflow.models.requests import Dispatch
from onceflow.queue import Queue
from onceflow.tasks.identity import worker_id
from onceflow.tasks.routing import send_options
from onceflow.tasks.runtime import run_request
from onceflow.tasks.spec import StageSpec


class StageOwner(Protocol):
    """What a stage task needs of the Flow that declared it."""

    @property
    def queue(self) -> Queue:
        """This process's queue."""
        ...

    def dispatch(self, item: Dispatch, *, kind: str = ...) -> bool:
        """Send the wake-up for one request."""
        ...


class StageTask(Task):
    """The one base task of every stage: the lifecycle lives in :func:`run_request`."""

    flow: StageOwner
    spec: StageSpec
    # TASK_OPTIONS (onceflow.tasks.config), as class attributes: they hold on any app.
    acks_late = True
    reject_on_worker_lost = True
    ignore_result = True
    serializer = "json"
    typing = False  # the single argument is checked by the claim, not by call signature

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Celery's, with the queue chosen as :meth:`Flow.dispatch` chooses it (your
        ``task_routes`` entry for this task, else ``onceflow.wc.<declared class>``) when
        the caller names none. :meth:`Flow.enqueue` is the way to start a stage: a
        message alone names a request that must exist already."""
        if not any(options.get(k) for k in ("queue", "exchange", "routing_key")):
            app, spec = self._get_app(), self.spec
            options = {**send_options(app, spec.name, spec.worker_class, args or ()), **options}
        return super().apply_async(args, kwargs, **options)

    def run_stage(self, request_id: str, workspace_id: str | None = None) -> dict[str, Any]:
        """Claim the request and run the stage (the message is only a wake-up).

        The wake-up names the request by its key, ``[request_id, workspace_id]``; one sent
        by a release before the workspace was in it names the id alone, and the claim
        then finds the row by its id.
        """
        if not isinstance(request_id, str):
            return {"outcome": "rejected", "reason": "the argument must be a request id string"}
        if workspace_id is not None and not isinstance(workspace_id, str):
            return {"outcome": "rejected", "reason": "the workspace must be a string"}
        try:
            check_id("request_id", request_id)
            if workspace_id is not None:
                check_id("workspace_id", workspace_id)
        except InvalidRequest as exc:
            return {"outcome": "rejected", "reason": str(exc)}
        return run_request(
            self.flow.queue,
            self.spec,
            request_id,
            worker_id(),
            self.spec_is_retryable,
            self.flow.dispatch,
            workspace_id=workspace_id,
        )

    def spec_is_retryable(self, exc: BaseException) -> bool:
        """Retry on the stage's ``retry_on`` types, or on any exception when unset."""
        if getattr(exc, "retryable", False):  # e.g. LockUnavailable: always worth a retry
            return True
        retry_on = self.spec.retry_on
        return retry_on is None or isinstance(exc, retry_on)


def task_body(task: StageTask, request_id: str, workspace_id: str | None = None) -> dict[str, Any]:
    """The body Celery calls: the lifecycle lives in the base class."""
    return task.run_stage(request_id, workspace_id)
