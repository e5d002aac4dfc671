# Over 400 lines: claims and every fenced write under them share the fence and retry rules.
"""Claims and the fenced writes under them: claim, heartbeat, complete, hand off, fail.

Operations of both APIs (:class:`~onceflow.Queue` and :class:`~onceflow.AsyncQueue`),
each written once as steps (see :mod:`onceflow.connector`). Every fenced write checks
the fence (token + live lease, database clock) and takes a :class:`Claim` or a bare
:class:`ClaimRef` (``request_id``, ``token``: what a pull worker holds); what a ref
does not carry — the claim's lease length, its run deadline, its attempt number, whether
a write whose answer was lost was its own — the statement reads from the row itself.
"""

from __future__ import annotations

import builtins
import inspect
import itertools
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from onceflow.connector import (
    Execute,
    FetchAll,
    FetchOne,
    OnShard,
    Pooled,
    Query,
    ShardCount,
    Sleep,
    Steps,
    Transaction,
    all_rows,
    on_connection,
    one_row,
    operation,
    retrying,
    run,
)
from onceflow.db import is_disconnect
from onceflow.errors import DatabaseUnavailable, InvalidRequest, LeaseLost, StoreError
from onceflow.ids import (
    RequestId,
    check_id,
    check_worker_class,
    new_claim_token,
)
from onceflow.metrics import record as metrics
from onceflow.models.requests import (
    Claim,
    ClaimRef,
    EnqueueResult,
    Fence,
    Heartbeat,
    NewRequest,
    Request,
    workspace_of,
)
from onceflow.models.scopes import WorkspaceScope, as_scope, scope_params
from onceflow.models.status import Status
from onceflow.payloads import JSON, encode_json
from onceflow.queue import sql
from onceflow.queue.batch import BatchOps, _seconds
from onceflow.queue.lock_outcomes import lock_outcomes_text
from onceflow.queue.reads import LIST_LIMIT_MAX
from onceflow.settings import Settings

log = logging.getLogger("onceflow.queue")

#: Where claim_next starts on a database split by workspace (see claim_next).
_next_shard = itertools.count()
_T = TypeVar("_T")

#: What every fenced write takes: a claim, or its bare ``(request_id, token)``.
Fenced = Claim | ClaimRef
#: A completion's outcome (``ClaimOps._succeed``): its statement's row — or, when an attempt
#: whose answer was lost is found landed, the whole request — and the follow-ups' results.
_Succeeded = tuple[Mapping[str, Any] | Request, builtins.list[EnqueueResult]]


