"""The context a pull worker's function gets: :class:`PullContext`, a
:class:`~onceflow.context.WorkContext` over onceflow's HTTP API (the claim routes).

Every member of the interface a Celery stage's :class:`~onceflow.context.StageContext` has,
so one body runs under either: ids, input, attempt, the lease's state, ``heartbeat``,
fenced ``apply_op`` and ``read_sub_doc``, ``then`` and ``compute_once``
(:mod:`onceflow.integrations.pull_locks`); and ``permit``, a provider permit the server
holds for the claim (:mod:`onceflow.integrations.pull_permits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from onceflow.context import HeldContext
from onceflow.errors import InvalidRequest
from onceflow.integrations import pull_locks, pull_permits
from onceflow.integrations.pull_claim import ClaimClient, PullClaim
from onceflow.locks import Locked, Outcome
from onceflow.models.ops import OpModel
from onceflow.oplog import ApplyResult, SubDoc, new_op_id
from onceflow.spend import Provider

T = TypeVar("T")


class PullContext(HeldContext):
    """What the work function gets: a :class:`~onceflow.context.WorkContext` over HTTP.

    Beyond the interface: ``request`` (the row as the API returned it, a dict) and
    ``worker`` (the :class:`~onceflow.integrations.pull.PullWorker`). ``compute_once`` is
    the interface's own body, on the claim's lock routes.
    """

    def __init__(self, worker: ClaimClient, claim: PullClaim) -> None:
        self.worker = worker
        self._claim = claim
        super().__init__()
        self._then: list[dict[str, Any]] = []

    @property
    def claim(self) -> PullClaim:
        """The claim held over HTTP (its token is a secret: never log it)."""
        return self._claim

    @property
    def request(self) -> dict[str, Any]:
        """The claimed request as the API returned it (ids, stage, input, attempt…)."""
        return self.claim.request

    # One read-only property per field (alike by shape): what the interface declares.
    @property
    def worker_id(self) -> str:
        """This worker's id (the row's ``claimed_by``)."""
        return self.worker.worker_id

    @property
    def attempt(self) -> int:
        """Which run this is (1 for the first)."""
        return self.claim.attempt

    @property
    def input(self) -> Any:
        """The request's input."""
        return self.claim.request.get("input")

    @property
    def handoffs(self) -> list[dict[str, Any]]:
        """The hand-offs (:meth:`then`) made so far, sent with the completion."""
        return list(self._then)

    def _beat(self) -> bool:
        return self.worker.heartbeat(self.claim)

    def _request_field(self, name: str) -> str:
        return str(self.claim.request[name])

    def apply_op(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        key: str | None = None,
        op_id: str | None = None,
    ) -> ApplyResult:
        """Write to a sub-doc of the request's workspace, fenced by this claim.

        ``key`` names the write within the stage: its op id is derived from the request
        and the key, so a retried run joins the first run's write. Without ``key`` or
        ``op_id``, an op id is minted once, before the first send.
        """
        self.check()
        if isinstance(op, OpModel):
            op = op.model_dump(mode="json")
        if key is None and op_id is None:
            op_id = new_op_id()
        return self.worker.apply_op(self.claim, sub_doc, op, key=key, op_id=op_id)

    def read_sub_doc(self, sub_doc: str) -> SubDoc:
        """A sub-doc of the request's workspace as committed now, read under the claim
        (``POST /v1/claims/{id}/sub-docs``: :class:`LeaseLost` once the claim is not live)."""
        self._check_lease()
        return self.worker.read_sub_doc(self.claim, sub_doc)

    # The hook's signature (alike by shape with WorkContext's): an override spells it out.
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
        """The compute lock over the claim's lock routes: the same lock as a Celery stage's.
        ``kw``: ``ttl``, ``watchdog``, ``on_wait`` (see
        :func:`onceflow.integrations.pull_locks.compute_once`, which checks the lease before
        each acquire, ``compute()`` and ``store()``).

        The result cache across jobs (``cache=``) is not offered to pull workers yet: its
        entries live in the server's database, and no route serves or writes them under a
        claim. ``cache=`` (or ``result_cache=``) is refused with :class:`InvalidRequest`
        before anything is asked.
        """
        offered = [name for name in ("cache", "result_cache") if name in kw]
        if offered:
            raise InvalidRequest(
                f"{offered[0]}=: the result cache is not offered to pull workers yet; "
                "compute_once here is the claim's compute lock on its own cell"
            )
        return pull_locks.compute_once(self, task, check, compute, store, wait=wait, **kw)

    def permit(
        self,
        provider: str | Provider,
        tokens: int = 0,
        *,
        cell_key: str | None = None,
        timeout: float = pull_permits.DEFAULT_TIMEOUT,
    ) -> pull_permits.RemotePermitContext:
        """A permit of ``provider`` (a declared provider's name) for one call, under the
        server's shared limits and the workspace's budgets: ``with ctx.permit("openai",
        tokens=1_500) as permit: …; permit.settle(Usage(…))``. The server holds it for this
        claim (see :mod:`onceflow.integrations.pull_permits`): ``BudgetExceeded`` when a
        budget refuses, ``PermitTimeout`` (retryable) when none is granted in ``timeout``."""
        return pull_permits.permit(self, provider, tokens, cell_key=cell_key, timeout=timeout)

    def then(self, stage: str, input: Any = None, *, branch_path: str | None = None) -> None:
        """Hand off to a next stage, enqueued in the same transaction as the completion."""
        item: dict[str, Any] = {"stage": stage, "input": {} if input is None else input}
        if branch_path is not None:
            item["branch_path"] = branch_path
        self._then.append(item)
