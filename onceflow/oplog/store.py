"""Layer 3: apply each write once, by op id, with a gapless commit clock per sub-doc.

``apply_op`` is one transaction: lock the sub-doc row, look up the op id, apply
the op (a pure function of the state), advance the clock by one, record the op,
commit — then broadcast on the workspace's channel. A known op id is never
applied again: the retry gets the original clock and result, also when it
arrives while the first attempt is still in flight (it waits on the row lock
and joins). The same op id with another payload is :class:`OpIdConflict`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import psycopg.errors
import redis

from onceflow.db import fetch_all, fetch_one, get_engine, raw_connection
from onceflow.errors import (
    InvalidRequest,
    OpIdConflict,
    OpRejected,
    PayloadTooDeep,
    ReplayTooOld,
)
from onceflow.ids import check_id
from onceflow.keys import workspace_channel
from onceflow.metrics import record as metrics
from onceflow.models.ops import OpModel, apply, parse_op
from onceflow.models.requests import Claim
from onceflow.oplog import sql
from onceflow.payloads import Unreadable, canonical_json, encode_payload
from onceflow.queue import Queue
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.oplog")

OP_ID_RE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"


def new_op_id() -> str:
    """A nanoid-style op id: 21 URL-safe characters from ``secrets`` (126 bits)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(21))


def check_op_id(op_id: object) -> str:
    """``op_id`` if it looks like a real id (16 to 64 URL-safe characters), else an error."""
    if not isinstance(op_id, str) or not OP_ID_RE.fullmatch(op_id):
        raise InvalidRequest("op_id must be 16-64 characters of A-Z a-z 0-9 _ -")
    return op_id


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of an op: its clock (None if rejected), and whether this was a replay."""

    workspace_id: str
    sub_doc: str
    op_id: str
    clock: int | None
    duplicate: bool
    result: Any
    error: Any
    committed_at: datetime

    @property
    def applied(self) -> bool:
        """True if the op changed the sub-doc (now or on its first attempt)."""
        return self.error is None

    def as_json(self) -> dict[str, Any]:
        """A JSON-able dict for APIs."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["committed_at"] = self.committed_at.isoformat()
        return out


