"""What a Python pull worker holds and calls: :class:`PullClaim` (a claim over HTTP) and
:class:`ClaimClient`, the claim calls a :class:`~onceflow.integrations.pull_context.PullContext`
makes (:class:`~onceflow.integrations.pull.PullWorker` implements them).

The bottom of the pull worker's modules: the context and the compute-lock client depend on
these, never on the worker itself, so the three modules import one way only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

from onceflow.oplog import ApplyResult, SubDoc

if TYPE_CHECKING:
    from onceflow.integrations.pull_events import ClaimEvents

#: How a compute lock is let go (sent to ``…/locks/release``).
Release = Literal["computed", "double_check", "failed", "abandoned"]


@dataclass(frozen=True, slots=True)
class PullClaim:
    """A claim held over HTTP. The token is a secret: never log it (``repr`` hides it)."""

    request_id: str
    token: str = field(repr=False)
    lease_seconds: float
    lease_expires_at: datetime
    attempt: int
    request: dict[str, Any]
    #: The trace context the request was enqueued under, when the claim's answer carries
    #: it: the run continues that trace (None: the run starts under the current span), and
    #: the claim's calls made with no span current (its heartbeats) carry it as their
    #: ``traceparent``.
    trace_context: str | None = field(default=None, repr=False, compare=False)

    @property
    def workspace_id(self) -> str | None:
        """The claimed request's workspace (from the claim's answer), sent on every later
        call of the claim: the server finds the request by its key, not by its id alone."""
        ws = self.request.get("workspace_id")
        return ws if isinstance(ws, str) and ws else None


class ClaimClient(Protocol):
    """The calls of a held claim (each fenced by its token on the server)."""

    @property
    def worker_id(self) -> str: ...

    def heartbeat(self, claim: PullClaim) -> bool: ...

    # PullWorker's signatures (alike by shape): the protocol the context calls, spelled out.
    def apply_op(
        self,
        claim: PullClaim,
        sub_doc: str,
        op: dict[str, Any],
        *,
        key: str | None = None,
        op_id: str | None = None,
    ) -> ApplyResult: ...

    def read_sub_doc(self, claim: PullClaim, sub_doc: str) -> SubDoc: ...

    def acquire_lock(
        self, claim: PullClaim, task: str, ttl_seconds: float | None = None
    ) -> dict[str, Any]: ...

    def extend_lock(
        self, claim: PullClaim, task: str, lock_token: str, ttl_seconds: float | None = None
    ) -> bool: ...

    def release_lock(
        self, claim: PullClaim, task: str, lock_token: str, outcome: Release
    ) -> bool: ...

    def claim_events(self, claim: PullClaim) -> ClaimEvents: ...

    # PullWorker.take_permit's signature (alike by shape): the protocol the context calls.
    def take_permit(
        self,
        claim: PullClaim,
        provider: str,
        tokens: int,
        permit_id: str,
        *,
        cell_key: str | None = None,
        wait: float = 0.0,
    ) -> dict[str, Any]: ...

    def permit_call(
        self, claim: PullClaim, permit_id: str, action: str, body: dict[str, Any]
    ) -> dict[str, Any]: ...


__all__ = ["ClaimClient", "PullClaim", "Release"]
