"""Batches of fenced writes, release, and a cheap depth: the layer-1 API of a pull worker.

Operations of both APIs (:class:`~onceflow.Queue` and :class:`~onceflow.AsyncQueue`),
each written once as steps (:mod:`onceflow.connector`). A worker that claims many
requests at a time (``claim_next(limit=n)``) completes, fails, heartbeats or hands
them back in one round trip per call. Every row keeps its own fence (token + live lease, database
clock): a row whose fence fails is not changed and comes back as a
:class:`~onceflow.errors.LeaseLost` *instance* in its place of the result list (not
raised), while the other rows land. Results are aligned with the input order.

Blips: a fenced batch is retried on :class:`~onceflow.errors.DatabaseUnavailable`
while the shortest lease of the batch may hold (like ``Queue.fenced_retry``), waiting
between attempts with :class:`~onceflow.connector.Sleep` (``asyncio.sleep`` on AsyncQueue). A row
missing from the answer is checked, in one batch read, for being our own write whose
answer was lost (its claim's token ended the run: ``ended_run``, target status) before
it is reported as ``LeaseLost``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from onceflow.connector import (
    FetchAll,
    Query,
    ShardGroups,
    Sleep,
    Steps,
    all_rows,
    on_every_shard,
    operation,
    retrying,
)
from onceflow.errors import DatabaseUnavailable, InvalidRequest, LeaseLost
from onceflow.ids import check_worker_class
from onceflow.metrics import record as metrics
from onceflow.models.requests import Claim, Heartbeat, Request
from onceflow.models.status import Status
from onceflow.payloads import JSON, encode_json
from onceflow.queue import sql
from onceflow.queue.lock_outcomes import lock_outcomes_text
from onceflow.settings import Settings

_I = TypeVar("_I")
_R = TypeVar("_R")

log = logging.getLogger("onceflow.queue")

#: The most claims one batch call takes (as ``enqueue_many``).
BATCH_MAX = 10_000


class Failure(NamedTuple):
    """One failed run for :meth:`BatchOps.fail_many` (the arguments of ``Queue.fail``)."""

    claim: Claim
    error: JSON | BaseException
    retryable: bool = True
    retry_in: float | None = None
    count_attempt: bool = True
    #: The run's compute-lock outcomes, for its history row (as ``Queue.fail``'s ``locks``).
    locks: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Depth:
    """The live depth of one worker class, by the database clock.

    ``queued_due``: queued rows claimable now; ``queued_later``: queued rows waiting
    for their ``run_after`` (retries backing off, delayed enqueues); ``running``:
    rows under a claim (live or lapsed, not yet rescued); ``oldest_due_age_seconds``:
    how long the oldest due row has been due, None when none is.
    """

    queued_due: int
    queued_later: int
    running: int
    oldest_due_age_seconds: float | None


_EMPTY = Depth(0, 0, 0, None)


class BatchOps:
    """Batch operations of the layer-1 store (a mixin of both queue APIs)."""

    settings: Settings

    if TYPE_CHECKING:  # provided by the queue (ClaimOps)

        def backoff(self, attempt: int) -> float: ...

        def _lazy(self) -> Steps[bool]: ...

    # ---------------------------------------------------------------- complete / fail

    def _error_text(self, error: Any) -> str:
        """A failure's error as stored JSON (an exception becomes its type and message)."""
        if isinstance(error, BaseException):
            error = {"type": type(error).__name__, "message": str(error)}
        text = encode_json(
            error,
            self.settings.payload_limit_bytes,
            what="error",
            max_depth=self.settings.max_payload_depth,
        )
        return text

    @operation
    def complete_many(
        self,
        items: Sequence[tuple[Claim, JSON] | tuple[Claim, JSON, Sequence[Mapping[str, Any]]]],
        *,
        now: datetime | None = None,
    ) -> Steps[list[Request | LeaseLost]]:
        """Mark many requests succeeded in one statement, each fenced by its own claim.

        ``items``: ``(claim, result)`` pairs, or ``(claim, result, locks)`` with the run's
        compute-lock outcomes for its history row (as ``Queue.complete``'s ``locks``).
        Results are checked and encoded like ``complete``'s (size and depth limits) before
        any SQL: a bad one raises :class:`InvalidRequest` and nothing is written; so does
        the same request twice.
        Returns, in input order, the updated :class:`Request` or a ``LeaseLost``
        for a row whose lease was lost (that row is unchanged). No hand-offs here:
        use ``complete(then=…)`` for a stage that hands off.
        """
        pairs = _as_list(items, "complete_many")
        claims: list[Claim] = []
        results: list[str] = []
        locks: list[str | None] = []
        for item in pairs:
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise InvalidRequest("complete_many takes (claim, result[, locks]) tuples")
            claim, result = item[0], item[1]
            locks.append(lock_outcomes_text(item[2]) if len(item) == 3 else None)
            claims.append(_check_claim(claim))
            text = encode_json(
                result,
                self.settings.payload_limit_bytes,
                what="result",
                max_depth=self.settings.max_payload_depth,
            )
            results.append(text)
        keys = yield from _prologue(
            pairs, claims, lambda part: BatchOps.complete_many.steps(self, part, now=now)
        )
        if isinstance(keys, list):
            return keys
        params = {**keys, "results": results, "locks": locks, "now": now}
        done = yield from self._fenced_batch(
            claims,
            sql.COMPLETE_MANY,
            params,
            sql.LANDED_MANY,
            (Status.SUCCEEDED,),
            "completion",
            changed_only=True,
        )
        _record(claims, done, "complete")
        return done

    # Signature alike by shape to the other batch operations on purpose: each its own statement.
    @operation
    def fail_many(
        self, items: Sequence[Failure], *, now: datetime | None = None
    ) -> Steps[list[Request | LeaseLost]]:
        """Record many failed runs in one statement, each fenced; next status as ``fail``.

        Per row: cancelled if cancel was requested, else queued again after
        ``retry_in`` (default: ``backoff(attempt)``) if ``retryable`` with attempts
        left (or its attempt not counted: ``count_attempt`` False), else dead; the error
        is kept. Rows requeued already due send a NOTIFY
        (``settings.notify``). Bad input raises :class:`InvalidRequest`, nothing written.
        """
        failures = _as_list(items, "fail_many")
        claims: list[Claim] = []
        errors: list[str] = []
        retryables: list[bool] = []
        delays: list[float] = []
        uncounted: list[bool] = []
        locks: list[str | None] = []
        for item in failures:
            if not isinstance(item, Failure):
                raise InvalidRequest(f"fail_many takes Failure items, got {type(item).__name__}")
            claim = _check_claim(item.claim)
            text = self._error_text(item.error)
            if not isinstance(item.retryable, bool) or not isinstance(item.count_attempt, bool):
                raise InvalidRequest("retryable and count_attempt must be bools")
            if item.retry_in is None:
                delay = self.backoff(claim.attempt)
            else:
                delay = _seconds("retry_in", item.retry_in)
            claims.append(claim)
            errors.append(text)
            retryables.append(item.retryable)
            delays.append(delay)
            uncounted.append(not item.count_attempt)
            locks.append(lock_outcomes_text(item.locks))
        keys = yield from _prologue(
            failures, claims, lambda part: BatchOps.fail_many.steps(self, part, now=now)
        )
        if isinstance(keys, list):
            return keys
        params = {
            **keys, "errors": errors, "retryables": retryables, "delays": delays,
            "uncounted": uncounted, "locks": locks,
            "notify": self._notify(), "now": now,
        }  # fmt: skip
        targets = (Status.QUEUED, Status.DEAD, Status.CANCELLED)
        done = yield from self._fenced_batch(
            claims, sql.FAIL_MANY, params, sql.LANDED_MANY, targets, "failure report"
        )
        _record(claims, done, "fail")
        return done

    # ------------------------------------------------------------- heartbeat / release

    @operation
    def heartbeat_many(
        self, claims: Sequence[Claim], *, now: datetime | None = None
    ) -> Steps[list[Heartbeat | LeaseLost]]:
        """Extend every claim's lease in one round trip (each never past its run deadline).

        In input order: a :class:`Heartbeat` (new expiry, cancel requested) or a
        ``LeaseLost`` for a claim that no longer holds a live lease. A lost
        connection is retried once, on a fresh connection (as ``heartbeat``).
        """
        checked = [_check_claim(c) for c in _as_list(claims, "heartbeat_many")]
        keys = yield from _prologue(
            checked, checked, lambda part: BatchOps.heartbeat_many.steps(self, part, now=now)
        )
        if isinstance(keys, list):
            return keys
        params = {
            **keys, "lease_seconds": [c.lease_seconds for c in checked],
            "deadlines": [c.run_deadline for c in checked], "now": now,
            "lazy": (yield from self._lazy()),
        }  # fmt: skip
        answer = yield from retrying(lambda: all_rows(sql.HEARTBEAT_MANY, params))
        rows = {(r["workspace_id"], r["request_id"]): r for r in answer}
        out: list[Heartbeat | LeaseLost] = []
        for rid, ws in zip(keys["request_ids"], keys["workspace_ids"], strict=True):
            row = rows.get((ws, rid))
            if row is None:
                metrics.zombie("heartbeat")
                out.append(LeaseLost(rid, "heartbeat rejected"))
            else:
                out.append(Heartbeat(row["lease_expires_at"], row["cancel_requested"]))
        return out

    @operation
    def release(
        self, claims: Sequence[Claim], *, now: datetime | None = None
    ) -> Steps[list[Request | LeaseLost]]:
        """Hand back claims whose work has not started (shutdown, an over-fetched batch).

        Each row (fenced: token and live lease) goes back to ``queued``, due at once
        and keeping its place in line (``run_after`` unchanged), with the claim's
        attempt not counted (``attempts - 1``), no claimant, lease or heartbeat, and
        no wake-up recorded (``dispatched_at`` NULL: a Celery deployment's sweeper
        sends a fresh one; a NOTIFY goes out when ``settings.notify``). A row whose
        cancel was requested becomes ``cancelled`` instead. A claim whose lease
        lapsed or was re-claimed is a ``LeaseLost`` and its row is unchanged.

        ``crash_attempts`` is *not* undone. A claim taken from a lapsed lease
        counted the previous holder's crash: that run started and never finished,
        which is exactly what the crash budget exists to bound (a request that
        keeps killing or hanging its workers is quarantined). Releasing the new
        claim says nothing about that earlier run, so its crash stays counted;
        only this claim's own attempt, which never ran, is taken back.
        """
        checked = [_check_claim(c) for c in _as_list(claims, "release")]
        keys = yield from _prologue(
            checked, checked, lambda part: BatchOps.release.steps(self, part, now=now)
        )
        if isinstance(keys, list):
            return keys
        params = {**keys, "notify": self._notify(), "now": now}
        released = (Status.QUEUED, Status.CANCELLED)
        done = yield from self._fenced_batch(
            checked, sql.RELEASE, params, sql.RELEASED_MANY, released, "release"
        )
        metrics.released(done)
        metrics.zombie("release", sum(1 for r in done if isinstance(r, LeaseLost)))
        return done

    # ----------------------------------------------------------------------- depth

    @operation
    def depth(
        self, worker_classes: str | Sequence[str] | None = None, *, now: datetime | None = None
    ) -> Steps[dict[str, Depth]]:
        """Live depth per worker class, cheap enough to poll often.

        Reads only the live rows, through the partial indexes of queued and of
        running rows (index-only scans): cost proportional to the live backlog,
        not the table's history (finished rows are never read, unlike ``counts()``).
        With ``None``, every class that has live rows; with names, exactly those
        classes (zeros for one without live rows). Ages by the database clock.
        """
        params: dict[str, Any] = {"now": now}
        classes: list[str] = []
        if worker_classes is None:
            query = sql.DEPTH_ALL
        else:
            classes = [worker_classes] if isinstance(worker_classes, str) else list(worker_classes)
            for wc in classes:
                check_worker_class(wc)
            query = sql.DEPTH_FOR
            params["worker_classes"] = classes
        parts = yield from on_every_shard(lambda: retrying(lambda: all_rows(query, params)))
        out = {wc: _EMPTY for wc in classes}
        for row in (r for part in parts for r in part):  # summed over shards
            age = row["oldest_due_age"]
            was = out.get(row["worker_class"], _EMPTY)
            ages = [a for a in (was.oldest_due_age_seconds, age) if a is not None]
            out[row["worker_class"]] = Depth(
                was.queued_due + int(row["queued_due"]),
                was.queued_later + int(row["queued_later"]),
                was.running + int(row["running"]),
                max(0.0, float(max(ages))) if ages else None,
            )
        return out

    # --------------------------------------------------------------------- helpers

    def _notify(self) -> bool:
        return bool(getattr(self.settings, "notify", True))

    def _fenced_batch(
        self,
        claims: list[Claim],
        query: Query,
        params: dict[str, Any],
        landed: Query,
        statuses: tuple[Status, ...],
        what: str,
        *,
        changed_only: bool = False,
    ) -> Steps[list[Request | LeaseLost]]:
        """Run one fenced batch statement, retrying blips; rows aligned with ``claims``.

        A row the statement refused is this claim's own landed write if ``landed`` (a batch
        read by each claim's token: ``LANDED_MANY``, ``RELEASED_MANY``) finds it ended by
        that token in one of ``statuses``; else it is a ``LeaseLost``.

        ``changed_only``: the statement returns the key and ``RUN_COLUMNS`` only; each
        request is its claim's with those put in (:meth:`Request.after_run`)."""
        deadline = time.monotonic() + min(c.lease_seconds for c in claims)
        delay = 0.05
        while True:
            try:
                rows = yield FetchAll(query, params)
                break
            except DatabaseUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("batch %s of %d: database blip (%s); retrying", what, len(claims), exc)
                yield Sleep(delay)
                delay = min(1.0, delay * 2)
        if changed_only:
            held = {_key(c.request): c.request for c in claims}
            found = {_key(r): held[_key(r)].after_run(r) for r in rows}
        else:
            found = {_key(r): Request.from_row(r) for r in rows}
        missing = [c for c in claims if _key(c.request) not in found]
        current: dict[tuple[str, str], Request] = {}
        if missing:
            # An earlier attempt (ours, or a caller's whose answer was lost) may have committed.
            keys = {**_keys(missing), "statuses": [s.value for s in statuses]}
            again = yield from retrying(lambda: all_rows(landed, keys))
            current = {_key(r): Request.from_row(r) for r in again}
        out: list[Request | LeaseLost] = []
        for claim in claims:
            key = _key(claim.request)
            row = found[key] if key in found else current.get(key)
            out.append(row if row is not None else LeaseLost(claim.request_id, f"{what} rejected"))
        return out


