"""The sweeper's half of the layer-1 store: rescue lapsed leases, find lost wake-ups, prune.

Operations of both APIs (:class:`~onceflow.Queue` and :class:`~onceflow.AsyncQueue`),
each written once as steps (:mod:`onceflow.connector`). Every step is a compare-and-set over rows
locked with ``SKIP LOCKED`` and decided by the database clock, so any number of
sweepers may run at once: they split the work, never double it.

Telling a lost wake-up from a waiting one: a row whose wake-up was sent but not yet
claimed may be waiting behind a backlog (its message is still in the broker) or lost
(purged, dropped with a Redis restart). Re-sends of one row back off exponentially
(``redispatch_count``), and when the caller can ask the broker how many messages wait
per worker class, a class gets at most ``due rows - messages waiting - rows never sent``
re-sends. Never-sent rows and re-sends each get half of a sweep's limit (a share one
kind leaves unused goes to the other), so neither kind can starve the other.

A row marked dispatched must get its wake-up: a Flow's sweep hands each batch to its
sender right after the statement that marked it, and prunes run last, each on its own.

The caller's callbacks (``send``, ``backlog``) talk to a broker: blocking I/O. They are
:class:`~onceflow.connector.Call` steps, so on :class:`~onceflow.AsyncQueue` a plain
function runs in a worker thread (the event loop never waits on a publish, even one a
broker outage stalls) and a coroutine function is awaited; on both APIs the sweep goes
on only once the callback has returned, so the order above holds on both.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link

from onceflow import tracing
from onceflow.connector import Call, Execute, FetchAll, FetchOne, Query, Steps, operation
from onceflow.errors import InvalidRequest, MaxRuntimeExceeded
from onceflow.ids import RequestId, check_id, check_worker_class
from onceflow.metrics import record as metrics
from onceflow.models.requests import Dispatch, SweepResult
from onceflow.models.status import Status
from onceflow.queue import sql
from onceflow.settings import Settings

log = logging.getLogger("onceflow.sweep")

#: The error a run past its ``max_runtime`` is failed with when the sweeper finds its lease
#: ended at the run deadline: what :func:`onceflow.lifecycle.decide` records for
#: :class:`MaxRuntimeExceeded` (its type and message).
OVERRAN_ERROR: dict[str, str] = {
    "type": MaxRuntimeExceeded.__name__,
    "message": str(MaxRuntimeExceeded()),
}

#: ``send(batch)``: publish the wake-ups of rows a sweep statement has just marked dispatched
#: (on AsyncQueue it may also be a coroutine function; a plain one runs in a worker thread).
Send = Callable[[Sequence[Dispatch]], object]

#: ``backlog(worker_classes)``: messages waiting in the broker per worker class (a queue
#: that does not exist counts 0), or None when the broker cannot be asked.
Backlog = Callable[[Sequence[str]], Mapping[str, int] | None]


@dataclass(frozen=True, slots=True)
class SweepTurn:
    """The outcome of :meth:`Sweeper.begin_sweep`.

    ``won``: this caller should sweep now. ``next_in``: seconds, by the database
    clock, until a contender asking the same ``min_gap`` could win (0 if it could now).
    """

    won: bool
    next_in: float


class Sweeper:
    """The sweeper's operations (a mixin of both queue APIs)."""

    settings: Settings

    @operation
    def begin_sweep(self, name: str, swept_by: str, *, min_gap: float) -> Steps[SweepTurn]:
        """Compare-and-set on the sweep row ``name``: won if no sweep began in ``min_gap`` s.

        The database clock alone decides (``now()``); ``min_gap=0`` always wins and just
        records the sweep. Beat's sweep task asks half an interval (a sweep that arrives
        late behind another is a no-op); worker watchdogs ask 1.5 intervals (they step in
        only when nobody else swept).
        """
        check_id("sweep name", name)
        gap = _seconds("min_gap", min_gap)
        params = {"name": name, "swept_by": str(swept_by)[:200], "min_gap": gap}
        row = yield FetchOne(sql.BEGIN_SWEEP, params)
        return SweepTurn(bool(row["won"]), max(0.0, float(row["next_in"])))

    @operation
    def rescue_expired(
        self,
        *,
        limit: int = 1000,
        stages: Sequence[str] | None = None,
        worker_classes: Sequence[str] | None = None,
        now: datetime | None = None,
    ) -> Steps[SweepResult]:
        """Requeue (or quarantine) requests whose lease lapsed, in one compare-and-set.

        A run whose lease ended at its run deadline (claim time + ``max_runtime``) went
        past its ``max_runtime``: it is failed with :data:`OVERRAN_ERROR`, queued again
        after the backoff (or dead at ``max_attempts``) and not counted as a crash — the
        outcome table's rule (:func:`onceflow.lifecycle.decide` of
        :class:`~onceflow.errors.MaxRuntimeExceeded`), listed in ``overran``.

        ``stages``: only requests of these stages; ``worker_classes``: only requests of
        these classes (the standalone worker's rescue-only sweep). None: every one.
        """
        params = {
            "limit": _limit(limit), "stages": _stages(stages), "now": now,
            "worker_classes": _classes(worker_classes), "notify": self.settings.notify,
            "overran_error": json.dumps(OVERRAN_ERROR),
            "backoff_base": float(self.settings.backoff_base_seconds),
            "backoff_max": float(self.settings.backoff_max_seconds),
        }  # fmt: skip
        rows = yield FetchAll(sql.RESCUE_EXPIRED, params)
        metrics.reclaimed(rows)
        if rows and tracing.active():
            _rescue_spans(rows)
        crashed = [r for r in rows if not r["overran"]]
        rescued = [RequestId(r["request_id"]) for r in crashed if r["status"] == Status.QUEUED]
        dead = [RequestId(r["request_id"]) for r in crashed if r["status"] != Status.QUEUED]
        dispatch = [_dispatch(r) for r in crashed if r["status"] == Status.QUEUED]
        overran = [RequestId(r["request_id"]) for r in rows if r["overran"]]
        return SweepResult(rescued=rescued, quarantined=dead, to_dispatch=dispatch, overran=overran)

    @operation
    def due_for_dispatch(
        self,
        *,
        redispatch_after: float,
        limit: int = 1000,
        stages: Sequence[str] | None = None,
        backlog: Backlog | None = None,
        sending: Sequence[Dispatch] = (),
        send: Send | None = None,
        now: datetime | None = None,
    ) -> Steps[list[Dispatch]]:
        """Queued, due rows that need a wake-up; marked dispatched in the same statement.

        Two kinds share ``limit``: rows that never had a wake-up (``dispatched_at`` NULL:
        a failed send, a retry that became due), and rows whose wake-up is stale — sent
        more than ``redispatch_after * 2**min(k, 5)`` seconds ago, ``k`` being the
        re-sends so far — so possibly lost. Each kind gets half of ``limit``, and the
        share one kind leaves unused passes to the other: a flood of never-sent rows (a
        broker outage, a burst of retries) never starves lost wake-ups, nor the reverse.

        With ``backlog``, each worker class gets at most ``due rows - messages waiting -
        never-sent rows`` stale re-sends (a row waiting behind a backlog still has its
        message), less the wake-ups of that class marked but not yet published
        (``sending``; and, without ``send``, this call's own); without it, or if the
        broker cannot be asked, the backoff alone limits them.

        ``send``: called with each batch right after the statement that marked it, so a
        later failure can never leave a row marked dispatched without its wake-up.
        Without it, the caller sends the returned list.
        """
        after = _seconds("redispatch_after", redispatch_after)
        limit = _limit(limit)
        base = {"stages": _stages(stages), "now": now, "notify": self.settings.notify}
        marked: list[Dispatch] = []
        unpublished = Counter(d.worker_class for d in sending)

        def mark(statement: Query, params: dict[str, Any]) -> Steps[int]:
            rows = yield FetchAll(statement, {**base, **params})
            batch = [_dispatch(r) for r in rows]
            marked.extend(batch)
            if send is None:
                unpublished.update(d.worker_class for d in batch)
            elif batch:
                yield Call.in_thread(send, batch)
            return len(batch)

        share = (limit + 1) // 2  # the never-sent rows' share; the rest is the stale rows'
        unsent = yield from mark(sql.DUE_UNSENT, {"limit": share})
        room = limit - unsent
        stale = 0
        budgets = yield from self._resend_budgets(after, base, backlog, unpublished, room)
        for worker_class, budget in budgets.items():
            take = min(budget, room - stale)
            if take > 0:
                params = {"redispatch_after": after, "worker_class": worker_class, "limit": take}
                stale += yield from mark(sql.DUE_FOR_DISPATCH, params)
        if unsent == share and unsent + stale < limit:  # more may wait: the stale rows' spare
            yield from mark(sql.DUE_UNSENT, {"limit": limit - unsent - stale})
        return marked

    def _resend_budgets(
        self,
        after: float,
        base: dict[str, Any],
        backlog: Backlog | None,
        unpublished: Counter[str],
        cap: int,
    ) -> Steps[dict[str | None, int]]:
        """How many stale wake-ups to re-send per worker class (None: any class)."""
        if backlog is None:
            return {None: cap}
        counts = yield FetchAll(sql.DUE_COUNTS, {**base, "redispatch_after": after})
        stale = {r["worker_class"]: r for r in counts if r["stale"]}
        if not stale:
            return {}  # nothing stale: the broker is not asked at all
        waiting: Mapping[str, int] | None = yield Call.in_thread(backlog, sorted(stale))
        if waiting is None:
            return {None: cap}  # the broker cannot be asked: the backoff alone limits re-sends
        budgets: dict[str | None, int] = {}
        for wc, r in stale.items():
            # A due row with no message in the broker was never sent (not lost: not sent
            # yet), is marked but not yet published, or lost its wake-up: only those get one.
            lost = int(r["due"]) - int(waiting.get(wc, 0)) - int(r["unsent"]) - unpublished[wc]
            budgets[wc] = min(int(r["stale"]), max(0, lost))
        return budgets

    @operation
    def prune(
        self,
        *,
        retention_seconds: float | None,
        payload_retention_seconds: float | None,
        limit: int = 1000,
        now: datetime | None = None,
    ) -> Steps[int]:
        """Apply the retention policy; returns rows deleted or turned into tombstones.

        ``None`` for either age disables that step: nothing is pruned unless asked. An age is
        a positive, finite number of seconds (as the settings take it), ``limit`` as for
        :meth:`rescue_expired`: anything else raises :class:`InvalidRequest` before any step
        runs. (A negative or zero age would delete a row finished just now: the tombstone
        that keeps a repeated enqueue from running its stage again.)
        """
        limit = _limit(limit)
        payload_age = _age("payload_retention_seconds", payload_retention_seconds)
        age = _age("retention_seconds", retention_seconds)
        touched = 0
        if payload_age is not None:
            params = {"age": payload_age, "limit": limit, "now": now}
            touched += yield Execute(sql.PRUNE_PAYLOADS, params)
        if age is not None:
            params = {"age": age, "limit": limit, "now": now}
            touched += yield Execute(sql.DELETE_FINISHED, params)
        return touched

    @operation
    def sweep_once(
        self,
        *,
        redispatch_after: float | None = None,
        limit: int = 1000,
        stages: Sequence[str] | None = None,
        backlog: Backlog | None = None,
        send: Send | None = None,
        now: datetime | None = None,
    ) -> Steps[SweepResult]:
        """One sweeper pass: rescue lapsed leases, send the wake-ups rows need, then prune.

        ``to_dispatch`` lists the wake-ups of the rows this pass marked dispatched. With
        ``send``, each batch went to it right after the statement that marked it (so an
        error in a later step strands none); without it, the caller must send them. A
        :class:`~onceflow.tasks.Flow` passes ``stages`` (the stages it declares, the only
        ones it can send), ``backlog`` (its broker's queue lengths) and ``send``. Called on
        a bare queue (``stages=None``), it covers every stage and limits re-sends by their
        backoff alone: use it when the caller sends the wake-ups of every stage itself, or
        serves them with pull workers that need none.

        Retention (pruning) always applies to the whole table, runs last, and never fails
        the sweep: a prune that raises is logged and tried again at the next sweep.

        On :class:`~onceflow.AsyncQueue`, ``send`` and ``backlog`` run in a worker thread
        (or are awaited, if coroutine functions): see the module's notes.
        """
        s = self.settings
        after = s.redispatch_after_seconds if redispatch_after is None else redispatch_after
        rescued = yield from Sweeper.rescue_expired.steps(self, limit=limit, stages=stages, now=now)
        if send is not None and rescued.to_dispatch:
            yield Call.in_thread(send, rescued.to_dispatch)
        due = yield from Sweeper.due_for_dispatch.steps(
            self,
            redispatch_after=after,
            limit=limit,
            stages=stages,
            backlog=backlog,
            sending=() if send is not None else rescued.to_dispatch,
            send=send,
            now=now,
        )
        pruned = 0
        if s.payload_retention_seconds is not None:
            pruned += yield from _logged_prune(
                "payload prune",
                Sweeper.prune.steps(
                    self,
                    retention_seconds=None,
                    payload_retention_seconds=s.payload_retention_seconds,
                    limit=limit,
                    now=now,
                ),
            )
        if s.retention_seconds is not None:
            pruned += yield from _logged_prune(
                "retention prune",
                Sweeper.prune.steps(
                    self,
                    retention_seconds=s.retention_seconds,
                    payload_retention_seconds=None,
                    limit=limit,
                    now=now,
                ),
            )
        return SweepResult(
            rescued=rescued.rescued,
            quarantined=rescued.quarantined,
            to_dispatch=rescued.to_dispatch + due,
            pruned=pruned,
            overran=rescued.overran,
        )


