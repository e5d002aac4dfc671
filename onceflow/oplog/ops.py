"""The op log's operations, written once as steps for :class:`~onceflow.oplog.OpLog` and
:class:`~onceflow.oplog.AsyncOpLog` (see :mod:`onceflow.connector`).

``apply_quietly`` is the apply path: a fast replay lookup, then ONE transaction
(fence the stage's claim and check its stage's sub-doc scope when given one, lock the
sub-doc, find the op id, record it applied or rejected, check the retention horizon).
It answers the commit message it owes; each API publishes it after the commit with its
own Redis client.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg.errors

from onceflow.connector import (
    Call,
    Execute,
    FetchAll,
    FetchOne,
    Steps,
    Transaction,
    on_every_shard,
    one_row,
    operation,
)
from onceflow.errors import (
    InvalidRequest,
    LeaseLost,
    OpIdConflict,
    OpRejected,
    PayloadTooDeep,
    ReplayTooOld,
)
from onceflow.ids import check_id
from onceflow.metrics import record as metrics
from onceflow.models.ops import OpModel, apply, parse_op
from onceflow.models.requests import Fence, workspace_of
from onceflow.models.sub_doc_scope import SubDocScope
from onceflow.oplog import spans, sql
from onceflow.oplog.records import ApplyResult, OpRecord, SubDoc, check_op_id, new_op_id
from onceflow.payloads import Unreadable, canonical_json, encode_payload
from onceflow.queue.claims import fence_scopes, fenced_row_steps
from onceflow.settings import Settings

#: A stage's sub-doc scope by the stage's name (``Flow.sub_doc_scope``), for a fenced write.
ScopeOf = Callable[[str], SubDocScope]


class Applied(NamedTuple):
    """What the apply operation answers: the op's result, and the broadcast it owes."""

    result: ApplyResult
    op_type: str

    @property
    def broadcast(self) -> str | None:
        """The commit message to publish (None for a replay or a rejected op)."""
        done = self.result
        if done.duplicate or done.error is not None:
            return None
        return commit_message(done, self.op_type)


def commit_message(applied: ApplyResult, op_type: str) -> str:
    """The JSON published on the workspace's channel after a commit (SSE ``commit`` event)."""
    return json.dumps(
        {
            "kind": "commit",
            "workspace_id": applied.workspace_id,
            "sub_doc": applied.sub_doc,
            "clock": applied.clock,
            "op_id": applied.op_id,
            "type": op_type,
        }
    )


def _unique_violation(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, psycopg.errors.UniqueViolation):
            return True
        seen = seen.__cause__
    return False


