# About 400 lines: claims and every fenced write under them share the fence and retry rules.
"""Claims and the fenced writes under them: claim, heartbeat, complete, hand off, fail.

Every write checks the fence (token + live lease, database clock). Mixed into
:class:`~onceflow.queue.Queue`.
"""

from __future__ import annotations

import builtins
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from sqlalchemy import Engine

from onceflow.db import (
    fetch_all,
    fetch_one,
    is_disconnect,
    raw_connection,
    retry_disconnect,
)
from onceflow.errors import DatabaseUnavailable, InvalidRequest, LeaseLost
from onceflow.ids import (
    RequestId,
    check_id,
    check_worker_class,
    new_claim_token,
)
from onceflow.metrics import record as metrics
from onceflow.models.requests import (
    Claim,
    EnqueueResult,
    Heartbeat,
    NewRequest,
    Request,
)
from onceflow.models.status import Status
from onceflow.payloads import JSON, encode_payload
from onceflow.queue import sql
from onceflow.queue.batch import _seconds
from onceflow.queue.reads import LIST_LIMIT_MAX
from onceflow.settings import Settings

log = logging.getLogger("onceflow.queue")
_T = TypeVar("_T")


class ClaimOps:
    """Claims and fenced writes of the layer-1 store (a mixin of :class:`~onceflow.queue.Queue`)."""

    engine: Engine
    settings: Settings

    if TYPE_CHECKING:  # provided by Queue (queue/reads.py, queue/enqueue.py, queue/batch.py)

        def _read_one(self, query: str, params: dict[str, Any]) -> Any: ...

        def _enqueue_params(
            self, items: Sequence[NewRequest], now: datetime | None
        ) -> dict[str, Any]: ...

        def _enqueue_raw(
            self, raw: psycopg.Connection[Any], params: dict[str, Any], strict: bool
        ) -> list[EnqueueResult]: ...

        def _error_text(self, error: Any) -> str: ...

    def claim(
        self,
        request_id: str,
        worker_id: str,
        *,
        lease_seconds: float | None = None,
        stage: str | None = None,
        max_runtime: float | None = None,
        now: datetime | None = None,
    ) -> Claim | None:
        """Claim one request by id, or None if it is not claimable (running, finished, not due).

        ``stage`` (optional) claims it only if it is a request of that stage.
        ``max_runtime`` bounds the run: heartbeats never extend the lease past the
        claim time plus ``max_runtime`` (database clock), so a hung body loses its
        lease and the sweeper rescues the request.
        """
        check_id("request_id", request_id)
        check_id("worker_id", worker_id)
        lease = self._lease(lease_seconds)
        runtime = _max_runtime(max_runtime)
        token = new_claim_token()
        params = {
            "request_id": request_id, "worker_id": worker_id, "token": token,
            "lease_seconds": lease, "stage": stage, "now": now,
        }  # fmt: skip
        try:
            row = self._read_one(sql.Q_CLAIM, params)
        except DatabaseUnavailable as exc:
            if not is_disconnect(exc):
                raise
            # The lost attempt may have committed our claim (same token): take it up, or
            # claim now. Never a second claim: the row can hold only one token.
            own = {"request_id": request_id, "token": token}
            row = self._read_one(sql.Q_OWN_CLAIM, own) or self._read_one(sql.Q_CLAIM, params)
        if row is None:
            return None
        request = Request.from_row(row)
        assert request.lease_expires_at is not None  # noqa: S101 - set by the claim itself
        claim = Claim(request, token, request.lease_expires_at, lease, runtime)
        metrics.claimed([claim], [bool(row.get("took_over"))])
        return claim

    def claim_next(
        self,
        worker_classes: str | Sequence[str],
        worker_id: str,
        limit: int = 1,
        *,
        lease_seconds: float | None = None,
        max_runtime: float | None = None,
        now: datetime | None = None,
    ) -> list[Claim]:
        """Claim up to ``limit`` due requests, reading one worker class at a time, in order.

        ``max_runtime`` as for :meth:`claim`.
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
        claims: list[Claim] = []
        took_over: list[bool] = []
        with raw_connection(self.engine) as raw:
            for wc in classes:
                want = limit - len(claims)
                if want <= 0:
                    break
                tokens = [new_claim_token() for _ in range(want)]
                params = {
                    "worker_class": wc, "worker_id": worker_id,
                    "tokens": tokens, "lease_seconds": lease, "now": now,
                }  # fmt: skip
                rows = fetch_all(raw, sql.claim_next_sql(want), params)
                for row in rows:
                    request = Request.from_row(row)
                    assert request.lease_expires_at is not None  # noqa: S101
                    token = tokens[row["rn"] - 1]
                    claims.append(Claim(request, token, request.lease_expires_at, lease, runtime))
                    took_over.append(bool(row["took_over"]))
        metrics.claimed(claims, took_over)
        return claims

    def heartbeat(self, claim: Claim, *, now: datetime | None = None) -> Heartbeat:
        """Extend the lease by the claim's lease; raises :class:`LeaseLost` if it is gone.

        Never past the claim's run deadline (``max_runtime``): once there, the lease
        is left to lapse. A lost connection is retried once, on a fresh connection.
        """
        params = {
            "request_id": claim.request_id, "token": claim.token,
            "lease_seconds": claim.lease_seconds, "deadline": claim.run_deadline, "now": now,
        }  # fmt: skip

        # One immediate retry after a lost connection (extending a lease twice is harmless);
        # nothing longer: one thread beats for every stage of the process, and its next
        # tick is the next retry.
        row = retry_disconnect(lambda: self._read_one(sql.Q_HEARTBEAT, params))
        if row is None:
            metrics.zombie("heartbeat")
            raise LeaseLost(claim.request_id, "heartbeat rejected")
        return Heartbeat(row["lease_expires_at"], row["cancel_requested"])

    def complete(
        self,
        claim: Claim,
        result: JSON = None,
        *,
        then: Iterable[NewRequest] = (),
        now: datetime | None = None,
    ) -> Request:
        """Mark the request succeeded (fenced by the token); :meth:`hand_off` with the results."""
        return self.hand_off(claim, result, then=then, now=now)[0]

    def hand_off(
        self,
        claim: Claim,
        result: JSON = None,
        *,
        then: Iterable[NewRequest] = (),
        now: datetime | None = None,
    ) -> tuple[Request, builtins.list[EnqueueResult]]:
        """Mark the request succeeded with ``result`` (fenced by the token).

        ``then`` enqueues follow-up requests (the next stage) in the same
        transaction: the hand-off lands entirely or not at all. A database blip
        (a lost connection, a restart) is retried on a fresh connection while the
        lease may still hold; if an attempt whose answer was lost had committed,
        the retry recognises its own completion instead of reporting ``LeaseLost``
        (its hand-offs are then left for the sweeper's next wake-up).
        """
        text, _ = encode_payload(
            result,
            self.settings.payload_limit_bytes,
            what="result",
            max_depth=self.settings.max_payload_depth,
        )
        follow_ups = list(then)
        # Ids (random ones too) are minted once, so every attempt sends the same rows.
        follow_params = self._enqueue_params(follow_ups, now) if follow_ups else None
        params = {"request_id": claim.request_id, "token": claim.token, "result": text, "now": now}

        def attempt() -> tuple[Request, builtins.list[EnqueueResult]]:
            followed: builtins.list[EnqueueResult] = []
            with raw_connection(self.engine) as raw:
                if follow_params is None:
                    row = fetch_one(raw, sql.Q_COMPLETE, params)  # one statement, one round trip
                else:
                    with raw.transaction():
                        row = fetch_one(raw, sql.Q_COMPLETE, params)
                        if row is not None:
                            followed = self._enqueue_raw(raw, follow_params, strict=False)
            if row is None:
                raise LeaseLost(claim.request_id, "completion rejected")
            return Request.from_row(row), followed

        def landed() -> tuple[Request, builtins.list[EnqueueResult]] | None:
            current = self._landed(claim, (Status.SUCCEEDED,))
            if current is None:
                return None
            followed: builtins.list[EnqueueResult] = []
            if follow_params is not None:
                ids = follow_params["request_ids"]
                with raw_connection(self.engine) as raw:
                    # Our lost attempt created them, but their wake-ups were never sent.
                    raw.execute(sql.Q_MARK_UNDISPATCHED_MANY, {"request_ids": ids})
                    rows = fetch_all(raw, sql.Q_ENQUEUE_LOOKUP, {"request_ids": ids})
                found = {r["request_id"]: r for r in rows}
                followed = [
                    EnqueueResult(
                        RequestId(rid),
                        False,
                        Status(found[rid]["status"]),
                        found[rid]["input_hash"] != digest,
                        stage=stage,
                        worker_class=wc,
                    )
                    for rid, digest, stage, wc in zip(
                        ids,
                        follow_params["input_hashes"],
                        follow_params["stages"],
                        follow_params["worker_classes"],
                        strict=True,
                    )
                    if rid in found
                ]
            return current, followed

        try:
            done = self.fenced_retry(claim, attempt, landed)
        except LeaseLost:
            metrics.zombie("hand_off" if follow_ups else "complete")
            raise
        metrics.finished(claim, done[0])
        metrics.enqueued(done[1])  # once, for the attempt that committed
        return done

    def fail(
        self,
        claim: Claim,
        error: JSON,
        *,
        retryable: bool = True,
        retry_in: float | None = None,
        now: datetime | None = None,
    ) -> Request:
        """Record a failed run (fenced): queued again after a backoff, or dead; error kept.

        Retried on a fresh connection through a database blip, like :meth:`hand_off`.
        """
        text = self._error_text(error)
        delay = self.backoff(claim.attempt) if retry_in is None else _seconds("retry_in", retry_in)
        params = {
            "request_id": claim.request_id, "token": claim.token, "error": text,
            "retryable": bool(retryable), "delay": delay, "now": now,
            "notify": self.settings.notify,
        }  # fmt: skip

        def attempt() -> Request:
            with raw_connection(self.engine) as raw:
                row = fetch_one(raw, sql.Q_FAIL, params)
            if row is None:
                raise LeaseLost(claim.request_id, "failure report rejected")
            return Request.from_row(row)

        def landed() -> Request | None:
            return self._landed(claim, (Status.QUEUED, Status.DEAD, Status.CANCELLED))

        try:
            row = self.fenced_retry(claim, attempt, landed)
        except LeaseLost:
            metrics.zombie("fail")
            raise
        metrics.finished(claim, row)
        return row

    def fenced_retry(
        self,
        claim: Claim,
        attempt: Callable[[], _T],
        landed: Callable[[], _T | None] = lambda: None,
        *,
        budget: float | None = None,
    ) -> _T:
        """Run a fenced write, retrying database blips while the claim's lease may hold.

        Fenced writes are safe to repeat: the token decides, on the database clock.
        The retry ``budget`` (one lease by default, on this process's monotonic
        clock) only bounds how long we keep trying; it never decides whether the
        lease holds. A ``LeaseLost`` may mean that an earlier attempt — this call's or
        a caller's, whose answer was lost — committed: ``landed()`` recognises our own
        committed write (it is asked only on that path, never on success).
        """
        deadline = time.monotonic() + (claim.lease_seconds if budget is None else budget)
        delay = 0.05
        while True:
            try:
                return attempt()
            except LeaseLost:
                found = landed()
                if found is not None:
                    return found
                raise
            except DatabaseUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "request %s: database blip in a fenced write (%s); retrying",
                    claim.request_id,
                    exc,
                )
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _landed(self, claim: Claim, statuses: tuple[Status, ...]) -> Request | None:
        """The row, if this claim's own write moved it to one of ``statuses``.

        A later claim would have bumped ``attempts`` (and named another claimant); a
        sweeper's rescue keeps both but counts a crash.
        """
        with raw_connection(self.engine) as raw:
            row = fetch_one(raw, sql.Q_GET, {"request_id": claim.request_id})
        if row is None:
            return None
        current = Request.from_row(row)
        mine = (
            current.claimed_by == claim.request.claimed_by
            and current.attempts == claim.attempt
            and current.crash_attempts == claim.request.crash_attempts
            and current.status in statuses
        )
        return current if mine else None

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt``: exponential, capped, with equal jitter."""
        base = self.settings.backoff_base_seconds * 2 ** max(0, attempt - 1)
        delay = min(self.settings.backoff_max_seconds, base)
        return float(delay / 2 + random.uniform(0, delay / 2))

    @staticmethod
    def fence_check(
        raw: psycopg.Connection[Any], claim: Claim, *, now: datetime | None = None
    ) -> None:
        """Inside the caller's transaction: raise :class:`LeaseLost` unless the claim is live.

        Holds a share lock on the row until that transaction ends, so the lease
        cannot be rescued between the check and the caller's commit.
        """
        params = {"request_id": claim.request_id, "token": claim.token, "now": now}
        if fetch_one(raw, sql.Q_FENCE_CHECK, params) is None:
            metrics.zombie("op")
            raise LeaseLost(claim.request_id, "fenced write rejected")

    def _lease(self, lease_seconds: float | None) -> float:
        if lease_seconds is None:
            return self.settings.lease_seconds
        lease = _seconds("lease_seconds", lease_seconds)
        if lease <= 0:
            raise InvalidRequest("lease_seconds must be positive")
        return lease


def _max_runtime(value: float | None) -> float | None:
    if value is None:
        return None
    runtime = _seconds("max_runtime", value)
    if runtime <= 0:
        raise InvalidRequest("max_runtime must be positive")
    return runtime