#: What a rescue did to a row, by its status after it (a crash; an overrun is ``overran``).
_RESCUED_AS = {Status.QUEUED: "requeued", Status.DEAD: "quarantined", Status.CANCELLED: "cancelled"}


@tracing.guarded
def _rescue_spans(rows: Sequence[Any]) -> None:
    """One short ``onceflow.rescue`` span per row a rescue changed, in that row's trace (the
    trace it was enqueued under: its runs' trace), linked to the current span (the sweep);
    under the current span for a row enqueued without a trace."""
    sweep = trace.get_current_span().get_span_context()
    links = [Link(sweep, {"onceflow.link": "sweep"})] if sweep.is_valid else []
    for row in rows:
        parent = tracing.context_from(row["trace_context"])
        attributes = tracing.attributes(
            request_id=row["request_id"], stage=row["stage"], worker_class=row["worker_class"],
            attempt=row["attempts"], workspace_id=row["workspace_id"],
        )  # fmt: skip
        status = row["status"]
        attributes["onceflow.crash_attempts"] = row["crash_attempts"]
        attributes["onceflow.status"] = str(status)
        attributes["onceflow.rescue.outcome"] = (
            "overran" if row["overran"] else _RESCUED_AS.get(status, str(status))
        )
        span = tracing.TRACER.start_span(
            "onceflow.rescue", context=parent, attributes=attributes,
            links=links if parent is not None else None,
        )  # fmt: skip
        span.end()


