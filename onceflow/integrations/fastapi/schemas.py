"""Request and response bodies of the HTTP API (pydantic; they make the OpenAPI schema).

Bodies are strict (no type coercion: ``"1"`` is not an integer) and refuse
unknown fields, so a typo is a 422, never silently ignored.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from onceflow.ids import ID_MAX, WORKER_CLASS_MAX, check_id, check_worker_class
from onceflow.models.status import Status

Id = Annotated[str, StringConstraints(min_length=1, max_length=200)]
BranchPath = Annotated[str, StringConstraints(max_length=500)]
ClaimTokenStr = Annotated[str, StringConstraints(min_length=1, max_length=200)]
OpIdStr = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{16,64}$")]
Clock = Annotated[int, Field(ge=0, le=2**63 - 1)]
LeaseSeconds = Annotated[float, Field(gt=0, le=86_400)]
#: A workspace id in a body: 1 to 200 printable characters, checked as the server checks ids.
WorkspaceIdStr = Annotated[
    str,
    StringConstraints(min_length=1, max_length=ID_MAX),
    AfterValidator(lambda value: check_id("workspace_id", value)),
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------------ requests


class EnqueueIn(_In):
    """A stage request for the workspace in the path."""

    stage: Id = Field(description="A stage the server's Flow declares.")
    job_id: Id
    branch_path: BranchPath = ""
    input: dict[str, Any] = Field(
        default_factory=dict, description="Validated against the stage's input model."
    )
    priority: int | None = Field(default=None, ge=-32768, le=32767)
    worker_class: Id | None = Field(
        default=None,
        description="Serve this request by another worker class than the stage's "
        "(e.g. a pull-worker class of browser tabs).",
    )
    strict: bool = Field(
        default=False,
        description="409 input_mismatch (nothing written) if the request exists with "
        "another input; otherwise that is reported as input_mismatch=true.",
    )


class EnqueueOut(BaseModel):
    """What the enqueue did: ``created`` is true for exactly one caller of a request."""

    request_id: str
    created: bool
    status: Status
    input_mismatch: bool


# Same fields as models.Request on purpose: the HTTP contract is spelled out apart from the row.
class RequestOut(BaseModel):
    """A request row (never its claim token)."""

    request_id: str
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


class RequestList(BaseModel):
    """Requests of a workspace, newest first."""

    requests: list[RequestOut]


class CountsOut(BaseModel):
    """A workspace's request counts: ``{worker_class: {status: n}}`` (zeros included)."""

    workspace_id: str
    counts: dict[str, dict[str, int]]
    total: int


# ---------------------------------------------------------------------- pull workers


class ClaimIn(_In):
    """Claim the next due request of the worker class in the path."""

    worker_id: Id = Field(description="A name for this worker (shown as claimed_by).")
    lease_seconds: LeaseSeconds | None = Field(
        default=None,
        description="The longest lease to take without a heartbeat: the claim gets the shorter "
        "of this and the claimed stage's lease (the answer's `lease_seconds`); unset, the "
        "stage's lease (declared, else the server's default). Longer than every stage of the "
        "worker class allows: 422, nothing claimed.",
    )
    wait: float = Field(
        default=0,
        ge=0,
        le=60,
        description="Long poll: when nothing is claimable, wait up to this many seconds for "
        "a request to become claimable (a NOTIFY, a due time, a lapsed lease) before 204.",
    )


class ClaimOut(BaseModel):
    """A live claim. Keep ``claim_token`` secret: it is the fence of every later call."""

    request_id: str
    claim_token: str
    lease_expires_at: datetime
    lease_seconds: float
    attempt: int
    request: RequestOut
    trace_context: str | None = Field(
        default=None,
        description="The W3C trace context the request was enqueued under: its `traceparent`, "
        "then a newline and its `tracestate` when it has one; null when none was stored "
        "(tracing off where it was enqueued). Send the `traceparent` (the first line) as a "
        "header on this claim's calls, and start the run's span under it, so the run "
        "continues the enqueue's trace.",
        max_length=1024,
    )


CLAIM_WORKSPACE_DESCRIPTION = (
    "The claimed request's workspace (`request.workspace_id` of the claim's answer): the "
    "request is found by its key (workspace, id) instead of by its id alone. Another "
    "workspace than the request's is 409 lease_lost, as a wrong token is. Optional for now; "
    "required in a later major version."
)


class TokenIn(_In):
    """The claim token, sent in the body (never in the URL), and the claimed request's
    workspace."""

    claim_token: ClaimTokenStr
    workspace_id: WorkspaceIdStr | None = Field(
        default=None, description=CLAIM_WORKSPACE_DESCRIPTION
    )


class HeartbeatIn(TokenIn):
    """Extend the lease of a claim."""

    lease_seconds: LeaseSeconds | None = Field(
        default=None,
        description="New lease length, at most the claimed stage's lease (longer: 422, the "
        "lease unchanged); the claim's own by default. The lease never runs past the run "
        "deadline (the stage's max_runtime from the claim).",
    )


class HeartbeatOut(BaseModel):
    """The lease was extended; ``cancel_requested`` asks the worker to stop."""

    lease_expires_at: datetime
    cancel_requested: bool
    lease_lost: bool = False


class FollowUp(_In):
    """A next stage for the claimed request's workspace and job, enqueued with the completion."""

    stage: Id
    input: dict[str, Any] = Field(default_factory=dict)
    branch_path: BranchPath | None = Field(
        default=None, description="The claimed request's branch path by default."
    )


class CompleteIn(TokenIn):
    """Finish the claimed request with ``result``; ``then`` hands off in the same transaction."""

    result: Any = None
    then: list[FollowUp] = Field(default_factory=list, max_length=100)


