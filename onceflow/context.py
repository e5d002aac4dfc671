"""What a stage body gets: :class:`WorkContext` — its request, its lease, its fenced steps.

:class:`WorkContext` is the interface, defined once; two classes implement it:
:class:`StageContext` in-process, for the runtimes that run stage bodies — Celery tasks
(:mod:`onceflow.tasks`) and the standalone worker (:mod:`onceflow.worker`) — and
:class:`onceflow.integrations.pull.PullContext` over the HTTP API, for a pull worker. A body
that uses only the interface's members runs unchanged under any of the three.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar, overload, runtime_checkable

from pydantic import BaseModel

from onceflow.errors import Cancelled, InvalidRequest, LeaseLost, OutOfScope, PermitCancelled
from onceflow.locks import Locked, Outcome, compute_once
from onceflow.locks.protocol import Path
from onceflow.models.ops import OpModel
from onceflow.models.requests import Claim, Fence, NewRequest, Request
from onceflow.models.sub_doc_scope import SubDocScope, request_fields
from onceflow.oplog import ApplyResult, OpLog, SubDoc, new_op_id, stage_op_id
from onceflow.queue import Queue
from onceflow.queue.lock_outcomes import LOCK_OUTCOMES_CAP
from onceflow.spend.checks import DEFAULT_HEARTBEAT_EVERY
from onceflow.spend.provider import DEFAULT_TIMEOUT, Permit, PermitContext, Provider
from onceflow.spend.registry import get_provider, register
from onceflow.spend.usage import Usage

_oplogs: dict[int, tuple[Queue, OpLog]] = {}


def oplog_for(queue: Queue) -> OpLog:
    """The op log on the same engine and settings as ``queue`` (one per queue, per process)."""
    entry = _oplogs.get(id(queue))
    if entry is None or entry[0] is not queue:  # the queue is kept alive, so ids cannot recur
        oplog = (
            OpLog(queue.engine, queue.settings)
            if queue.shard_map is None
            else OpLog(settings=queue.settings, shard_map=queue.shard_map)
        )
        entry = _oplogs[id(queue)] = (queue, oplog)
    return entry[1]


T = TypeVar("T")


@runtime_checkable
class WorkContext(Protocol):
    """What a body gets, in-process (:class:`StageContext`) or over HTTP (``PullContext``).

    Beyond these members, :class:`StageContext` has ``request`` (the
    :class:`~onceflow.models.Request`) and ``then(..., **options)``; ``PullContext`` has
    ``request`` (the row as the API returned it, a dict) and ``worker``. See
    ``docs/integration-fastapi.md`` for the table. ``permit`` takes a provider permit for
    the run (docs/spend.md, "In a stage").
    """

    # One read-only property per field (alike by shape): what every implementation exposes.
    @property
    def request_id(self) -> str:
        """The claimed request's id."""

    @property
    def workspace_id(self) -> str:
        """The request's workspace."""

    @property
    def job_id(self) -> str:
        """The request's job."""

    @property
    def stage(self) -> str:
        """The stage being run."""

    @property
    def branch_path(self) -> str:
        """The request's branch path."""

    @property
    def worker_id(self) -> str:
        """The worker running it (the row's ``claimed_by``)."""

    @property
    def attempt(self) -> int:
        """Which run this is (1 for the first)."""

    @property
    def input(self) -> Any:
        """The request's input as stored (JSON)."""

    @property
    def claim(self) -> Fence:
        """The claim (``request_id``, ``token``): never log it."""

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat learned that the lease is gone."""

    @property
    def cancel_requested(self) -> bool:
        """True once a heartbeat learned that cancel was requested."""

    def check(self) -> None:
        """Raise :class:`LeaseLost` or :class:`Cancelled` if the work should stop now."""

    def heartbeat(self) -> None:
        """Extend the lease now; raises :class:`LeaseLost` or :class:`Cancelled`."""

    def then(self, stage: str, input: Any = None, *, branch_path: str | None = None) -> None:
        """Hand off to a next stage, enqueued in the same transaction as the completion."""

    def apply_op(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        key: str | None = None,
        op_id: str | None = None,
    ) -> ApplyResult:
        """Write to a sub-doc of the request's workspace, fenced by the claim."""

    def read_sub_doc(self, sub_doc: str) -> SubDoc:
        """A sub-doc of the request's workspace as committed now; :class:`LeaseLost` once
        the lease is known to be gone."""

    @overload
    def compute_once(
        self,
        task: str,
        check: Callable[[], T | None],
        compute: Callable[[], T],
        store: Callable[[T], object],
        *,
        wait: Literal[True] = True,
        **kw: Any,
    ) -> Outcome[T]: ...
    @overload
    def compute_once(
        self,
        task: str,
        check: Callable[[], T | None],
        compute: Callable[[], T],
        store: Callable[[T], object],
        *,
        wait: bool,
        **kw: Any,
    ) -> Outcome[T] | Locked: ...
    def compute_once(
        self,
        task: str,
        check: Callable[[], T | None],
        compute: Callable[[], T],
        store: Callable[[T], object],
        *,
        wait: bool = True,
        **kw: Any,
    ) -> Outcome[T] | Locked:
        """The compute-lock protocol on the cell (workspace, job, ``task``): ``compute()``
        is paid for once across every caller. ``wait=False``: :class:`Locked` when someone
        else holds the lock; ``kw``: ``ttl``, ``on_wait``, ``watchdog``, ``backend``….

        The lease is checked before ``compute()`` and before ``store()``, so a stage that
        lost its claim stops there. Both contexts subclass the interface and keep this body;
        they differ only in :meth:`_compute_lock`, the way to the lock.
        """
        found = self._compute_lock(task, check, compute, store, wait=wait, **kw)
        self._lock_outcome(task, found)
        return found

    def _lock_outcome(self, task: str, found: Outcome[Any] | Locked) -> None:
        """A compute-lock outcome of this run, for its history (a context that keeps them)."""
        return None

    def permit(
        self,
        provider: Provider | str,
        tokens: int = 0,
        *,
        cell_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> AbstractContextManager[CallPermit]:
        """A permit for one call to ``provider`` (a :class:`~onceflow.spend.Provider`, or
        the name of a declared one), made for this run: ``with ctx.permit("openai",
        tokens=1_500) as permit: …; permit.settle(usage)``.

        The grant carries the request's workspace, the stage, the request and the claim's
        token, so the ledger row is written in the claim's fence; ``cell_key`` names the
        compute-lock cell the call is made for. While it waits (at most ``timeout``
        seconds: :class:`~onceflow.errors.PermitTimeout`, retryable) the lease is
        extended, and the wait ends at once when the lease is known to be lost
        (:class:`LeaseLost`) or cancel was requested (:class:`Cancelled`). A budget's
        refusal raises :class:`~onceflow.errors.BudgetExceeded`: the stage's
        ``on_budget`` says what the run does. A :class:`Provider` object not declared
        yet is declared here (:func:`~onceflow.spend.register`).
        """
        declared = register(provider) if isinstance(provider, Provider) else None
        if declared is None:
            if not isinstance(provider, str):
                raise InvalidRequest(
                    f"provider must be a Provider or a declared provider's name, got {provider!r}"
                )
            declared = get_provider(provider)
        held = declared.permit(
            self.workspace_id, tokens, stage=self.stage, request_id=self.request_id,
            cell_key=cell_key, claim_token=self.claim.token, timeout=timeout,
            heartbeat=self.heartbeat, heartbeat_every=self._heartbeat_every(),
            cancel=_StopFlag(self),
        )  # fmt: skip
        return StagePermit(self, held)

    def _heartbeat_every(self) -> float:
        """How often a waiting permit extends the lease (seconds)."""
        return DEFAULT_HEARTBEAT_EVERY

    def _compute_lock(
        self,
        task: str,
        check: Callable[[], T | None],
        compute: Callable[[], T],
        store: Callable[[T], object],
        *,
        wait: bool,
        **kw: Any,
    ) -> Outcome[T] | Locked:
        """How this context reaches the compute lock, checking the lease before ``compute()``
        and before ``store()``. A :class:`StageContext`'s: :func:`onceflow.locks.compute_once`
        in-process (layer 2); ``PullContext`` runs the same lock over the claim's lock routes.
        """

        def fenced_compute() -> T:
            self.check()
            return compute()

        def fenced_store(value: T) -> object:
            self.check()
            return store(value)

        if kw.get("cache") is not None:  # a hit's ledger row names this run
            kw = {"stage": self.stage, "request_id": self.request_id, **kw}
        return compute_once(
            self.workspace_id, self.job_id, task,
            check=check, compute=fenced_compute, store=fenced_store, wait=wait, **kw,
        )  # fmt: skip


#: How a compute_once call got its value, as the request's history names it.
_LOCK_OUTCOMES = {
    Path.COMPUTED: "paid",
    Path.LOCK_LOST: "paid",  # computed, but the lock was lost before the store
    Path.WAITED: "waited",
    Path.PREFLIGHT: "stored",
    Path.DOUBLE_CHECK: "stored",
    Path.CACHE_HIT: "cached",
}


def lock_outcome_name(found: Outcome[Any] | Locked) -> str:
    """``paid`` (this run computed), ``waited`` (another caller's result), ``stored`` (found
    stored), ``cached`` (the result cache), ``locked`` (``wait=False`` found it taken)."""
    if isinstance(found, Locked):
        return "locked"
    return _LOCK_OUTCOMES.get(found.path, str(found.path))


class _StopFlag:
    """Set once the context's lease is known lost or cancel was requested: ends a permit's
    wait (the context then says which, :meth:`WorkContext.check`)."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: WorkContext) -> None:
        self._ctx = ctx

    def is_set(self) -> bool:
        return self._ctx.lease_lost or self._ctx.cancel_requested


class CallPermit(Protocol):
    """What ``with ctx.permit(…) as permit`` gives under every runner: a permit held in this
    process (:class:`~onceflow.spend.Permit`) or one the server holds for a pull worker's
    claim."""

    def settle(self, usage: Usage, *, model: str | None = None) -> None: ...

    def rate_limited(self, retry_after: float | None = None) -> None: ...


class StagePermit:
    """``with ctx.permit(…) as permit``: the provider's permit, a stopped wait raised as
    the context's :class:`LeaseLost` or :class:`Cancelled` (what the outcome table knows)."""

    def __init__(self, ctx: WorkContext, held: PermitContext) -> None:
        self._ctx = ctx
        self._held = held

    def __enter__(self) -> Permit:
        try:
            return self._held.__enter__()
        except PermitCancelled:
            self._ctx.check()  # the lease is lost or cancel was requested: say which
            raise

    # The context-manager protocol (alike by shape everywhere): Python fixes its signature.
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._held.__exit__(exc_type, exc, tb)


class Flag:
    """Set once by the heartbeat thread, read by the body: a ``threading.Event`` that nobody
    waits on (an Event builds a Condition and a lock, twice per stage)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class HeldContext(WorkContext):
    """A :class:`WorkContext` whose lease state heartbeats learn: the part both contexts
    share. A subclass says how to read a field of its request (:meth:`_request_field`), how
    to send one heartbeat (:meth:`_beat`) and, when it is not
    in-process, how to reach the compute lock (:meth:`_compute_lock`); the flags,
    :meth:`check` and :meth:`heartbeat` are here.
    """

    def __init__(self) -> None:
        self._lost = Flag()
        self._cancel = Flag()

    def _request_field(self, name: str) -> str:
        """One of the claimed request's ids, as the subclass holds the request."""
        raise NotImplementedError

    # One read-only property per field (alike by shape): what the interface declares.
    @property
    def request_id(self) -> str:
        """The claimed request's id."""
        return self.claim.request_id

    @property
    def workspace_id(self) -> str:
        """The request's workspace."""
        return self._request_field("workspace_id")

    @property
    def job_id(self) -> str:
        """The request's job."""
        return self._request_field("job_id")

    @property
    def stage(self) -> str:
        """The stage being run."""
        return self._request_field("stage")

    @property
    def branch_path(self) -> str:
        """The request's branch path."""
        return self._request_field("branch_path")

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat learned that the lease is gone."""
        return self._lost.is_set()

    @property
    def cancel_requested(self) -> bool:
        """True once a heartbeat learned that cancel was requested."""
        return self._cancel.is_set()

    def mark_lease_lost(self) -> None:
        """The lease is gone (a heartbeat was rejected, or a newer claim took over):
        :meth:`check` raises :class:`LeaseLost` from now on."""
        self._lost.set()

    def mark_cancel_requested(self) -> None:
        """Cancel was requested: :meth:`check` raises :class:`Cancelled` from now on."""
        self._cancel.set()

    def _beat(self) -> bool:
        """Send one heartbeat: whether cancel was requested; :class:`LeaseLost` if refused."""
        raise NotImplementedError

    def heartbeat(self) -> None:
        """Extend the lease now; raises :class:`LeaseLost` or :class:`Cancelled`."""
        try:
            cancel = self._beat()
        except LeaseLost:
            self._lost.set()
            raise
        if cancel:
            self._cancel.set()
        self.check()

    def _check_lease(self) -> None:
        """Raise :class:`LeaseLost` once a heartbeat learned that the lease is gone."""
        if self._lost.is_set():
            raise LeaseLost(self.claim.request_id, "a heartbeat was rejected")

    def check(self) -> None:
        """Raise unless this worker still holds a live lease and cancel was not requested."""
        if self._lost.is_set():
            raise LeaseLost(self.claim.request_id, "a heartbeat was rejected")
        if self._cancel.is_set():
            raise Cancelled(self.claim.request_id)


class StageContext(HeldContext):
    """What a stage body gets besides its input: its request, its lease, its fenced steps.

    Implements :class:`WorkContext` in-process (the queue and the op log directly); its
    ``compute_once`` is the interface's own body.

    ``sub_docs`` and ``hands_off_to``, when the stage declares them, bound what the body
    reads, writes and hands off to (:class:`~onceflow.errors.OutOfScope` past them); None:
    not declared, the body is trusted code of this process and reaches anything.
    """

    def __init__(
        self,
        queue: Queue,
        claim: Claim,
        worker_id: str,
        *,
        sub_docs: SubDocScope | None = None,
        hands_off_to: tuple[str, ...] | None = None,
    ) -> None:
        self._queue = queue
        self._claim = claim
        self._sub_docs = sub_docs
        self._hands_off_to = hands_off_to
        super().__init__()
        self._then: list[NewRequest] = []
        self._locks: list[dict[str, str]] = []
        self._worker_id = worker_id
        # When the database last confirmed the lease (claim or heartbeat), on this process's
        # monotonic clock: it only bounds how long a completion keeps retrying.
        self._confirmed_at = time.monotonic()

    @property
    def request(self) -> Request:
        """The claimed request (ids, input, attempt, …)."""
        return self._claim.request

    @property
    def worker_id(self) -> str:
        """The worker running it (the row's ``claimed_by``)."""
        return self._worker_id

    @property
    def attempt(self) -> int:
        """Which run this is (1 for the first)."""
        return self._claim.attempt

    @property
    def input(self) -> Any:
        """The request's input as stored (JSON; the body's second argument is it validated)."""
        return self._claim.request.input

    # What the runner that holds the claim tells the body, and reads back after it.

    @property
    def handoffs(self) -> list[NewRequest]:
        """The hand-offs (:meth:`then`) made so far, enqueued with the completion."""
        return list(self._then)

    @property
    def lock_outcomes(self) -> list[dict[str, str]]:
        """The run's compute-lock outcomes so far (``{"cell", "outcome"}``: paid, waited,
        stored, cached, locked), kept in the request's history by the run's end."""
        return list(self._locks)

    def _lock_outcome(self, task: str, found: Outcome[Any] | Locked) -> None:
        if len(self._locks) < LOCK_OUTCOMES_CAP:
            self._locks.append({"cell": task, "outcome": lock_outcome_name(found)})

    @property
    def confirmed_at(self) -> float:
        """When the database last confirmed the lease (this process's monotonic clock):
        it only bounds how long an outcome's write keeps retrying."""
        return self._confirmed_at

    def lease_confirmed(self, at: float | None = None) -> None:
        """A heartbeat confirmed the lease (``at``: its monotonic time; now by default)."""
        self._confirmed_at = time.monotonic() if at is None else at

    def _beat(self) -> bool:
        return self._queue.heartbeat(self._claim).cancel_requested

    def _heartbeat_every(self) -> float:
        # Within a third of the lease, as the runners' own heartbeats.
        return min(DEFAULT_HEARTBEAT_EVERY, self._claim.lease_seconds / 3)

    def _request_field(self, name: str) -> str:
        return str(getattr(self._claim.request, name))

    def then(
        self, stage: str, input: Any = None, *, branch_path: str | None = None, **options: Any
    ) -> None:
        """Hand off to a next stage: enqueued in the same transaction as this completion.

        The request is built from ``stage``'s declaration now (worker class, dedupe,
        priority, attempts; input validated); ``options`` override declared fields.
        An undeclared stage or an input that does not fit raises here —
        :class:`~onceflow.errors.UnknownStage` / :class:`~onceflow.InvalidRequest` —
        which fails this stage (not retried) and hands off nothing; so does a stage this
        one's declared ``hands_off_to`` does not name (:class:`~onceflow.errors.OutOfScope`).
        """
        req = self.request
        if self._hands_off_to is not None and stage not in self._hands_off_to:
            permitted = ", ".join(self._hands_off_to) or "none"
            raise OutOfScope(
                f"stage {req.stage!r} may not hand off to {stage!r} (hands_off_to: {permitted})"
            )
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
        """A sub-doc of this request's workspace, as committed now (state and clock).

        Raises :class:`LeaseLost` once a heartbeat learned that the lease is gone.
        """
        self._check_lease()
        self._in_scope(sub_doc)
        return oplog_for(self._queue).get_sub_doc(self.request.workspace_id, sub_doc)

    def _in_scope(self, sub_doc: str) -> None:
        """Raise :class:`~onceflow.errors.OutOfScope` past the stage's declared sub-docs."""
        if self._sub_docs is not None:
            self._sub_docs.check(sub_doc, request_fields(self.request))

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
        self._in_scope(sub_doc)
        if op_id is None:
            # Minted once, before the first send: a retry after a database blip joins it.
            op_id = new_op_id() if key is None else stage_op_id(self.request.request_id, key)
        oplog = oplog_for(self._queue)
        workspace = self.request.workspace_id
        return self._queue.fenced_retry(
            self._claim,
            lambda: oplog.apply_op(workspace, sub_doc, op, op_id, fence=self._claim),
        )


def _implements_the_interface(ctx: StageContext) -> WorkContext:
    return ctx  # mypy checks that every member of WorkContext is here, with its type


def to_json_result(value: Any) -> Any:
    """A stage's return value as JSON-able data (pydantic models are dumped)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value