class ClaimOps:
    """Claims and fenced writes of the layer-1 store (a mixin of both queue APIs)."""

    settings: Settings

    if TYPE_CHECKING:  # provided by EnqueueOps (queue/enqueue.py)

        def _enqueue_params(
            self, items: Sequence[NewRequest], now: datetime | None
        ) -> dict[str, Any]: ...

        def _insert_rows(
            self, params: dict[str, Any], strict: bool
        ) -> Steps[builtins.list[EnqueueResult]]: ...

    def _lazy(self) -> Steps[bool]:
        """Whether a claim or heartbeat may commit lazily here (see ``lazy_claim_commits``):
        only on a pooled connection, whose transaction is the statement's own."""
        if not self.settings.lazy_claim_commits:
            return False
        pooled: bool = yield Pooled()
        return pooled

    # Keyword options alike only by shape to other public signatures.
    @operation
    def claim(
        self,
        request_id: str,
        worker_id: str,
        *,
        lease_seconds: float | None = None,
        stage: str | None = None,
        max_runtime: float | None = None,
        workspace_id: str | None = None,
        now: datetime | None = None,
    ) -> Steps[Claim | None]:
        """Claim one request by id, or None if it is not claimable (running, finished, not due).

        ``stage`` (optional) claims it only if it is a request of that stage.
        ``max_runtime`` bounds the run: heartbeats never extend the lease past the
        claim time plus ``max_runtime`` (database clock), so a hung body loses its
        lease and the sweeper rescues the request. ``workspace_id``: the request's (its
        key with the id; what a wake-up carries); without it the row is found by id alone.
        """
        check_id("request_id", request_id)
        if workspace_id is not None:
            check_id("workspace_id", workspace_id)
        check_id("worker_id", worker_id)
        lease = self._lease(lease_seconds)
        runtime = _max_runtime(max_runtime)
        token = new_claim_token()
        params = {
            "request_id": request_id, "workspace_id": workspace_id, "worker_id": worker_id,
            "token": token, "lease_seconds": lease, "max_runtime": runtime, "stage": stage,
            "terms": None, "now": now,
            "lazy": (yield from self._lazy()),
        }  # fmt: skip
        try:
            row = yield from self._claim_once(params)
        except DatabaseUnavailable as exc:
            if not is_disconnect(exc):
                raise
            # The lost attempt may have committed our claim (same token): take it up, or
            # claim now. Never a second claim: the row can hold only one token.
            own = {"request_id": request_id, "workspace_id": workspace_id, "token": token}
            row = yield FetchOne(sql.OWN_CLAIM, own)
            if row is None:
                row = yield from self._claim_once(params)
            if row is None:
                # The lost attempt's commit may still have been in flight when OWN_CLAIM read:
                # the claim again then waited on the row lock that attempt held and, once it
                # committed, matched nothing. That wait means it has ended now: read again.
                row = yield FetchOne(sql.OWN_CLAIM, own)
        if row is None:
            return None
        request = Request.from_row(row)
        assert request.lease_expires_at is not None  # noqa: S101 - set by the claim itself
        claim = Claim(
            request, token, request.lease_expires_at, lease, runtime, row.get("trace_context")
        )
        metrics.claimed([claim], [bool(row.get("took_over"))])
        return claim

    # Same shape as _fail_once on purpose: each is the seam where a test loses one attempt.
    def _claim_once(self, params: dict[str, Any]) -> Steps[Any]:
        """One attempt at a claim by id: the claimed row, None if it is not claimable."""
        row = yield FetchOne(sql.CLAIM, params)
        return row

    @operation
    def claim_next(
        self,
        worker_classes: str | Sequence[str],
        worker_id: str,
        limit: int = 1,
        *,
        lease_seconds: float | None = None,
        max_runtime: float | None = None,
        workspaces: WorkspaceScope | Iterable[str] | None = None,
        stage_terms: Mapping[str, StageTerms] | None = None,
        now: datetime | None = None,
    ) -> Steps[builtins.list[Claim]]:
        """Claim up to ``limit`` due requests, reading one worker class at a time, in order.

        ``max_runtime`` as for :meth:`claim`. ``workspaces`` (a :class:`WorkspaceScope`,
        or patterns: ids, ``"prefix*"``; None or ``"*"``: every workspace) claims only
        requests of those workspaces: the filter is inside the claim's ``SKIP LOCKED``
        select, so another workspace's row is never locked. ``stage_terms`` gives the lease
        and run bound of each stage it names: a row of such a stage is claimed on its
        stage's terms, in the claim's own statement (the stage is known only once the row
        is picked); any other row on ``lease_seconds`` and ``max_runtime``. On a database
        split by workspace, each
        shard in turn; a shard that cannot be reached (:class:`DatabaseUnavailable`) is
        logged and skipped for this call while the others are claimed from: the error is
        raised only when every shard failed (on one database: as it always was).
        """
        runtime = _max_runtime(max_runtime)
        classes = [worker_classes] if isinstance(worker_classes, str) else list(worker_classes)
        if not classes:
            raise InvalidRequest("claim_next needs at least one worker class")
        for wc in classes:
            check_worker_class(wc)
        check_id("worker_id", worker_id)
        if not isinstance(limit, int) or not 1 <= limit <= LIST_LIMIT_MAX:
            raise InvalidRequest(f"limit must be an integer in [1, {LIST_LIMIT_MAX}]")
        lease = self._lease(lease_seconds)
        scope = as_scope(workspaces)
        terms = _checked_terms(stage_terms)
        claims: builtins.list[Claim] = []
        took_over: builtins.list[bool] = []
        lazy = yield from self._lazy()
        shards: int = yield ShardCount()
        # A database split by workspace: each shard in turn, from the next one each call,
        # so no shard's work waits behind another's (priority holds within a shard).
        start = next(_next_shard) % shards
        failed: set[int] = set()  # shards that could not be reached this call
        answered: set[int] = set()
        for wc, shard in ((w, (start + k) % shards) for w in classes for k in range(shards)):
            want = limit - len(claims)
            if want <= 0:
                break
            if shard in failed:
                continue
            tokens = [new_claim_token() for _ in range(want)]
            params = {
                "worker_class": wc, "worker_id": worker_id, "tokens": " ".join(tokens),
                "lease_seconds": lease, "max_runtime": runtime, "now": now, "lazy": lazy,
                "terms": _terms_json(terms),
            }  # fmt: skip
            if scope is not None:
                params.update(scope_params(scope))
            query = sql.claim_next_query(want, scope is not None)
            try:
                rows = yield OnShard(shard, all_rows(query, params))
            except DatabaseUnavailable as exc:
                # Not retried (a claim whose answer was lost is not safe to repeat: its
                # rows' leases lapse and the sweeper rescues them); the other shards go on.
                failed.add(shard)
                if not answered and len(failed) == shards:
                    raise  # nothing could be reached: the caller backs off
                log.warning("claim_next: shard %d skipped this time: %s", shard, exc)
                continue
            except Exception:
                # Not one to skip (a database that is not the shard the map names, a bug):
                # the claims this call already took go back now instead of waiting out
                # their leases (each lapse would count against the crash budget).
                if claims:
                    yield from self._hand_back(claims)
                raise
            answered.add(shard)
            for row in rows:
                request = Request.from_row(row)
                assert request.lease_expires_at is not None  # noqa: S101
                token = tokens[row["rn"] - 1]
                own = terms.get(request.stage)
                took = (lease, runtime) if own is None else (own.lease_seconds, own.max_runtime)
                claims.append(
                    Claim(request, token, request.lease_expires_at, *took, row["trace_context"])
                )
                took_over.append(bool(row["took_over"]))
        metrics.claimed(claims, took_over)
        return claims

    def _hand_back(self, claims: builtins.list[Claim]) -> Steps[None]:
        """Release ``claims`` (unstarted); a failure is logged: their leases lapse and the
        sweeper rescues them."""
        try:
            yield from BatchOps.release.steps(self, claims)
        except Exception:
            log.exception("claim_next: %d claim(s) not handed back; their leases lapse",
                          len(claims))  # fmt: skip

    # Keyword options alike only by shape to other public signatures.
    @operation
    def heartbeat(
        self,
        claim: Fenced,
        *,
        lease_seconds: float | None = None,
        now: datetime | None = None,
    ) -> Steps[Heartbeat]:
        """Extend the lease by the claim's lease; raises :class:`LeaseLost` if it is gone.

        Never past the claim's run deadline (``max_runtime``): once there, the lease
        is left to lapse. A :class:`ClaimRef` extends by the lease recorded on the row
        (the claim's, or the latest a heartbeat asked for); a :class:`Claim` by its own
        ``lease_seconds``, which the row keeps from then on; ``lease_seconds`` given here
        wins over both (and is kept). A lost connection is retried once, on a fresh
        connection.
        """
        _check_ref(claim)
        full = claim if isinstance(claim, Claim) else None
        lease = self._lease(lease_seconds) if lease_seconds is not None else None
        if lease is None and full is not None:
            lease = full.lease_seconds
        params = {
            **fence_key(claim), "token": claim.token,
            **fence_scopes(claim),
            "lease_seconds": lease,
            "deadline": full.run_deadline if full else None,
            "default_lease": self.settings.lease_seconds, "now": now,
            "lazy": (yield from self._lazy()),
        }  # fmt: skip
        # One immediate retry after a lost connection (extending a lease twice is harmless);
        # nothing longer: one thread beats for every stage of the process, and its next
        # tick is the next retry.
        row = yield from retrying(lambda: one_row(sql.HEARTBEAT, params))
        if row is None:
            metrics.zombie("heartbeat")
            raise LeaseLost(claim.request_id, "heartbeat rejected")
        return Heartbeat(row["lease_expires_at"], row["cancel_requested"])

    @operation
    def complete(
        self,
        claim: Fenced,
        result: JSON = None,
        *,
        then: Iterable[NewRequest] = (),
        now: datetime | None = None,
    ) -> Steps[Request]:
        """Mark the request succeeded (fenced by the token); :meth:`hand_off` with the results."""
        done = yield from ClaimOps.hand_off.steps(self, claim, result, then=then, now=now)
        return done[0]

    @operation
    def hand_off(
        self,
        claim: Fenced,
        result: JSON = None,
        *,
        then: Iterable[NewRequest] = (),
        now: datetime | None = None,
        locks: Sequence[Mapping[str, Any]] | None = None,
    ) -> Steps[tuple[Request, builtins.list[EnqueueResult]]]:
        """Mark the request succeeded with ``result`` (fenced by the token).

        ``then`` enqueues follow-up requests (the next stage) in the same
        transaction: the hand-off lands entirely or not at all. A database blip
        (a lost connection, a restart) is retried on a fresh connection while the
        lease may still hold; if an attempt whose answer was lost had committed
        (this call's, or a caller's repeating a call whose answer it lost), the
        retry recognises its own completion by the token instead of reporting
        ``LeaseLost`` (its hand-offs are then left for the sweeper's next wake-up).
        Returns the completed request and the follow-ups' results; :meth:`finish` is
        the same write for a caller that keeps nothing of the row. ``locks``: the run's
        compute-lock outcomes, kept in the request's history (:func:`lock_outcomes_text`).
        """
        # A Claim holds the claimed row: the completion reads back only what may differ.
        held = claim.request if isinstance(claim, Claim) else None
        statement = sql.COMPLETE if held is None else sql.COMPLETE_CHANGED
        row, followed = yield from self._succeed(claim, result, then, now, statement, locks)
        if isinstance(row, Request):  # found landed after a lost answer: read whole
            done = row
        else:
            done = Request.from_row(row) if held is None else held.after_run(row)
        metrics.finished(done)
        metrics.enqueued(followed)  # once, for the attempt that committed
        return done, followed

    @operation
    def finish(
        self,
        claim: Fenced,
        result: JSON = None,
        *,
        then: Iterable[NewRequest] = (),
        now: datetime | None = None,
        locks: Sequence[Mapping[str, Any]] | None = None,
    ) -> Steps[builtins.list[EnqueueResult]]:
        """:meth:`hand_off`, returning only the follow-ups' results: the same fenced write,
        retries and recognition of a landed attempt, but the completed row is not read
        back (what a Celery stage and a worker loop keep of it is nothing)."""
        row, followed = yield from self._succeed(claim, result, then, now, sql.FINISH, locks)
        if isinstance(row, Request):
            metrics.finished(row)
        else:
            metrics.run_ended(
                row["worker_class"], row["stage"], "succeeded", row["claimed_at"],
                row["updated_at"],
            )  # fmt: skip
        metrics.enqueued(followed)
        return followed

    def _succeed(
        self,
        claim: Fenced,
        result: JSON,
        then: Iterable[NewRequest],
        now: datetime | None,
        statement: Query,
        locks: Sequence[Mapping[str, Any]] | None = None,
    ) -> Steps[_Succeeded]:
        """The steps of :meth:`hand_off` and :meth:`finish`: ``statement``'s row (or, when
        an attempt whose answer was lost is found landed, the whole :class:`Request`) and
        the follow-ups' results."""
        _check_ref(claim)
        text = encode_json(
            result,
            self.settings.payload_limit_bytes,
            what="result",
            max_depth=self.settings.max_payload_depth,
        )
        follow_ups = list(then)
        # Ids (random ones too) are minted once, so every attempt sends the same rows.
        follow_params = self._enqueue_params(follow_ups, now) if follow_ups else None
        if follow_params is not None:
            _same_workspace(workspace_of(claim), follow_params["workspace_ids"])
        params = {
            **fence_key(claim), "token": claim.token, "result": text, "now": now,
            **fence_scopes(claim), "locks": lock_outcomes_text(locks),
            # The follow-ups' ids, in the run's history (a hand-off).
            "handed_to": None if follow_params is None else follow_params["request_ids"],
        }  # fmt: skip

        def attempt() -> Steps[_Succeeded]:
            row, followed = yield from self._complete_once(statement, params, follow_params)
            if row is None:
                raise LeaseLost(claim.request_id, "completion rejected")
            return row, followed

        def landed() -> Steps[_Succeeded | None]:
            current = yield from _landed(claim, (Status.SUCCEEDED,))
            if current is None:
                return None
            if follow_params is None:
                return current, []
            ids = follow_params["request_ids"]
            keys = {"request_ids": ids, "workspace_ids": follow_params["workspace_ids"]}
            # Our lost attempt created them, but their wake-ups were never sent.
            yield Execute(sql.MARK_UNDISPATCHED_MANY, keys)
            rows = yield FetchAll(sql.ENQUEUE_LOOKUP, keys)
            found = {r["request_id"]: r for r in rows}
            # Created by the lost attempt: in its transaction, whose time (now(): the
            # transaction's start) is both the completion's finished_at and their created_at.
            # A follow-up that existed before (another path enqueued it) was not created here.
            ours = {rid for rid, r in found.items() if r["created_at"] == current.finished_at}
            followed = [
                EnqueueResult(
                    RequestId(rid),
                    rid in ours,
                    Status(found[rid]["status"]),
                    found[rid]["input_hash"] != digest,
                    stage=stage,
                    worker_class=wc,
                    workspace_id=ws,
                )
                for rid, ws, digest, stage, wc in zip(
                    ids,
                    follow_params["workspace_ids"],
                    follow_params["input_hashes"],
                    follow_params["stages"],
                    follow_params["worker_classes"],
                    strict=True,
                )
                if rid in found
            ]
            return current, followed

        try:
            return (yield from self._fenced(claim, attempt, landed))
        except LeaseLost:
            metrics.zombie("hand_off" if follow_ups else "complete")
            raise

    @operation
    def claim_parent(self, claim: Fenced) -> Steps[Request | None]:
        """The claimed request, to name a hand-off's follow-ups after; None if not this claim's.

        The row while ``claim`` holds it (token, live lease: database clock), or once
        ``claim``'s own run completed it: a hand-off repeated after its answer was lost
        reads its parent as the first attempt did, and :meth:`hand_off` then recognises
        its landed write. One statement, within the reference's worker classes; a read,
        not a fence (the hand-off fences in its own statement). A lost connection is
        retried once.
        """
        _check_ref(claim)
        params = {
            **fence_key(claim), "token": claim.token, "now": None,
            **fence_scopes(claim),
        }  # fmt: skip
        row = yield from retrying(lambda: one_row(sql.CLAIM_PARENT, params))
        return None if row is None else Request.from_row(row)

    def _complete_once(
        self, statement: Query, params: dict[str, Any], follow_params: dict[str, Any] | None
    ) -> Steps[tuple[Any, builtins.list[EnqueueResult]]]:
        """One attempt at a completion: the updated row (None if fenced off) and follow-ups."""
        if follow_params is None:
            row = yield FetchOne(statement, params)  # one statement, one round trip
            return row, []
        out: tuple[Any, builtins.list[EnqueueResult]] = yield Transaction(
            self._complete_and_enqueue(statement, params, follow_params)
        )
        return out

    def _complete_and_enqueue(
        self, statement: Query, params: dict[str, Any], follow_params: dict[str, Any]
    ) -> Steps[tuple[Any, builtins.list[EnqueueResult]]]:
        row = yield FetchOne(statement, params)
        if row is None:
            return None, []
        # A reference without its workspace: known only now (raising rolls the completion back).
        _same_workspace(row["workspace_id"], follow_params["workspace_ids"])
        followed = yield from self._insert_rows(follow_params, False)
        return row, followed

    @operation
    def fail(
        self,
        claim: Fenced,
        error: JSON,
        *,
        retryable: bool = True,
        retry_in: float | None = None,
        count_attempt: bool = True,
        now: datetime | None = None,
        locks: Sequence[Mapping[str, Any]] | None = None,
    ) -> Steps[Request]:
        """Record a failed run (fenced): queued again after a backoff, or dead; error kept.

        The backoff (unless ``retry_in`` is given) is :meth:`backoff` of the row's attempt
        number, computed in the fenced statement. ``count_attempt=False`` (a budget wait:
        the body's work was not tried) gives the run's attempt back when the row is queued
        again, so it is queued again even at ``max_attempts``. Retried on a fresh
        connection through a database blip, like :meth:`hand_off`.
        """
        _check_ref(claim)
        for name, flag in (("retryable", retryable), ("count_attempt", count_attempt)):
            if not isinstance(flag, bool):  # as fail_many: "no" is not a False
                raise InvalidRequest(f"{name} must be a bool")
        text = _error_text(self.settings, error)
        delay = None if retry_in is None else _seconds("retry_in", retry_in)
        params = {
            **fence_key(claim), "token": claim.token, "error": text,
            **fence_scopes(claim),
            "retryable": retryable, "uncounted": not count_attempt, "delay": delay, "now": now,
            "backoff_base": float(self.settings.backoff_base_seconds),
            "backoff_max": float(self.settings.backoff_max_seconds),
            "notify": self.settings.notify, "locks": lock_outcomes_text(locks),
        }  # fmt: skip

        def attempt() -> Steps[Request]:
            row = yield from self._fail_once(params)
            if row is None:
                raise LeaseLost(claim.request_id, "failure report rejected")
            return Request.from_row(row)

        def landed() -> Steps[Request | None]:
            return (yield from _landed(claim, (Status.QUEUED, Status.DEAD, Status.CANCELLED)))

        try:
            row = yield from self._fenced(claim, attempt, landed)
        except LeaseLost:
            metrics.zombie("fail")
            raise
        metrics.finished(row)
        return row

    # Same shape as _claim_once on purpose: each is the seam where a test loses one attempt.
    def _fail_once(self, params: dict[str, Any]) -> Steps[Any]:
        """One attempt at a failure report: the updated row, None if fenced off."""
        row = yield FetchOne(sql.FAIL, params)
        return row

    @operation
    def fenced_retry(
        self,
        claim: Fenced,
        attempt: Callable[[], _T | Steps[_T]],
        landed: Callable[[], _T | Steps[_T | None] | None] = lambda: None,
        *,
        budget: float | None = None,
    ) -> Steps[_T]:
        """Run a fenced write, retrying database blips while the claim's lease may hold.

        ``attempt()`` and ``landed()`` return their value, or steps that make it (a
        generator, run on this queue's connector: what an :class:`~onceflow.AsyncQueue`
        needs — a callable doing blocking I/O belongs only to the sync
        :class:`~onceflow.Queue`). See :meth:`_fenced` for the rule.
        """
        out: _T = yield from self._fenced(
            claim, lambda: _as_steps(attempt()), lambda: _as_steps(landed()), budget
        )
        return out

    def _fenced(
        self,
        claim: Fenced,
        attempt: Callable[[], Steps[_T]],
        landed: Callable[[], Steps[_T | None]],
        budget: float | None = None,
    ) -> Steps[_T]:
        """A fenced write's steps, retried through database blips while the lease may hold.

        Fenced writes are safe to repeat: the token decides, on the database clock.
        The retry ``budget`` (the claim's lease by default — a bare ref's: the queue's
        default lease —, on this process's monotonic clock) only bounds how long we keep
        trying; it never decides whether the lease holds. A ``LeaseLost`` may mean that
        an earlier attempt — this call's or a caller's, whose answer was lost — committed:
        ``landed()`` recognises our own committed write (it is asked only on that path,
        never on success).
        """
        if budget is None:
            budget = (
                claim.lease_seconds if isinstance(claim, Claim) else self.settings.lease_seconds
            )
        deadline = time.monotonic() + budget
        delay = 0.05
        while True:
            try:
                return (yield from attempt())
            except LeaseLost:
                found = yield from landed()
                if found is not None:
                    return found
                raise
            except (DatabaseUnavailable, StoreError) as exc:
                # A lost connection, and what is not an answer either: a failover's
                # read-only error, a lock or pool timeout. The one retry loop of the write.
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "request %s: database blip in a fenced write (%s); retrying",
                    claim.request_id,
                    exc,
                )
                yield Sleep(delay)
                delay = min(1.0, delay * 2)

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt``: exponential, capped, with equal jitter.

        (``fail`` computes the same in its statement, from the row's attempt number.)
        """
        base = self.settings.backoff_base_seconds * 2 ** max(0, attempt - 1)
        delay = min(self.settings.backoff_max_seconds, base)
        return float(delay / 2 + random.uniform(0, delay / 2))

    @staticmethod
    def fence_check(
        raw: psycopg.Connection[Any], claim: Fenced, *, now: datetime | None = None
    ) -> None:
        """Inside the caller's transaction: raise :class:`LeaseLost` unless the claim is live.

        Holds a share lock on the row until that transaction ends, so the lease
        cannot be rescued between the check and the caller's commit. As steps:
        :func:`fence_steps`.
        """
        run(on_connection(raw), fence_steps(claim, now))

    def lease_for(self, lease_seconds: float | None) -> float:
        """The lease a claim asking for ``lease_seconds`` gets (None: the settings' default);
        :class:`InvalidRequest` for a value that is not a positive number of seconds."""
        return self._lease(lease_seconds)

    def _lease(self, lease_seconds: float | None) -> float:
        if lease_seconds is None:
            return self.settings.lease_seconds
        lease = _seconds("lease_seconds", lease_seconds)
        if lease <= 0:
            raise InvalidRequest("lease_seconds must be positive")
        return lease


def fence_steps(claim: Fence, now: datetime | None = None, *, zombie: bool = True) -> Steps[str]:
    """The fence check as steps, for a :class:`~onceflow.connector.Transaction` body.

    Raises :class:`LeaseLost` unless ``claim`` (a :class:`Claim`, a :class:`ClaimRef`, any
    :class:`~onceflow.models.requests.Fence`)
    runs under a live lease (database clock), and holds a share lock on the row until the
    transaction ends, so the lease cannot be rescued before the caller's commit::

        def _apply(self, ...):                    # the body of a Transaction
            yield from fence_steps(fence)
            ...                                   # writes that must not outlive the claim

    Answers the fenced request's workspace.
    """
    row = yield from fenced_row_steps(claim, now, zombie=zombie)
    return row["workspace_id"]


def fenced_row_steps(
    claim: Fence, now: datetime | None = None, *, zombie: bool = True
) -> Steps[dict[str, str]]:
    """:func:`fence_steps`, answering the fenced request's ids: ``request_id``,
    ``workspace_id``, ``job_id`` and ``stage`` (what a stage's sub-doc scope names)."""
    params = {
        **fence_key(claim), "token": claim.token, "now": now,
        **fence_scopes(claim),
    }  # fmt: skip
    row = yield FetchOne(sql.FENCE_CHECK, params)
    if row is None:
        if zombie:  # else the caller counts it (the op log: unless the write was a replay)
            metrics.zombie("op")
        raise LeaseLost(claim.request_id, "fenced write rejected")
    # The fenced request's ids (what a sub-doc scope is rendered from).
    return {name: str(row[name]) for name in ("request_id", "workspace_id", "job_id", "stage")}


def _landed(claim: Fenced, statuses: tuple[Status, ...]) -> Steps[Request | None]:
    """The row, if this claim's own write (its token's run) ended it in one of ``statuses``.

    Read from ``ended_run`` (a digest of the token ending the run): a later claim, a
    requeue, or the sweeper's rescue of a run that never ended leaves another value.
    """
    params = {
        **fence_key(claim), "token": claim.token,
        "statuses": [s.value for s in statuses], **fence_scopes(claim),
    }  # fmt: skip
    row = yield FetchOne(sql.LANDED, params)
    return None if row is None else Request.from_row(row)


def fence_key(claim: Any) -> dict[str, str | None]:
    """The fenced request's key for a statement: its id and workspace (None when the fence
    does not carry it: the statement then finds the row by its id alone)."""
    return {"request_id": claim.request_id, "workspace_id": workspace_of(claim)}


def fence_scope(claim: Any) -> list[str] | None:
    """The worker classes a reference is scoped to (None: any), for the fence's SQL."""
    scope = getattr(claim, "worker_classes", None)
    return None if scope is None else [str(c) for c in scope]


def fence_scopes(claim: Any) -> dict[str, list[str] | None]:
    """A reference's scope for the fence's SQL: its worker classes (``worker_classes``)
    and workspaces (``ws_exact``, ``ws_prefixes``); None for any."""
    workspaces = getattr(claim, "workspaces", None)
    if workspaces is not None and not isinstance(workspaces, WorkspaceScope):
        raise InvalidRequest("a reference's workspaces are a WorkspaceScope (or None)")
    return {"worker_classes": fence_scope(claim), **scope_params(workspaces)}


def _check_ref(claim: Any) -> None:
    if not isinstance(claim, Claim | ClaimRef):
        raise InvalidRequest(f"expected a Claim or a ClaimRef, got {type(claim).__name__}")
    check_id("request_id", claim.request_id)
    if isinstance(claim, ClaimRef) and claim.workspace_id is not None:
        check_id("workspace_id", claim.workspace_id)
    if not isinstance(claim.token, str) or not claim.token:
        raise InvalidRequest("a claim token is a non-empty string")


def _same_workspace(parent: str | None, workspaces: Iterable[str]) -> None:
    """A hand-off's follow-ups belong to the parent's workspace: the completion and their
    enqueue are one transaction, which must stay within one workspace (one shard when the
    database is split by workspace). Another workspace's work is a separate enqueue."""
    if parent is None:
        return
    for ws in workspaces:
        if ws != parent:
            raise InvalidRequest(
                f"a hand-off's follow-ups must be in the request's workspace {parent!r}, "
                f"not {ws!r}: enqueue work of another workspace separately"
            )


def _as_steps(value: Any) -> Steps[Any]:
    """``value``'s steps if it is a generator of steps, else ``value`` itself."""
    if inspect.isgenerator(value):
        return (yield from value)
    return value


def _error_text(settings: Settings, error: Any) -> str:
    """A failure's error as stored JSON (an exception becomes its type and message)."""
    if isinstance(error, BaseException):
        error = {"type": type(error).__name__, "message": str(error)}
    text = encode_json(
        error, settings.payload_limit_bytes, what="error", max_depth=settings.max_payload_depth
    )
    return text


@dataclass(frozen=True, slots=True)
class StageTerms:
    """The terms a claim of one stage's rows gets: its lease and run bound (None: none)."""

    lease_seconds: float
    max_runtime: float | None = None


def _checked_terms(terms: Mapping[str, StageTerms] | None) -> dict[str, StageTerms]:
    """``terms`` checked as the claim's own lease and run bound are."""
    out: dict[str, StageTerms] = {}
    for stage, term in (terms or {}).items():
        if not isinstance(stage, str) or not isinstance(term, StageTerms):
            raise InvalidRequest("stage_terms maps stage names to StageTerms")
        lease = _seconds("lease_seconds", term.lease_seconds)
        if lease <= 0:
            raise InvalidRequest("lease_seconds must be positive")
        out[stage] = StageTerms(lease, _max_runtime(term.max_runtime))
    return out


def _terms_json(terms: Mapping[str, StageTerms]) -> str | None:
    """The ``:terms`` parameter of CLAIM_NEXT: ``{stage: [lease, max_runtime]}``, or NULL."""
    if not terms:
        return None
    return json.dumps({name: [t.lease_seconds, t.max_runtime] for name, t in terms.items()})


def _max_runtime(value: float | None) -> float | None:
    if value is None:
        return None
    runtime = _seconds("max_runtime", value)
    if runtime <= 0:
        raise InvalidRequest("max_runtime must be positive")
    return runtime