class OpLogOps:
    """The op log's operations, written once: a mixin of ``OpLog`` and ``AsyncOpLog``."""

    settings: Settings

    if TYPE_CHECKING:  # provided by OpLog (sync Redis) and AsyncOpLog (redis.asyncio)

        def _publish(self, applied: ApplyResult, message: str) -> object:
            """Publish ``message``; the error a failed publish met (logged), else None."""

    # ------------------------------------------------------------------- writes

    @operation
    def apply_op(
        self,
        workspace_id: str | None,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None = None,
        *,
        fence: Fence | None = None,
        base_clock: int | None = None,
        sub_docs: ScopeOf | None = None,
    ) -> Steps[ApplyResult]:
        """Apply ``op`` once; a known ``op_id`` returns the original clock and result.

        ``op_id`` is mandatory for callers that may retry (the SDK mints it);
        server-internal one-shot callers may omit it. ``fence`` (a stage's claim,
        or any object with its ``request_id`` and ``token``) is checked in the same
        transaction: a worker whose lease is gone gets
        :class:`~onceflow.errors.LeaseLost` and changes nothing; with a fence,
        ``workspace_id`` may be None: the fenced request's own. ``base_clock``
        is the sub-doc clock the client had seen when it minted the op: an op id
        the log no longer knows with ``base_clock`` below the sub-doc's pruned
        horizon may be a replay of a pruned op, so it is refused
        (:class:`ReplayTooOld`). Without ``base_clock`` the op is taken as new;
        a fenced write (a live claim) is never a stale replay. ``sub_docs`` (with a
        ``fence``) gives a stage's sub-doc scope by its name: the fenced request's stage
        must allow ``sub_doc``, checked on the fenced row in the same transaction
        (:class:`~onceflow.errors.OutOfScope`, nothing written). Each outcome is
        counted in ``onceflow_ops_total``. A new commit is broadcast on the
        workspace's Redis channel after it commits, never before. While tracing, the apply
        and its broadcast are spans (:mod:`onceflow.oplog.spans`).
        """
        span = spans.start(fenced=fence is not None)
        try:
            done = yield from OpLogOps.apply_quietly.steps(
                self, workspace_id, sub_doc, op, op_id, fence=fence, base_clock=base_clock,
                sub_docs=sub_docs,
            )  # fmt: skip
        except BaseException as exc:
            if span is not None:
                spans.failed(span, exc)
            raise
        if span is None:
            if done.broadcast is not None:
                # After the commit, never before (O4): the sync client on OpLog, redis.asyncio
                # awaited on AsyncOpLog (a Call of a coroutine function is awaited).
                yield Call(self._publish, done.result, done.broadcast)
            return done.result
        spans.applied(span, done.result, done.op_type)
        sending = None
        try:
            if done.broadcast is not None:
                sending = spans.broadcast(span)
                error = yield Call(self._publish, done.result, done.broadcast)
                spans.sent(sending, error if isinstance(error, BaseException) else None)
                sending = None
        finally:
            spans.sent(sending, None)  # a publish interrupted (cancelled): still ended
            spans.ended(span)
        return done.result

    # apply_op's arguments again (a twin by shape): the same apply, the broadcast left out.
    @operation
    def apply_quietly(
        self,
        workspace_id: str | None,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None = None,
        *,
        fence: Fence | None = None,
        base_clock: int | None = None,
        sub_docs: ScopeOf | None = None,
    ) -> Steps[Applied]:
        """``apply_op`` without its broadcast: the result and the commit message it owes.

        For composing (``yield from OpLogOps.apply_quietly.steps(self, ...)``) and for the
        two APIs' ``apply_op``, which publish :attr:`Applied.broadcast` after the commit.
        """
        try:
            done = yield from self._apply(
                workspace_id, sub_doc, op, op_id, fence=fence, base_clock=base_clock,
                sub_docs=sub_docs,
            )  # fmt: skip
        except OpIdConflict:
            metrics.op("conflict")
            raise
        except ReplayTooOld:
            metrics.op("refused")
            raise
        if done.result.duplicate:
            metrics.op("duplicate")
        else:
            metrics.op("applied" if done.result.error is None else "refused")
        return done

    def _apply(
        self,
        workspace_id: str | None,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None,
        *,
        fence: Fence | None,
        base_clock: int | None,
        sub_docs: ScopeOf | None = None,
    ) -> Steps[Applied]:
        """The body of :meth:`apply_quietly`: validation first, then the statements.

        ``workspace_id`` None: the fenced request's workspace, read by the fence itself (what
        a pull worker holding only a claim reference writes to).
        """
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)
        elif fence is None:
            raise InvalidRequest("workspace_id is required unless a fence names the request")
        check_id("sub_doc", sub_doc)
        depth = self.settings.max_payload_depth
        parsed = parse_op(op, max_depth=depth)
        payload_json, payload_hash = encode_payload(
            parsed.model_dump(mode="json"),
            self.settings.payload_limit_bytes,
            what="op",
            max_depth=depth,
        )
        client_id = op_id is not None
        op_id = check_op_id(op_id) if client_id else "srv-" + new_op_id()
        if base_clock is not None and (not isinstance(base_clock, int) or base_clock < 0):
            raise InvalidRequest("base_clock must be a non-negative integer")
        key: dict[str, Any] = {"workspace_id": workspace_id, "sub_doc": sub_doc, "op_id": op_id}
        if sub_docs is not None and fence is None:
            raise InvalidRequest("a sub-doc scope is checked on a fenced write only")
        if client_id and workspace_id is not None and sub_docs is None:
            # A replay of a committed op costs this one round trip (a scoped write is
            # replayed only once the fenced row's scope allowed its sub-doc).
            found = yield FetchOne(sql.FIND_OP, key)
            if found is not None:
                return Applied(_replayed(key, found, payload_hash), parsed.type)
        locked = self._apply_locked(
            key, parsed, payload_json, payload_hash, fence, client_id, base_clock, sub_docs
        )
        try:
            done: ApplyResult = yield Transaction(locked)
        except LeaseLost:
            # The fence refused: the claim is over. A client's retry of a write that
            # committed under it (its answer lost) still gets that answer.
            replay = yield from self._fenced_replay(key, fence, client_id, payload_hash)
            if replay is None:
                metrics.zombie("op")
                raise
            return Applied(replay, parsed.type)
        except Exception as exc:
            if not _unique_violation(exc):
                raise
            # Another attempt with this op id committed while we waited for the row lock:
            # join it, never apply twice.
            found = yield FetchOne(sql.FIND_OP, key)
            if found is None:
                raise
            return Applied(_replayed(key, found, payload_hash), parsed.type)
        return Applied(done, parsed.type)

    def _fenced_replay(
        self, key: dict[str, Any], fence: Fence | None, client_id: bool, payload_hash: str
    ) -> Steps[ApplyResult | None]:
        """The op this fence's claim wrote under ``key``'s op id, replayed; None if none.

        Looked up by the fence the op row keeps (the request id), in the fenced request's
        workspace when none was given, within a reference's worker classes.
        """
        if fence is None or not client_id:
            return None
        params = {
            **key, "workspace_id": key["workspace_id"] or workspace_of(fence),
            "fence": fence.request_id, **fence_scopes(fence),
        }  # fmt: skip
        found = yield FetchOne(sql.FIND_FENCED_OP, params)
        if found is None:
            return None
        return _replayed({**key, "workspace_id": found["workspace_id"]}, found, payload_hash)

    def _apply_locked(
        self,
        key: dict[str, Any],
        parsed: OpModel,
        payload_json: str,
        payload_hash: str,
        fence: Fence | None,
        client_id: bool,
        base_clock: int | None,
        sub_docs: ScopeOf | None = None,
    ) -> Steps[ApplyResult]:
        """Inside the transaction: fence (and the fenced stage's sub-doc scope), lock the
        sub-doc, then replay, reject, or apply."""
        if fence is not None:
            # A refusal counts as a zombie write only once it is not a replay (_apply).
            fenced = yield from fenced_row_steps(fence, zombie=False)
            if sub_docs is not None:
                # Raising rolls back the fence: nothing written, the claim untouched.
                sub_docs(fenced["stage"]).check(key["sub_doc"], fenced)
            fenced_workspace = fenced["workspace_id"]
            if key["workspace_id"] is None:
                key["workspace_id"] = fenced_workspace  # also for the caller's join below
            elif key["workspace_id"] != fenced_workspace:
                # One transaction, one workspace (one shard when split by workspace): a stage
                # writes to its own workspace's sub-docs only. Raising rolls back the fence.
                raise InvalidRequest(
                    f"a fenced op is written to the fence's workspace {fenced_workspace!r}, "
                    f"not {key['workspace_id']!r}"
                )
        workspace_id, sub_doc, op_id = key["workspace_id"], key["sub_doc"], key["op_id"]
        doc = yield FetchOne(sql.LOCK_SUB_DOC, key)
        if doc is None:
            yield Execute(sql.CREATE_SUB_DOC, key)
            doc = yield FetchOne(sql.LOCK_SUB_DOC, key)
        if doc["op_found"]:
            return _replayed(key, {**doc, "clock": doc["op_clock"]}, payload_hash)
        if client_id and fence is None:
            _check_horizon(op_id, base_clock, doc["pruned_clock"])
        record = {
            **key,
            "op_type": parsed.type,
            "payload": payload_json,
            "payload_hash": payload_hash,
            "fence": fence.request_id if fence else None,
        }
        depth = self.settings.max_payload_depth
        try:
            if isinstance(doc["state"], Unreadable):
                raise OpRejected(
                    parsed.type,
                    f"the sub-doc's stored state cannot be read: {doc['state']['reason']}",
                )
            state, result = apply(doc["state"], parsed)
            try:
                state_json = canonical_json(state, what="the sub-doc's state", max_depth=depth)
            except PayloadTooDeep:
                raise OpRejected(
                    parsed.type,
                    f"the sub-doc's state would nest more than {depth} levels deep "
                    "(ONCEFLOW_MAX_PAYLOAD_DEPTH)",
                ) from None
        except OpRejected as exc:
            error = {"type": "OpRejected", "message": exc.reason}
            row = yield FetchOne(sql.RECORD_REJECTED, {**record, "error": json.dumps(error)})
            return ApplyResult(
                workspace_id, sub_doc, op_id, None, False, None, error, row["committed_at"]
            )
        clock = doc["clock"] + 1
        values = {
            **record,
            "clock": clock,
            "state": state_json,
            "result": canonical_json(result, what="result", max_depth=depth),
        }
        row = yield FetchOne(sql.RECORD_APPLIED, values)
        return ApplyResult(
            workspace_id, sub_doc, op_id, clock, False, result, None, row["committed_at"]
        )

    # -------------------------------------------------------------------- reads

    @operation
    def get_sub_doc(self, workspace_id: str, sub_doc: str) -> Steps[SubDoc]:
        """The sub-doc's state and clock (an empty state at clock 0 if never written)."""
        key = {
            "workspace_id": check_id("workspace_id", workspace_id),
            "sub_doc": check_id("sub_doc", sub_doc),
        }
        row = yield FetchOne(sql.GET_SUB_DOC, key)
        if row is None:
            return SubDoc(workspace_id, sub_doc, 0, {})
        return SubDoc(workspace_id, sub_doc, row["clock"], row["state"])

    @operation
    def ops_since(
        self, workspace_id: str, sub_doc: str, clock: int = 0, *, limit: int = 1000
    ) -> Steps[list[OpRecord]]:
        """Applied ops with a clock above ``clock``, in clock order (catching up)."""
        if not isinstance(clock, int) or clock < 0:
            raise InvalidRequest("clock must be a non-negative integer")
        if not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidRequest("limit must be an integer in [1, 10000]")
        params = {
            "workspace_id": check_id("workspace_id", workspace_id),
            "sub_doc": check_id("sub_doc", sub_doc),
            "clock": clock,
            "limit": limit,
        }
        rows = yield FetchAll(sql.OPS_SINCE, params)
        return [OpRecord(**row) for row in rows]

    @operation
    def prune(
        self, *, older_than_seconds: float, now: datetime | None = None, limit: int = 10_000
    ) -> Steps[int]:
        """Delete op rows past the retention window (at most about ``limit``); returns how many.

        Per sub-doc, the horizon is the highest clock among its applied ops older
        than the window; every applied op at or below it is deleted and the
        sub-doc's ``pruned_clock`` rises to it, so the log keeps exactly the ops
        above ``pruned_clock``. Rejected ops (no clock) go by age alone and never
        move the horizon. ``now`` (default: the database clock) is for tests.
        One pruner runs at a time; a concurrent call returns 0.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidRequest("limit must be a positive integer")
        age = older_than_seconds
        # A zero or negative age would delete ops applied just now: their retries without a
        # base clock would then be applied a second time.
        if isinstance(age, bool) or not isinstance(age, int | float) or not 0 < age <= _AGE_MAX:
            raise InvalidRequest(
                "older_than_seconds must be a positive, finite number of seconds"
                " (a century at most)"
            )
        params = {"age": float(age), "limit": limit, "now": now}
        # On a database split by workspace each shard prunes its own (one pruner per shard).
        rows = yield from on_every_shard(lambda: one_row(sql.PRUNE_OPS, params))
        return sum(int(row["deleted"]) for row in rows if row)


#: The longest retention age prune takes (seconds): a century, past any policy.
_AGE_MAX = 100 * 366 * 86_400


def _check_horizon(op_id: str, base_clock: int | None, pruned: int) -> None:
    # Called for an unknown client op id. Pruning keeps every applied op above the
    # sub-doc's pruned_clock, and an op minted at base_clock commits above it: so an op
    # based at or above the horizon that is not in the log was never applied. Below the
    # horizon it may be a pruned op coming back: refuse it rather than apply it twice.
    # Without base_clock the server cannot tell: the op is taken as new.
    if base_clock is not None and base_clock < pruned:
        raise ReplayTooOld(op_id, base_clock, pruned)


def _replayed(key: dict[str, Any], found: Any, payload_hash: str) -> ApplyResult:
    if found["payload_hash"] != payload_hash:
        raise OpIdConflict(key["op_id"], key["sub_doc"])
    return ApplyResult(
        key["workspace_id"],
        key["sub_doc"],
        key["op_id"],
        found["clock"],
        True,
        found["result"],
        found["error"],
        found["committed_at"],
    )