def _prologue(
    items: Sequence[_I], claims: list[Claim], again: Callable[[list[_I]], Steps[list[_R]]]
) -> Steps[list[_R] | dict[str, Any]]:
    """What every batch does first: the same request twice is refused (before any SQL);
    then the answer when there is nothing more to run here (a list: none for no claims,
    the batch run per shard by ``again`` for claims on several shards), else the claims'
    keys and tokens as the statement's parameters (a dict)."""
    if not claims:
        return []
    _refuse_duplicates(claims)
    spread = yield from _per_shard(items, claims, again)
    if spread is not None:
        return spread
    return _keys(claims)


def _keys(claims: list[Claim]) -> dict[str, Any]:
    """The claims' keys (ids and workspaces) and tokens, in order, as batch parameters."""
    return {
        "request_ids": [str(c.request_id) for c in claims],
        "workspace_ids": _spaces(claims),
        "tokens": [c.token for c in claims],
    }


def _per_shard(
    items: Sequence[_I], claims: list[Claim], again: Callable[[list[_I]], Steps[list[_R]]]
) -> Steps[list[_R] | None]:
    """A batch whose claims live on several shards (a database split by workspace): run
    ``again`` once per shard and answer in input order; None when they share one shard.
    Each shard's part commits on its own (a batch was never one transaction for its
    caller: each row reports its own outcome)."""
    shards: list[int] = yield ShardGroups(tuple(c.request.workspace_id for c in claims))
    if len(set(shards)) <= 1:
        return None
    out: list[_R | None] = [None] * len(claims)
    for shard in sorted(set(shards)):
        picked = [i for i, s in enumerate(shards) if s == shard]
        part = yield from again([items[i] for i in picked])
        for i, answer in zip(picked, part, strict=True):
            out[i] = answer
    return [a for a in out if a is not None]


