"""What a stage body gets: :class:`StageContext` — its request, its lease, its fenced steps.

Shared by the two runtimes that run stage bodies: Celery tasks (:mod:`onceflow.tasks`) and
the standalone worker (:mod:`onceflow.worker`), so a body runs unchanged under either.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from onceflow.errors import Cancelled, InvalidRequest, LeaseLost
from onceflow.locks import compute_once
from onceflow.models.ops import OpModel
from onceflow.models.requests import Claim, NewRequest, Request
from onceflow.oplog import ApplyResult, OpLog, SubDoc, new_op_id, stage_op_id
from onceflow.queue import Queue

TRACEBACK_LINES = 30
_oplogs: dict[int, tuple[Queue, OpLog]] = {}


def oplog_for(queue: Queue) -> OpLog:
    """The op log on the same engine and settings as ``queue`` (one per queue, per process)."""
    entry = _oplogs.get(id(queue))
    if entry is None or entry[0] is not queue:  # the queue is kept alive, so ids cannot recur
        entry = _oplogs[id(queue)] = (queue, OpLog(queue.engine, queue.settings))
    return entry[1]


T = TypeVar("T")


class StageContext:
    """What a stage body gets besides its input: its request, its lease, its fenced steps."""

    def __init__(self, queue: Queue, claim: Claim, worker_id: str) -> None:
        self._queue = queue
        self._claim = claim
        self._lost = threading.Event()
        self._cancel = threading.Event()
        self._then: list[NewRequest] = []
        self.worker_id = worker_id
        # When the database last confirmed the lease (claim or heartbeat), on this process's
        # monotonic clock: it only bounds how long a completion keeps retrying.
        self._confirmed_at = time.monotonic()

    @property
    def request(self) -> Request:
        """The claimed request (ids, input, attempt, …)."""
        return self._claim.request

    @property
    def attempt(self) -> int:
        """Which run this is (1 for the first)."""
        return self._claim.attempt

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat learned that the lease is gone."""
        return self._lost.is_set()

    @property
    def cancel_requested(self) -> bool:
        """True once a heartbeat learned that cancel was requested."""
        return self._cancel.is_set()

    def heartbeat(self) -> None:
        """Extend the lease now; raises :class:`LeaseLost` or :class:`Cancelled`."""
        try:
            beat = self._queue.heartbeat(self._claim)
        except LeaseLost:
            self._lost.set()
            raise
        if beat.cancel_requested:
            self._cancel.set()
        self.check()

    def check(self) -> None:
        """Raise unless this worker still holds a live lease and cancel was not requested."""
        if self._lost.is_set():
            raise LeaseLost(self._claim.request_id, "a heartbeat was rejected")
        if self._cancel.is_set():
            raise Cancelled(self._claim.request_id)

    def then(
        self, stage: str, input: Any = None, *, branch_path: str | None = None, **options: Any
    ) -> None:
        """Hand off to a next stage: enqueued in the same transaction as this completion.

        The request is built from ``stage``'s declaration now (worker class, dedupe,
        priority, attempts; input validated); ``options`` override declared fields.
        An undeclared stage or an input that does not fit raises here —
        :class:`~onceflow.errors.UnknownStage` / :class:`~onceflow.InvalidRequest` —
        which fails this stage (not retried) and hands off nothing.
        """
        req = self.request
        try:
            item = NewRequest(
                workspace_id=req.workspace_id,
                job_id=req.job_id,
                stage=stage,
                branch_path=req.branch_path if branch_path is None else branch_path,
                input={} if input is None else input,
                **options,
            )
        except TypeError as exc:  # an unknown option name
            raise InvalidRequest(f"hand-off to {stage!r}: {exc}") from None
        self._then.append(self._queue.resolve(item))

    @property
    def claim(self) -> Claim:
        """The claim itself, for fenced writes of the other layers (never log it)."""
        return self._claim

    def read_sub_doc(self, sub_doc: str) -> SubDoc:
        """A sub-doc of this request's workspace, as committed now (state and clock)."""
        return oplog_for(self._queue).get_sub_doc(self.request.workspace_id, sub_doc)

    def apply_op(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        key: str | None = None,
        op_id: str | None = None,
    ) -> ApplyResult:
        """Write through the op log (layer 3), fenced by this stage's claim.

        A write from a worker whose lease is gone raises :class:`LeaseLost` and
        changes nothing. ``key`` names the write within the stage (e.g. the
        column): its op id is derived from the request and the key, so a retry
        of the stage joins the first attempt's write instead of repeating it.
        """
        self.check()
        if op_id is None:
            # Minted once, before the first send: a retry after a database blip joins it.
            op_id = new_op_id() if key is None else stage_op_id(self.request.request_id, key)
        oplog = oplog_for(self._queue)
        workspace = self.request.workspace_id
        return self._queue.fenced_retry(
            self._claim,
            lambda: oplog.apply_op(workspace, sub_doc, op, op_id, fence=self._claim),
        )

    def compute_once(
        self,
        task: str,
        check: Callable[[], T | None],
        compute: Callable[[], T],
        store: Callable[[T], object],
        **kw: Any,
    ) -> Any:
        """:func:`onceflow.locks.compute_once` on this request's workspace and job (layer 2).

        The lease is checked before ``compute()`` and before ``store()``, so a stage
        that lost its claim stops there; ``kw`` passes ``wait``, ``ttl``, ``backend``….
        """
        req = self.request

        def fenced_compute() -> T:
            self.check()
            return compute()

        def fenced_store(value: T) -> object:
            self.check()
            return store(value)

        return compute_once(
            req.workspace_id, req.job_id, task,
            check=check, compute=fenced_compute, store=fenced_store, **kw,
        )  # fmt: skip


def error_payload(exc: BaseException) -> dict[str, Any]:
    """A JSON description of an exception, kept on the row (never raises)."""
    try:
        message = str(exc)[:2000]
    except Exception:  # an exception whose __str__ raises must still be recorded
        message = f"<{type(exc).__name__}: str() failed>"
    try:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        tail = "".join(lines).splitlines()[-TRACEBACK_LINES:]
    except Exception:
        tail = []
    return {"type": type(exc).__name__, "message": message, "traceback": tail}


def to_json_result(value: Any) -> Any:
    """A stage's return value as JSON-able data (pydantic models are dumped)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value