class FailIn(TokenIn):
    """Report a failed run: queued again after a backoff (retryable), or dead."""

    error: Any = Field(description="A JSON description of the failure, kept on the row.")
    retryable: bool = True
    retry_in: Annotated[float, Field(ge=0, le=366 * 86_400)] | None = Field(
        default=None,
        description="Seconds before the retry, at most the server's longest backoff "
        "(ONCEFLOW_BACKOFF_MAX_SECONDS; longer: 422, nothing changed); exponential backoff "
        "if unset.",
    )


class ClaimOpIn(TokenIn):
    """A write by the claim's holder to a sub-doc of the claimed request's workspace (fenced)."""

    sub_doc: Id
    op: dict[str, Any]
    key: Id | None = Field(
        default=None,
        description="Names the write within the stage; its op id is derived from the request "
        "and the key, so a retry of the stage joins the first write.",
    )
    op_id: OpIdStr | None = Field(default=None, description="An explicit op id instead of key.")


# ------------------------------------------------------------------------------- ops


class OpIn(_In):
    """An op with the op id its client minted before the first send (kept across retries)."""

    op_id: OpIdStr
    op: dict[str, Any] = Field(description='A typed op, e.g. {"type": "cell.set", …}.')
    base_clock: Clock | None = Field(
        default=None,
        description="The sub-doc clock the client had seen when it minted the op (0 if it "
        "never saw the sub-doc). An op id the log no longer knows with base_clock below the op "
        "log's horizon may be a pruned op coming back: 409 replay_too_old. Without it the op "
        "is taken as new, so a client that may replay past the retention window must send it.",
    )


class ApplyOut(BaseModel):
    """The op's answer; a replay gets the original clock with ``duplicate=true``."""

    workspace_id: str
    sub_doc: str
    op_id: str
    clock: int | None = Field(description="The commit clock; null if the op was rejected.")
    duplicate: bool
    applied: bool
    result: Any
    error: Any
    committed_at: datetime


class SubDocOut(BaseModel):
    """A sub-doc's state at its commit clock (clock 0 and an empty state if never written)."""

    workspace_id: str
    sub_doc: str
    clock: int
    state: dict[str, Any]


class OpOut(BaseModel):
    """One applied op."""

    op_id: str
    clock: int
    op_type: str
    payload: dict[str, Any]
    result: Any
    fence: str | None = Field(description="The request whose claim fenced this write, if any.")
    committed_at: datetime


class OpsOut(BaseModel):
    """Applied ops after a clock, in clock order."""

    ops: list[OpOut]


class FieldError(BaseModel):
    """One validation error of a 422: where, what, and pydantic's error type."""

    loc: list[str | int] = Field(description='e.g. ["body", "job_id"] or ["path", "ws"].')
    msg: str
    type: str


class ErrorOut(BaseModel):
    """Every error the API answers, 422 validation errors included."""

    detail: str = Field(description="What went wrong, on one line.")
    code: str = Field(
        description="bad_request, unauthorized, forbidden, not_found, method_not_allowed, "
        "lease_lost, op_id_conflict, replay_too_old, input_mismatch, invalid_transition, "
        "request_timeout, payload_too_large, invalid_request, rate_limited, budget_exceeded, "
        "provider_busy, unavailable, "
        "not_implemented, internal"
    )
    horizon: int | None = Field(
        default=None, description="With replay_too_old: the op log's pruned clock."
    )
    errors: list[FieldError] | None = Field(
        default=None,
        description="With a 422 from validation of the parameters or body: each error.",
    )


# ------------------------------------------------------------------ path parameters

_NOT_IN_ID = r"/\x00-\x1f\x7f-\x9f"
# One URL segment: no "/", no control character, not "." or ".." (which clients resolve away).
ID_PATTERN = rf"^(?:[^{_NOT_IN_ID}]*[^.{_NOT_IN_ID}][^{_NOT_IN_ID}]*|\.{{3,}}[^{_NOT_IN_ID}]*)$"
_ID_RULES = (
    "1 to 200 characters, printable: the pattern refuses `/`, control characters, `.` and `..`; "
    "the server also refuses, with the same 422, what Python's str.isprintable() refuses "
    "(format, private-use and unassigned code points, separators other than the space)."
)


def _path_id(name: str, description: str) -> tuple[Any, AfterValidator]:
    """The ``Path`` of an id (its schema) and the server's own check of it (``check_id``)."""
    path = Path(
        min_length=1,
        max_length=ID_MAX,
        pattern=ID_PATTERN,
        description=f"{description} {_ID_RULES}",
    )
    return path, AfterValidator(lambda value: check_id(name, value))


_WS = _path_id("workspace_id", "The workspace id.")
#: A worker class (it names a broker queue): what ``check_worker_class`` accepts.
WORKER_CLASS_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9_.-]{{0,{WORKER_CLASS_MAX - 1}}}$"
WORKER_CLASS_RULES = "1 to 100 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit."
_WC = (
    Path(
        min_length=1,
        max_length=WORKER_CLASS_MAX,
        pattern=WORKER_CLASS_PATTERN,
        description=f"The worker class: {WORKER_CLASS_RULES}",
    ),
    AfterValidator(check_worker_class),
)
_RID = _path_id("request_id", "The request id.")
_SUB = _path_id("sub_doc", "The sub-doc id.")
WorkspacePath = Annotated[str, _WS[0], _WS[1]]
WorkerClassPath = Annotated[str, _WC[0], _WC[1]]
RequestIdPath = Annotated[str, _RID[0], _RID[1]]
SubDocPath = Annotated[str, _SUB[0], _SUB[1]]