def _spaces(claims: list[Claim]) -> list[str]:
    """The claims' workspaces, in order (with the ids, the rows' keys)."""
    return [c.request.workspace_id for c in claims]


def _record(claims: list[Claim], done: list[Request | LeaseLost], operation: str) -> None:
    """Metrics of a fenced batch: each landed row's outcome, each refused row a zombie write."""
    metrics.finished_many(claims, done)
    metrics.zombie(operation, sum(1 for r in done if isinstance(r, LeaseLost)))


def _as_list(items: Any, what: str) -> list[Any]:
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidRequest(f"{what} takes a sequence")
    if len(items) > BATCH_MAX:
        raise InvalidRequest(f"a batch holds at most {BATCH_MAX} items, got {len(items)}")
    return list(items)


def _check_claim(claim: Any) -> Claim:
    if not isinstance(claim, Claim):
        raise InvalidRequest(f"expected a Claim, got {type(claim).__name__}")
    return claim


def _refuse_duplicates(claims: list[Claim]) -> None:
    """Refuse the same request (its key) twice in one batch."""
    keys = [_key(c.request) for c in claims]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise InvalidRequest(f"request {dup[1]} appears twice in one batch")


def _key(row: Any) -> tuple[str, str]:
    """A request's key, ``(workspace_id, request_id)``, from a row or a :class:`Request`."""
    if isinstance(row, Request):
        return (row.workspace_id, str(row.request_id))
    return (row["workspace_id"], row["request_id"])


def _seconds(name: str, value: Any) -> float:
    """``value`` as seconds in [0, one year], or :class:`InvalidRequest` (shared with store)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number of seconds")
    if not 0 <= value <= 366 * 86_400:
        raise InvalidRequest(f"{name} must be between 0 and one year")
    return float(value)


__all__ = ["BATCH_MAX", "BatchOps", "Depth", "Failure"]
