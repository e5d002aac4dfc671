"""Typed values that cross the layer-1 store's seam: what goes in, rows that come out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from onceflow.ids import ClaimToken, RequestId
from onceflow.models.scopes import WorkspaceScope
from onceflow.models.status import Status, status_of


@dataclass(frozen=True, slots=True)
class NewRequest:
    """One request to enqueue (``enqueue_many`` takes a list of these).

    ``dedupe=True`` derives the id from (workspace, job, branch path, stage), so
    every client asking for the same stage collapses onto one row; ``False``
    gives each enqueue a fresh random id.

    ``worker_class``, ``dedupe`` and ``priority`` left as ``None`` come from the
    stage's declaration when a :class:`~onceflow.tasks.Flow` owns the queue (its
    one builder, ``Flow.resolve``, also validates ``input``); on a bare
    :class:`~onceflow.Queue` they mean ``"default"``, ``True`` and ``0``.
    """

    workspace_id: str
    job_id: str
    stage: str
    branch_path: str = ""
    input: Any = field(default_factory=dict)
    worker_class: str | None = None
    dedupe: bool | None = None
    priority: int | None = None
    max_attempts: int | None = None
    max_crash_attempts: int | None = None
    run_after_seconds: float = 0.0
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """What an enqueue did: ``created`` is True only for the caller that inserted the row."""

    request_id: RequestId
    created: bool
    status: Status
    input_mismatch: bool = False
    stage: str = ""
    worker_class: str = ""
    #: The request's workspace (with ``request_id``, the row's key).
    workspace_id: str = ""
    #: The trace context the row was enqueued under, read back when this enqueue joined an
    #: existing row (``created=False``): the enqueue's span links to it. None otherwise.
    trace_context: str | None = field(default=None, compare=False, repr=False)


# The API's RequestOut repeats these fields on purpose: the HTTP contract is spelled out apart.
@dataclass(frozen=True, slots=True)
class Request:
    """A row of ``workspace_process_requests`` (the claim token is never part of it)."""

    request_id: RequestId
    workspace_id: str
    job_id: str
    branch_path: str
    stage: str
    dedupe: bool
    input: Any
    input_hash: str
    worker_class: str
    status: Status
    claimed_by: str | None
    lease_expires_at: datetime | None
    heartbeat_at: datetime | None
    claimed_at: datetime | None
    attempts: int
    crash_attempts: int
    max_attempts: int
    max_crash_attempts: int
    run_after: datetime
    priority: int
    cancel_requested: bool
    dispatched_at: datetime | None
    result: Any
    error: Any
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Request:
        """Build from a mapping of column values (extra keys such as claim_token ignored)."""
        # Each field set through its slot: what the frozen dataclass's __init__ does, without
        # a keyword dict of 27 names (twice per claimed stage, on the hot path). The class defines
        # no __post_init__ and no defaults (test_models pins both).
        new = object.__new__(cls)
        for name, put in _SLOT_SETTERS:
            put(new, row[name])
        _put_status(new, status_of(row["status"]))
        return new

    def after_run(self, row: Mapping[str, Any]) -> Request:
        """This claimed request with ``row``'s columns (what a run changed: the queue's
        ``RUN_COLUMNS``) put in; every other field is this one's."""
        new = object.__new__(Request)
        for name, put in _SLOT_SETTERS:
            put(new, row[name] if name in row else getattr(self, name))
        _put_status(new, status_of(row["status"]))
        return new

    def as_json(self) -> dict[str, Any]:
        """A JSON-able dict (timestamps as ISO 8601), for the CLI and HTTP APIs."""
        out: dict[str, Any] = {}
        for name in _REQUEST_FIELDS:
            value = getattr(self, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        out["status"] = self.status.value
        return out


_REQUEST_FIELDS = tuple(Request.__dataclass_fields__)
#: (field, its slot's setter): what from_row and after_run fill a new Request with.
_SLOT_SETTERS = tuple((name, Request.__dict__[name].__set__) for name in _REQUEST_FIELDS)
_put_status = Request.__dict__["status"].__set__


@runtime_checkable
class Fence(Protocol):
    """What fences a write: the claimed request's id and its claim token (a :class:`Claim`,
    a :class:`ClaimRef`, a pull worker's claim). The token is a secret: never log it."""

    @property
    def request_id(self) -> str:
        """The claimed request's id."""

    @property
    def token(self) -> str:
        """The claim token (what fences every write)."""


def workspace_of(fence: object) -> str | None:
    """The workspace of a fence's request, when it carries it (a :class:`Claim` always; a
    :class:`ClaimRef` or a pull worker's claim if it was given one), else None: the
    statement then finds the row by its id alone."""
    if isinstance(fence, Claim):
        return fence.request.workspace_id
    ws = getattr(fence, "workspace_id", None)
    return ws if isinstance(ws, str) and ws else None


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """What a pull worker holds of a claim: the request id and the claim token.

    Every fenced write (``heartbeat``, ``complete``, ``hand_off``, ``fail``) takes one
    as it takes a :class:`Claim`; what the ref does not carry (the claim's lease length,
    its run deadline, which attempt it is) comes from the row, in the fenced statement
    itself. ``repr`` hides the token.
    """

    request_id: str
    token: str = field(repr=False)
    #: The worker classes the holder may work (an HTTP worker key's scope), None for any:
    #: a fenced write by this reference changes only a request of one of them.
    worker_classes: tuple[str, ...] | None = None
    #: The request's workspace (its key is ``(workspace_id, request_id)``). None: found by
    #: the id alone — one more index lookup, and on a database sharded by workspace a
    #: look at every shard; pull clients of this release send it.
    workspace_id: str | None = None
    #: The workspaces the holder may claim in (a scoped worker key's or token's), None for
    #: any: a fenced write by this reference changes only a request of one of them.
    workspaces: WorkspaceScope | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """A live claim on a request: the only holder of its claim token.

    Keep it with the code running the stage; never log it, never put it in a
    Celery message. ``repr`` hides the token. Like :class:`ClaimRef`, it has
    ``request_id`` and ``token``: either is taken by the fenced writes.
    """

    request: Request
    token: ClaimToken = field(repr=False)
    lease_expires_at: datetime
    lease_seconds: float
    max_runtime: float | None = None
    #: The trace context the row was enqueued under (W3C ``traceparent``, then
    #: ``tracestate``; None without tracing): the run continues that trace
    #: (:func:`onceflow.tracing.run_parent`).
    trace_context: str | None = field(default=None, compare=False, repr=False)

    @property
    def run_deadline(self) -> datetime | None:
        """When heartbeats stop extending the lease: claim time + ``max_runtime`` (DB clock)."""
        # Both set to the database's now() by the claim; heartbeat_at moves on with each
        # heartbeat (a claim rebuilt from the current row, as the HTTP API does).
        claimed_at = self.request.claimed_at or self.request.heartbeat_at
        if self.max_runtime is None or claimed_at is None:
            return None
        return claimed_at + timedelta(seconds=self.max_runtime)

    @property
    def request_id(self) -> RequestId:
        """The claimed request's id."""
        return self.request.request_id

    @property
    def attempt(self) -> int:
        """Which run this is (1 for the first)."""
        return self.request.attempts

    @property
    def ref(self) -> ClaimRef:
        """The claim as a pull worker holds it: request id, token and workspace."""
        return ClaimRef(self.request.request_id, self.token, workspace_id=self.request.workspace_id)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What a heartbeat learned: the new lease expiry and whether cancel was requested."""

    lease_expires_at: datetime
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A wake-up to send: which request, its stage, and the worker class whose queue gets it."""

    request_id: RequestId
    stage: str
    worker_class: str
    #: The request's workspace: the wake-up carries it, so a worker finds the row by its
    #: key (and, sharded, on its shard). None: a wake-up by id alone.
    workspace_id: str | None = None
    #: The trace context the row was enqueued under, on a sweeper's re-send: the wake-up
    #: is sent in that trace. None: sent in the current one.
    trace_context: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one sweep did; the Celery runtime sends ``to_dispatch``.

    ``rescued``: lapsed leases queued again now (a crash); ``quarantined``: lapsed leases
    ended dead or cancelled; ``overran``: runs whose lease ended at their run deadline
    (``max_runtime``), failed as ``MaxRuntimeExceeded`` — queued again after the backoff,
    or dead at ``max_attempts``.
    """

    rescued: list[RequestId]
    quarantined: list[RequestId]
    to_dispatch: list[Dispatch]
    pruned: int = 0
    overran: list[RequestId] = field(default_factory=list)