@dataclass(frozen=True, slots=True)
class SubDoc:
    """A sub-doc's state at a commit clock."""

    workspace_id: str
    sub_doc: str
    clock: int
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One applied op, as ``ops_since`` returns it."""

    op_id: str
    clock: int
    op_type: str
    payload: dict[str, Any]
    result: Any
    fence: str | None
    committed_at: datetime


class OpLog:
    """The op log of a database. Thread-safe; build one per process and share it."""

    def __init__(self, engine: Any = None, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        if engine is None or isinstance(engine, str):
            engine = get_engine(engine or self.settings.database_url)
        self.engine = engine
        self._redis: tuple[int, redis.Redis] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------- writes

    def apply_op(
        self,
        workspace_id: str,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None = None,
        *,
        fence: Claim | None = None,
        base_clock: int | None = None,
    ) -> ApplyResult:
        """Apply ``op`` once; a known ``op_id`` returns the original clock and result.

        ``op_id`` is mandatory for callers that may retry (the SDK mints it);
        server-internal one-shot callers may omit it. ``fence`` (a stage's claim)
        is checked in the same transaction: a worker whose lease is gone gets
        :class:`~onceflow.errors.LeaseLost` and changes nothing. ``base_clock``
        is the sub-doc clock the client had seen when it minted the op: an op id
        the log no longer knows with ``base_clock`` below the sub-doc's pruned
        horizon may be a replay of a pruned op, so it is refused
        (:class:`ReplayTooOld`). Without ``base_clock`` the op is taken as new;
        a fenced write (a live claim) is never a stale replay. Each outcome is
        counted in ``onceflow_ops_total``.
        """
        try:
            done = self._apply_op(
                workspace_id, sub_doc, op, op_id, fence=fence, base_clock=base_clock
            )
        except OpIdConflict:
            metrics.op("conflict")
            raise
        except ReplayTooOld:
            metrics.op("refused")
            raise
        if done.duplicate:
            metrics.op("duplicate")
        else:
            metrics.op("applied" if done.error is None else "refused")
        return done

    def _apply_op(
        self,
        workspace_id: str,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None = None,
        *,
        fence: Claim | None = None,
        base_clock: int | None = None,
    ) -> ApplyResult:
        """The body of :meth:`apply_op`."""
        check_id("workspace_id", workspace_id)
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
        key = {"workspace_id": workspace_id, "sub_doc": sub_doc, "op_id": op_id}
        with raw_connection(self.engine) as raw:
            if client_id:
                # A replay of a committed op costs this one round trip.
                found = fetch_one(raw, sql.FIND_OP, key)
                if found is not None:
                    return self._replayed(key, found, payload_hash)
            try:
                with raw.transaction():
                    done = self._apply_locked(
                        raw, key, parsed, payload_json, payload_hash, fence, client_id, base_clock
                    )
            except psycopg.errors.UniqueViolation:
                # Another attempt with this op id committed while we waited for the row lock:
                # join it, never apply twice.
                found = fetch_one(raw, sql.FIND_OP, key)
                if found is None:
                    raise
                return self._replayed(key, found, payload_hash)
        if not done.duplicate and done.error is None:
            self._broadcast(done, parsed.type)  # after commit, never before (O4)
        return done

    def _apply_locked(
        self,
        raw: psycopg.Connection[Any],
        key: dict[str, Any],
        parsed: OpModel,
        payload_json: str,
        payload_hash: str,
        fence: Claim | None,
        client_id: bool,
        base_clock: int | None,
    ) -> ApplyResult:
        """Inside the transaction: lock the sub-doc, then replay, reject, or apply and record."""
        workspace_id, sub_doc, op_id = key["workspace_id"], key["sub_doc"], key["op_id"]
        if fence is not None:
            Queue.fence_check(raw, fence)
        doc = self._lock_sub_doc(raw, key)
        if doc["op_found"]:
            return self._replayed(key, {**doc, "clock": doc["op_clock"]}, payload_hash)
        if client_id and fence is None:
            self._check_horizon(op_id, base_clock, doc["pruned_clock"])
        record = {
            **key,
            "op_type": parsed.type,
            "payload": payload_json,
            "payload_hash": payload_hash,
            "fence": fence.request_id if fence else None,
        }
        try:
            if isinstance(doc["state"], Unreadable):
                raise OpRejected(
                    parsed.type,
                    f"the sub-doc's stored state cannot be read: {doc['state']['reason']}",
                )
            state, result = apply(doc["state"], parsed)
            depth = self.settings.max_payload_depth
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
            row = fetch_one(raw, sql.RECORD_REJECTED, {**record, "error": json.dumps(error)})
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
        row = fetch_one(raw, sql.RECORD_APPLIED, values)
        return ApplyResult(
            workspace_id, sub_doc, op_id, clock, False, result, None, row["committed_at"]
        )

    def _lock_sub_doc(self, raw: psycopg.Connection[Any], key: dict[str, Any]) -> Any:
        doc = fetch_one(raw, sql.LOCK_SUB_DOC, key)
        if doc is None:
            raw.execute(sql.CREATE_SUB_DOC, key)
            doc = fetch_one(raw, sql.LOCK_SUB_DOC, key)
        return doc

    @staticmethod
    def _check_horizon(op_id: str, base_clock: int | None, pruned: int) -> None:
        # Called for an unknown client op id. Pruning keeps every applied op above the
        # sub-doc's pruned_clock, and an op minted at base_clock commits above it: so an op
        # based at or above the horizon that is not in the log was never applied. Below the
        # horizon it may be a pruned op coming back: refuse it rather than apply it twice.
        # Without base_clock the server cannot tell: the op is taken as new.
        if base_clock is not None and base_clock < pruned:
            raise ReplayTooOld(op_id, base_clock, pruned)

    @staticmethod
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

    # -------------------------------------------------------------------- reads

    def get_sub_doc(self, workspace_id: str, sub_doc: str) -> SubDoc:
        """The sub-doc's state and clock (an empty state at clock 0 if never written)."""
        key = {
            "workspace_id": check_id("workspace_id", workspace_id),
            "sub_doc": check_id("sub_doc", sub_doc),
        }
        with raw_connection(self.engine) as raw:
            row = fetch_one(raw, sql.GET_SUB_DOC, key)
        if row is None:
            return SubDoc(workspace_id, sub_doc, 0, {})
        return SubDoc(workspace_id, sub_doc, row["clock"], row["state"])

    def ops_since(
        self, workspace_id: str, sub_doc: str, clock: int = 0, *, limit: int = 1000
    ) -> list[OpRecord]:
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
        with raw_connection(self.engine) as raw:
            rows = fetch_all(raw, sql.OPS_SINCE, params)
        return [OpRecord(**row) for row in rows]

    def prune(
        self, *, older_than_seconds: float, now: datetime | None = None, limit: int = 10_000
    ) -> int:
        """Delete op rows past the retention window (at most about ``limit``); returns how many.

        Per sub-doc, the horizon is the highest clock among its applied ops older
        than the window; every applied op at or below it is deleted and the
        sub-doc's ``pruned_clock`` rises to it, so the log keeps exactly the ops
        above ``pruned_clock``. Rejected ops (no clock) go by age alone and never
        move the horizon. ``now`` (default: the database clock) is for tests.
        One pruner runs at a time; a concurrent call returns 0.
        """
        if not isinstance(limit, int) or limit < 1:
            raise InvalidRequest("limit must be a positive integer")
        params = {"age": float(older_than_seconds), "limit": limit, "now": now}
        with raw_connection(self.engine) as raw:
            row = fetch_one(raw, sql.PRUNE_OPS, params)
        return int(row["deleted"]) if row else 0

    # ---------------------------------------------------------------- broadcast

    def redis(self) -> redis.Redis:
        """This process's Redis client (made after the fork, on first use)."""
        pid = os.getpid()
        current = self._redis
        if current is None or current[0] != pid:
            with self._lock:
                client = redis.Redis.from_url(
                    self.settings.redis_url, socket_timeout=2, socket_connect_timeout=2
                )
                current = self._redis = (pid, client)
        return current[1]

    def _broadcast(self, applied: ApplyResult, op_type: str) -> None:
        message = json.dumps(
            {
                "kind": "commit",
                "workspace_id": applied.workspace_id,
                "sub_doc": applied.sub_doc,
                "clock": applied.clock,
                "op_id": applied.op_id,
                "type": op_type,
            }
        )
        try:
            self.redis().publish(workspace_channel(applied.workspace_id), message)
        except redis.RedisError as exc:
            # The write is committed; readers catch up with ops_since.
            log.warning(
                "commit broadcast for %s/%s failed: %s", applied.workspace_id, applied.sub_doc, exc
            )


def stage_op_id(request_id: str, key: str) -> str:
    """A deterministic op id for a stage's write: a retry of the stage joins the first write."""
    digest = hashlib.sha256(json.dumps([request_id, key]).encode()).digest()
    return "stg-" + digest.hex()[:40]
