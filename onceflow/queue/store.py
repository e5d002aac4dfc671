"""The layer-1 store: named domain operations on ``workspace_process_requests``.

A small typed seam (River's driver interface, PgQueuer's repository port): each
operation takes typed parameters and returns rows as :class:`Request` /
:class:`Claim` values. The SQL lives in :mod:`onceflow.queue.sql`.
"""

from __future__ import annotations

import builtins
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, bindparam, select

from onceflow.db import (
    fetch_all,
    fetch_one,
    get_engine,
    is_disconnect,
    raw_connection,
    retry_disconnect,
    translate_errors,
)
from onceflow.errors import (
    DatabaseUnavailable,
    InputMismatch,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    NotFound,
)
from onceflow.ids import (
    BRANCH_PATH_MAX,
    RequestId,
    check_id,
    check_worker_class,
    new_claim_token,
    random_request_id,
    request_id_for,
)
from onceflow.metrics import record as metrics
from onceflow.models.requests import (
    Claim,
    EnqueueResult,
    Heartbeat,
    NewRequest,
    Request,
)
from onceflow.models.status import Status, parse_status
from onceflow.models.tables import workspace_process_requests as wpr
from onceflow.payloads import JSON, canonical_json, encode_payload
from onceflow.queue import sql
from onceflow.queue.batch import BatchOps, _seconds
from onceflow.queue.notify import Waiter
from onceflow.queue.sweep import Sweeper
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.queue")
_T = TypeVar("_T")

LIST_LIMIT_MAX = 1000
BATCH_MAX = 10_000


#: Turns a request into the one its stage's declaration makes (a Flow's ``resolve``).
Resolver = Callable[[NewRequest], NewRequest]