def traced_sweep(sweep: Callable[[], SweepResult]) -> SweepResult:
    """Run ``sweep`` (one sweep of one database) under an ``onceflow.sweep`` span with its
    counts (``onceflow.rescued``, ``quarantined``, ``overran``, ``dispatched``, ``pruned``),
    current meanwhile: the rescues link to it. Just ``sweep()`` when tracing is off."""
    if not tracing.active():
        return sweep()
    with tracing.TRACER.start_as_current_span(
        "onceflow.sweep", record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            result = sweep()
        except BaseException as exc:
            tracing.ended_with(span, exc)
            raise
        span.set_attribute("onceflow.rescued", len(result.rescued))
        span.set_attribute("onceflow.quarantined", len(result.quarantined))
        span.set_attribute("onceflow.overran", len(result.overran))
        span.set_attribute("onceflow.dispatched", len(result.to_dispatch))
        span.set_attribute("onceflow.pruned", result.pruned)
        return result


def _logged_prune(what: str, prune: Steps[int]) -> Steps[int]:
    """Run one retention step; an error is logged (the wake-ups are out already), not raised."""
    try:
        return (yield from prune)
    except Exception as exc:  # any error: retention waits for the next sweep, nothing else does
        log.warning(
            "sweep: %s failed, tried again next sweep: %s: %s", what, type(exc).__name__, exc
        )
        return 0


def _stages(stages: Sequence[str] | None) -> list[str] | None:
    if stages is None:
        return None
    if isinstance(stages, str):
        raise InvalidRequest("stages must be a list of stage names, not one string")
    return [check_id("stage", stage) for stage in stages]


def _classes(classes: Sequence[str] | None) -> list[str] | None:
    if classes is None:
        return None
    if isinstance(classes, str):
        raise InvalidRequest("worker_classes must be a list of worker classes, not one string")
    return [check_worker_class(wc) for wc in classes]


def _limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100_000:
        raise InvalidRequest("limit must be an integer in [1, 100000]")
    return limit


#: The longest gap or wait a sweep takes, in seconds (one year).
_YEAR = 366 * 86_400
#: The longest retention age, in seconds: a century, past any policy (the settings take any
#: positive age, and a year is too short a cap for a dedup window) and far inside the
#: database's timestamps, so the age can never overflow its statement.
_AGE_MAX = 100 * _YEAR


def _seconds(name: str, value: float, *, positive: bool = False, most: int = _YEAR) -> float:
    """``value`` as seconds in [0, ``most``] — (0, ``most``] if ``positive`` —, or
    :class:`InvalidRequest`: a finite int or float, never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number of seconds")
    if positive and not 0 < value <= most:
        raise InvalidRequest(f"{name} must be positive and at most {most // _YEAR} years")
    if not 0 <= value <= most:
        raise InvalidRequest(f"{name} must be between 0 and one year")
    return float(value)


def _age(name: str, value: float | None) -> float | None:
    """A retention age (None: that step is off), checked as :func:`_seconds`, positive."""
    return None if value is None else _seconds(name, value, positive=True, most=_AGE_MAX)


__all__ = ["OVERRAN_ERROR", "Backlog", "Send", "SweepTurn", "Sweeper", "traced_sweep"]


def _dispatch(row: Any) -> Dispatch:
    """The wake-up of a row a sweep statement returned (it carries the row's key)."""
    return Dispatch(
        RequestId(row["request_id"]),
        row["stage"],
        row["worker_class"],
        row["workspace_id"],
        row.get("trace_context"),
    )