class Queue(Sweeper, BatchOps, Waiter):
    """The durable stage queue. Thread-safe; build one per process and share it.

    ``resolver`` (set by the :class:`~onceflow.tasks.Flow` that owns the queue)
    completes every request enqueued through it — including hand-offs — from its
    stage's declaration: worker class, dedupe, priority, attempts, validated input.
    An undeclared stage or an input that does not fit raises before anything is
    written. Without one, unset fields mean worker class ``"default"``, dedupe, priority 0.
    """

    def __init__(
        self,
        engine: Engine | str | None = None,
        settings: Settings | None = None,
        *,
        resolver: Resolver | None = None,
    ):
        self.settings = settings or get_settings()
        if engine is None or isinstance(engine, str):
            engine = get_engine(engine or self.settings.database_url)
        self.engine = engine
        self.resolver = resolver

    # ------------------------------------------------------------------ enqueue

    def enqueue(
        self,
        stage: str,
        workspace_id: str,
        job_id: str,
        branch_path: str = "",
        input: JSON = None,
        *,
        worker_class: str | None = None,
        dedupe: bool | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        max_crash_attempts: int | None = None,
        run_after_seconds: float = 0.0,
        request_id: str | None = None,
        strict: bool = False,
        now: datetime | None = None,
    ) -> EnqueueResult:
        """Enqueue one request; a duplicate collapses onto the existing row (``created=False``)."""
        item = NewRequest(
            workspace_id=workspace_id,
            job_id=job_id,
            stage=stage,
            branch_path=branch_path,
            input={} if input is None else input,
            worker_class=worker_class,
            dedupe=dedupe,
            priority=priority,
            max_attempts=max_attempts,
            max_crash_attempts=max_crash_attempts,
            run_after_seconds=run_after_seconds,
            request_id=request_id,
        )
        return self.enqueue_many([item], strict=strict, now=now)[0]

    def enqueue_many(
        self,
        items: Sequence[NewRequest],
        *,
        strict: bool = False,
        now: datetime | None = None,
        connection: Connection | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue a batch in one round trip; results in the order of ``items``.

        ``INSERT … ON CONFLICT DO NOTHING``: the caller that inserted a row gets
        ``created=True``, every other caller the same id with ``created=False``.
        A row that exists with a different input is flagged ``input_mismatch``;
        with ``strict=True`` that raises :class:`InputMismatch` and nothing of
        the batch is written. ``connection`` runs it inside the caller's
        transaction; its enqueues are counted in ``onceflow_requests_enqueued_total``
        when that transaction commits (SQLAlchemy's ``commit`` event on the
        connection), never if it rolls back.
        """
        if not items:
            return []
        if len(items) > BATCH_MAX:
            raise InvalidRequest(f"a batch holds at most {BATCH_MAX} requests, got {len(items)}")
        params = self._enqueue_params(items, now)  # ids (random ones too) minted once, here
        if connection is not None:
            with translate_errors(self.engine.url):
                results = self._enqueue_on(connection, params, strict)
            metrics.enqueued_on_commit(connection, results)
            return results
        # Idempotent (ON CONFLICT DO NOTHING, same ids): after a lost connection it runs once
        # more; if the first attempt committed, the retry collapses onto its rows.
        try:
            results = self._enqueue_pooled(params, strict)
            metrics.enqueued(results)  # committed: counted
            return results
        except DatabaseUnavailable as exc:
            if not is_disconnect(exc):
                raise
            log.info("enqueue: retrying once on a fresh connection after: %s", exc)
        results = self._enqueue_pooled(params, strict)
        metrics.enqueued(results)
        # The lost attempt may have committed: then its rows read back as created=False and
        # nobody sends their wake-up. Mark them unsent: the next sweep sends them (a duplicate
        # wake-up for a row that had one is harmless).
        unsure = [r.request_id for r in results if not r.created and r.status is Status.QUEUED]
        if unsure:
            with raw_connection(self.engine) as raw:
                raw.execute(sql.Q_MARK_UNDISPATCHED_MANY, {"request_ids": unsure})
        return results

    def _enqueue_pooled(self, params: dict[str, Any], strict: bool) -> list[EnqueueResult]:
        with raw_connection(self.engine) as raw:
            if not strict:
                # One INSERT statement is atomic on its own: no BEGIN/COMMIT round trips.
                return self._enqueue_raw(raw, params, strict)
            with raw.transaction():  # strict: a mismatch must roll the whole batch back
                return self._enqueue_raw(raw, params, strict)

    def enqueue_many_with(
        self,
        execute: Callable[[str, dict[str, Any]], Sequence[Mapping[str, Any]]],
        items: Sequence[NewRequest],
        *,
        strict: bool = False,
        now: datetime | None = None,
    ) -> list[EnqueueResult]:
        """Enqueue a batch through the caller's own executor of SQL; results as ``enqueue_many``.

        ``execute(query, params)`` runs one statement written for psycopg
        (``%(name)s`` placeholders; lists bound as arrays) and returns its rows
        as mappings. The executor owns the connection and the transaction —
        nothing commits here — so the rows land with the caller's other writes
        (the Django integration passes a cursor of Django's own connection).
        Inputs are checked before any SQL runs. With ``strict=True`` a mismatch
        raises after the statement: roll back (or use a savepoint) to discard
        the rest of the batch. Nothing is counted in ``onceflow_requests_enqueued_total``
        here (the commit is the caller's): count the results once committed with
        ``onceflow.metrics.record.enqueued(results)`` (the Django integration does, in
        ``transaction.on_commit``).
        """
        if not items:
            return []
        if len(items) > BATCH_MAX:
            raise InvalidRequest(f"a batch holds at most {BATCH_MAX} requests, got {len(items)}")
        params = self._enqueue_params(items, now)

        def run(lookup: bool, values: dict[str, Any]) -> list[Any]:
            return list(execute(sql.Q_ENQUEUE_LOOKUP if lookup else sql.Q_ENQUEUE, values))

        return self._enqueue_with(run, params, strict)

    def resolve(self, item: NewRequest) -> NewRequest:
        """``item`` completed from its stage's declaration (or the bare-queue defaults)."""
        if self.resolver is not None:
            item = self.resolver(item)
        if item.worker_class is None or item.dedupe is None or item.priority is None:
            item = replace(
                item,
                worker_class="default" if item.worker_class is None else item.worker_class,
                dedupe=True if item.dedupe is None else item.dedupe,
                priority=0 if item.priority is None else item.priority,
            )
        return item

    def _enqueue_params(self, items: Sequence[NewRequest], now: datetime | None) -> dict[str, Any]:
        cols: dict[str, list[Any]] = {
            k: []
            for k in (
                "request_ids", "workspace_ids", "job_ids", "branch_paths", "stages", "dedupes",
                "inputs", "input_hashes", "worker_classes", "priorities", "max_attempts",
                "max_crash_attempts", "delays",
            )
        }  # fmt: skip
        limit = self.settings.payload_limit_bytes
        depth = self.settings.max_payload_depth
        for item in items:
            if not isinstance(item, NewRequest):
                raise InvalidRequest(f"expected NewRequest, got {type(item).__name__}")
            item = self.resolve(item)
            check_id("workspace_id", item.workspace_id)
            check_id("job_id", item.job_id)
            check_id("stage", item.stage)
            check_id("branch_path", item.branch_path, max_len=BRANCH_PATH_MAX, allow_empty=True)
            check_worker_class(item.worker_class)
            text, digest = encode_payload(item.input, limit, what="input", max_depth=depth)
            if item.request_id is not None:
                rid = check_id("request_id", item.request_id)
            elif item.dedupe:
                rid = request_id_for(item.workspace_id, item.job_id, item.branch_path, item.stage)
            else:
                rid = random_request_id()
            max_attempts = _positive("max_attempts", item.max_attempts, self.settings.max_attempts)
            max_crash = _positive(
                "max_crash_attempts", item.max_crash_attempts, self.settings.max_crash_attempts
            )
            if not isinstance(item.priority, int) or not -32768 <= item.priority <= 32767:
                raise InvalidRequest("priority must be an integer in [-32768, 32767]")
            delay = _seconds("run_after_seconds", item.run_after_seconds)
            for key, value in (
                ("request_ids", rid), ("workspace_ids", item.workspace_id),
                ("job_ids", item.job_id), ("branch_paths", item.branch_path),
                ("stages", item.stage), ("dedupes", bool(item.dedupe)), ("inputs", text),
                ("input_hashes", digest), ("worker_classes", item.worker_class),
                ("priorities", item.priority), ("max_attempts", max_attempts),
                ("max_crash_attempts", max_crash), ("delays", delay),
            ):  # fmt: skip
                cols[key].append(value)
        return {**cols, "now": now, "notify": self.settings.notify}

    def _enqueue_on(
        self, conn: Connection, params: dict[str, Any], strict: bool
    ) -> list[EnqueueResult]:
        """Enqueue on the caller's SQLAlchemy connection (inside its transaction)."""

        def run(lookup: bool, values: dict[str, Any]) -> list[Any]:
            stmt = sql.ENQUEUE_LOOKUP if lookup else sql.ENQUEUE
            return list(conn.execute(stmt, values).mappings())

        return self._enqueue_with(run, params, strict)

    def _enqueue_raw(
        self, raw: psycopg.Connection[Any], params: dict[str, Any], strict: bool
    ) -> list[EnqueueResult]:
        def run(lookup: bool, values: dict[str, Any]) -> list[Any]:
            return fetch_all(raw, sql.Q_ENQUEUE_LOOKUP if lookup else sql.Q_ENQUEUE, values)

        return self._enqueue_with(run, params, strict)

    @staticmethod
    def _enqueue_with(
        run: Callable[[bool, dict[str, Any]], list[Any]], params: dict[str, Any], strict: bool
    ) -> list[EnqueueResult]:
        ids: list[str] = params["request_ids"]
        hashes: list[str] = params["input_hashes"]
        rows = {r["request_id"]: r for r in run(False, params)}
        missing = [rid for rid in ids if rid not in rows]
        if missing:
            # Inserted by a concurrent enqueue that committed after this statement's snapshot:
            # ON CONFLICT waited for it, so a fresh snapshot (READ COMMITTED) sees it now.
            rows.update({r["request_id"]: r for r in run(True, {"request_ids": missing})})
        results: list[EnqueueResult] = []
        seen: set[str] = set()
        stages: list[str] = params["stages"]
        classes: list[str] = params["worker_classes"]
        for rid, digest, stage, wc in zip(ids, hashes, stages, classes, strict=True):
            row = rows[rid]
            # The same id twice in one batch: only its first occurrence can have created it.
            created = bool(row["created"]) and rid not in seen
            seen.add(rid)
            mismatch = row["input_hash"] != digest
            if mismatch and strict:
                raise InputMismatch(rid, row["input_hash"], digest)
            status = Status(row["status"])
            results.append(
                EnqueueResult(
                    RequestId(rid), created, status, mismatch, stage=stage, worker_class=wc
                )
            )
        return results

    # ------------------------------------------------------------------- claims

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

    # --------------------------------------------------------------- operators

    def cancel(
        self,
        request_id: str,
        *,
        now: datetime | None = None,
        expect: datetime | None = None,
        expect_run: str | None = None,
    ) -> Request:
        """Cancel a queued request at once, or ask a running one to stop (its heartbeat says so).

        A finished request, or a running one asked to stop already, is returned unchanged
        (and not counted again in ``onceflow_requests_cancelled_total``). Fenced (an
        operator's cancel): with ``expect``, only a queued or running row last updated at
        ``expect`` moves; with ``expect_run``, only the running run of that identity
        (``sql.RUN_ID``, as the dashboard shows it); when nothing moved,
        :class:`InvalidTransition` is raised (the caller tells a repeat from a change).
        """
        check_id("request_id", request_id)
        params = {"request_id": request_id, "now": now, "expect": expect, "expect_run": expect_run}
        with raw_connection(self.engine) as raw:
            row = fetch_one(raw, sql.Q_CANCEL, params)
        if row is None:
            current = self.get(request_id)
            if expect is not None or expect_run is not None:
                raise InvalidTransition(request_id, current.status.value, "cancel")
            return current
        cancelled = Request.from_row(row)
        metrics.cancelled(cancelled)
        return cancelled

    def requeue(
        self, request_id: str, *, now: datetime | None = None, expect: datetime | None = None
    ) -> Request:
        """Run a finished (succeeded, dead or cancelled) request again; refused while running.

        ``expect`` fences it: only a dead or cancelled row last updated at ``expect`` moves;
        any other row is left unchanged and :class:`InvalidTransition` is raised.
        """
        check_id("request_id", request_id)
        with raw_connection(self.engine) as raw:
            params = {"request_id": request_id, "now": now, "notify": self.settings.notify}
            row = fetch_one(raw, sql.Q_REQUEUE, {**params, "expect": expect})
        if row is not None:
            requeued = Request.from_row(row)
            metrics.requeued(requeued)
            return requeued
        current = self.get(request_id)
        if current.status is Status.RUNNING or expect is not None:
            raise InvalidTransition(request_id, current.status.value, "requeue")
        return current

    def mark_undispatched(self, request_id: str) -> None:
        """Note that a queued request's wake-up was not sent, so the next sweep sends one."""
        with raw_connection(self.engine) as raw:
            raw.execute(sql.Q_MARK_UNDISPATCHED, {"request_id": request_id})

    def get(self, request_id: str) -> Request:
        """The request with this id, or :class:`NotFound`."""
        check_id("request_id", request_id)
        row = retry_disconnect(lambda: self._read_one(sql.Q_GET, {"request_id": request_id}))
        if row is None:
            raise NotFound(request_id)
        return Request.from_row(row)

    def live_claim(self, request_id: str, token: str) -> Request | None:
        """The request if it runs under ``token`` with a live lease (DB clock), else None.

        A read, not a fence: it holds nothing, so a write that must not outlive the
        claim still fences in its own statement (``fence_check``, the fenced updates).
        """
        check_id("request_id", request_id)
        params = {"request_id": request_id, "token": token, "now": None}
        row = retry_disconnect(lambda: self._read_one(sql.Q_LIVE_CLAIM, params))
        return None if row is None else Request.from_row(row)

    def list(
        self,
        *,
        workspace_id: str | None = None,
        status: str | Sequence[str] | None = None,
        worker_class: str | None = None,
        stage: str | None = None,
        job_id: str | None = None,
        limit: int = 100,
    ) -> builtins.list[Request]:
        """Requests matching every given filter, newest first."""
        if not isinstance(limit, int) or not 1 <= limit <= LIST_LIMIT_MAX:
            raise InvalidRequest(f"limit must be an integer in [1, {LIST_LIMIT_MAX}]")
        query = select(*[wpr.c[name] for name in Request.__dataclass_fields__])
        filters: Mapping[str, str | None] = {
            "workspace_id": workspace_id, "worker_class": worker_class,
            "stage": stage, "job_id": job_id,
        }  # fmt: skip
        for name, value in filters.items():
            if value is not None:
                query = query.where(wpr.c[name] == check_id(name, value))
        if status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            values = [parse_status(s).value for s in statuses]
            query = query.where(wpr.c.status.in_(bindparam("statuses", values, expanding=True)))
        query = query.order_by(wpr.c.created_at.desc(), wpr.c.request_id).limit(limit)

        def read() -> builtins.list[Request]:
            with translate_errors(self.engine.url), self.engine.connect() as conn:
                return [Request.from_row(r) for r in conn.execute(query).mappings()]

        return retry_disconnect(read)

    def counts(self) -> dict[str, dict[str, int]]:
        """Request counts as ``{worker_class: {status: n}}`` (every status present, zeros too)."""
        out: dict[str, dict[str, int]] = {}
        for row in retry_disconnect(lambda: self._read_all(sql.Q_COUNTS, {})):
            per_class = out.setdefault(row["worker_class"], {s.value: 0 for s in Status})
            per_class[row["status"]] = row["n"]
        return out

    def _read_one(self, query: str, params: dict[str, Any]) -> Any:
        """The first row of one statement on a pooled connection (autocommit)."""
        with raw_connection(self.engine) as raw:
            return fetch_one(raw, query, params)

    def _read_all(self, query: str, params: dict[str, Any]) -> builtins.list[Any]:
        """Every row of a read on a pooled connection (safe to repeat: see retry_disconnect)."""
        with raw_connection(self.engine) as raw:
            return fetch_all(raw, query, params)

    # ----------------------------------------------------------------- sweeper
    # rescue_expired, due_for_dispatch, prune, sweep_once, begin_sweep: see queue/sweep.py.
    # complete_many, fail_many, heartbeat_many, release, depth: see queue/batch.py.

    # ----------------------------------------------------------------- helpers

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


def _positive(name: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1000:
        raise InvalidRequest(f"{name} must be an integer in [1, 1000]")
    return value


__all__ = ["Queue", "canonical_json"]
