"""Running one stage: claim, heartbeat, fence, complete — the lifecycle every stage task shares.

The Celery message names a request id and nothing else; it is a wake-up. The
claim decides whether this process runs the stage: a duplicate, late or
redelivered message finds the request running elsewhere or finished, and is
acknowledged with an outcome that says so (Flower shows it as the task result).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from celery.exceptions import SoftTimeLimitExceeded
from opentelemetry.trace import Span
from pydantic import ValidationError

from onceflow import tracing
from onceflow.context import StageContext, oplog_for, to_json_result
from onceflow.errors import (
    Cancelled,
    DatabaseUnavailable,
    InvalidRequest,
    LeaseLost,
    MaxRuntimeExceeded,
    NotFound,
    OnceflowError,
    PermanentError,
    RetryLater,
)
from onceflow.keys import counters_key
from onceflow.lifecycle import spans
from onceflow.lifecycle.outcome import Outcome, decide, succeeded
from onceflow.lifecycle.record import record
from onceflow.metrics import record as metrics
from onceflow.models.requests import Claim, Dispatch
from onceflow.models.status import Status
from onceflow.payloads import Unreadable
from onceflow.queue import Queue

if TYPE_CHECKING:
    from onceflow.tasks.spec import StageSpec

log = logging.getLogger("onceflow.runtime")

#: What a body raises on purpose: not logged with a traceback.
_EXPECTED = (LeaseLost, Cancelled, RetryLater, PermanentError, InvalidRequest)


class _Heartbeats:
    """One thread per process extends the lease of every stage it runs, each every lease/3.

    Starting a thread per stage cost milliseconds per task; a registration costs a dict
    insert. The monotonic clock here only schedules the next heartbeat: whether a lease
    is live is always decided by the database's clock, in the heartbeat's UPDATE.

    Each stage has a turn (a lock), held by its heartbeat and by the recording of its
    outcome (:meth:`recording`), which drops it from the set before letting go: no
    heartbeat is sent for a row whose outcome committed (the database would reject it, a
    false "lease lost" and a false zombie-write count). A heartbeat that finds the turn
    taken skips that stage and comes back soon: a slow recording never holds up the
    heartbeats of the other stages.
    """

    #: How soon a heartbeat skipped for a recording in flight is tried again (at most).
    RETRY_BUSY_SECONDS = 0.05
    #: How long the thread sleeps with nothing to beat before it has seen a stage.
    IDLE_SECONDS = 60.0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # When the thread will wake up by itself (monotonic; 0 while it is not waiting), and
        # how long it sleeps when idle: the shortest interval registered so far. A stage
        # whose first beat falls after that wake-up needs no notify — in a prefork child,
        # where each stage finds the set empty, a notify per stage was a thread switch each.
        self._wake_at = 0.0
        self._idle = self.IDLE_SECONDS
        self._due: dict[int, tuple[float, StageContext, Queue, float]] = {}
        self._turns: dict[int, threading.Lock] = {}
        # The run span of each stage traced (a failed heartbeat is noted on it).
        self._spans: dict[int, Span] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0

    def add(
        self, queue: Queue, ctx: StageContext, interval: float, span: Span | None = None
    ) -> None:
        """Heartbeat ``ctx``'s claim every ``interval`` seconds until :meth:`remove`
        (``span``: the run's, where a failed heartbeat is noted)."""
        with self._cond:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                # First use in this process (or after a fork): threads do not survive a fork.
                self._thread = threading.Thread(
                    target=self._run, name="onceflow-heartbeats", daemon=True
                )
                self._pid = os.getpid()
                self._thread.start()
            due = time.monotonic() + interval
            self._due[id(ctx)] = (due, ctx, queue, interval)
            self._turns[id(ctx)] = threading.Lock()
            if span is not None:
                self._spans[id(ctx)] = span
            self._idle = min(self._idle, interval)
            if due < self._wake_at:
                self._cond.notify()

    def remove(self, ctx: StageContext) -> None:
        """Stop heartbeating ``ctx`` (always called when its stage ends, also on BaseException)."""
        with self._cond:
            self._due.pop(id(ctx), None)
            self._turns.pop(id(ctx), None)
            self._spans.pop(id(ctx), None)

    @contextmanager
    def recording(self, ctx: StageContext, *, ends: bool = True) -> Iterator[None]:
        """Hold ``ctx``'s turn while its outcome is written: no heartbeat for it meanwhile.

        ``ends``: the write, if it returns or raises :class:`LeaseLost`, ends the run, so
        ``ctx`` leaves the set before the turn is let go. Any other error keeps it (a
        retried write needs the lease kept alive between its tries).
        """
        with self._cond:
            turn = self._turns.get(id(ctx))
        with turn if turn is not None else nullcontext():
            try:
                yield
            except LeaseLost:
                self.remove(ctx)
                raise
            if ends:
                self.remove(ctx)

    def _run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # the one thread of every stage's lease must never die
                log.exception("heartbeat thread: unexpected error; carrying on")
                time.sleep(0.1)  # no hot loop if the error repeats

    def _tick(self) -> None:
        with self._cond:
            now = time.monotonic()
            ready = [(k, v) for k, v in self._due.items() if v[0] <= now]
            if not ready:
                wake = min((v[0] for v in self._due.values()), default=now + self._idle)
                self._wake_at = wake
                try:
                    self._cond.wait(timeout=max(0.0, wake - now))
                finally:
                    self._wake_at = 0.0
                return
            for k, (_, ctx, queue, interval) in ready:
                self._due[k] = (now + interval, ctx, queue, interval)
        for k, (_, ctx, queue, interval) in ready:
            with self._cond:
                turn = self._turns.get(k)
            if turn is None:
                continue  # the stage ended meanwhile
            if not turn.acquire(blocking=False):
                # Its outcome is being recorded: no beat now; again soon if it stays.
                with self._cond:
                    if k in self._due:
                        again = time.monotonic() + min(interval, self.RETRY_BUSY_SECONDS)
                        self._due[k] = (again, ctx, queue, interval)
                continue
            try:
                self._beat(k, ctx, queue)
            except Exception:  # one stage's odd failure must not starve the others
                log.exception("request %s: heartbeat raised", ctx.request.request_id)
            finally:
                turn.release()

    def _beat(self, key: int, ctx: StageContext, queue: Queue) -> None:
        with self._cond:
            if key not in self._due:
                return  # its outcome was recorded while this round gathered
        try:
            beat = queue.heartbeat(ctx.claim)
        except LeaseLost as exc:
            with self._cond:
                if self._due.pop(key, None) is None:
                    return  # the stage ended meanwhile: its completion already decided
                span = self._spans.get(key)
            spans.heartbeat_failed(span, exc)
            log.warning(
                "request %s: lease lost; the stage stops at its next fenced step",
                ctx.request.request_id,
            )
            ctx.mark_lease_lost()
            return
        except OnceflowError as exc:
            # The database may be back before the lease runs out: keep trying.
            with self._cond:
                span = self._spans.get(key)
            spans.heartbeat_failed(span, exc)
            log.warning("request %s: heartbeat failed: %s", ctx.request.request_id, exc)
            return
        ctx.lease_confirmed()
        if beat.cancel_requested and not ctx.cancel_requested:
            log.info("request %s: cancel requested", ctx.request.request_id)
            ctx.mark_cancel_requested()


_heartbeats = _Heartbeats()


# Same leading parameters as run_claimed on purpose: it claims, then runs via run_claimed.
def run_request(
    queue: Queue,
    spec: StageSpec,
    request_id: str,
    worker_id: str,
    is_retryable: Callable[[BaseException], bool],
    dispatch: Callable[[Dispatch], object] | None = None,
    *,
    workspace_id: str | None = None,
) -> dict[str, Any]:
    """Claim ``request_id`` and run ``spec``'s body under heartbeats; returns the outcome.

    ``dispatch`` sends the wake-ups of the hand-offs (``ctx.then``) the completion created.
    ``workspace_id``: the request's, as its wake-up names it (None: found by id alone).
    """
    with tracing.log_fields(request_id=request_id, workspace_id=workspace_id, stage=spec.name):
        started = spans.now_ns()
        claim = _claim(queue, spec, request_id, worker_id, workspace_id)
        if started:
            spans.claim_span(
                claim, started, request_id=request_id, stage=spec.name,
                worker_class=None if claim is None else claim.request.worker_class,
                workspace_id=workspace_id, lease_seconds=spec.lease_seconds,
            )  # fmt: skip
        if claim is None:
            return _not_claimed(queue, request_id, workspace_id)
        return run_claimed(queue, spec, claim, worker_id, is_retryable, dispatch)


def run_claimed(
    queue: Queue,
    spec: StageSpec,
    claim: Claim,
    worker_id: str,
    is_retryable: Callable[[BaseException], bool],
    dispatch: Callable[[Dispatch], object] | None = None,
) -> dict[str, Any]:
    """Run ``spec``'s body on ``claim`` (already taken) under heartbeats and record its
    outcome: the part of :func:`run_request` after the claim, for a runner that claims by
    other means (:mod:`onceflow.testing` claims in the workers' order).

    Traced as ``onceflow.run {stage}`` (:mod:`onceflow.lifecycle.spans`), current while
    the body runs and its outcome is written; every log line meanwhile carries the run's
    request, workspace, stage and attempt.
    """
    request = claim.request
    span = spans.start_claimed(claim)
    trail: dict[str, Any] = {"outcome": "not_recorded", "error": None}
    try:
        with spans.running(
            span, request_id=request.request_id, workspace_id=request.workspace_id,
            stage=request.stage, attempt=claim.attempt,
        ):  # fmt: skip
            return _run_claimed(queue, spec, claim, worker_id, is_retryable, dispatch, span, trail)
    finally:
        spans.end_run(span, trail["outcome"], trail["error"])


def _run_claimed(
    queue: Queue,
    spec: StageSpec,
    claim: Claim,
    worker_id: str,
    is_retryable: Callable[[BaseException], bool],
    dispatch: Callable[[Dispatch], object] | None,
    span: Span | None,
    trail: dict[str, Any],
) -> dict[str, Any]:
    """:func:`run_claimed` inside its span; ``trail`` gets what the run came to
    (``outcome``) and what the body raised (``error``), for the span."""
    request_id = claim.request_id
    ctx = StageContext(
        queue, claim, worker_id, hands_off_to=spec.hands_off_to,
        sub_docs=spec.sub_docs if spec.sub_docs_declared else None,
    )  # fmt: skip
    _heartbeats.add(queue, ctx, interval=claim.lease_seconds / 3, span=span)
    outcome: dict[str, Any] = {"request_id": request_id, "attempt": claim.attempt}
    interrupted: BaseException | None = None
    try:
        try:
            ran = succeeded(_run_body(spec, ctx, claim))
        except BaseException as exc:  # also SystemExit, KeyboardInterrupt: recorded, re-raised
            trail["error"] = exc
            ran = decide(
                _as_overrun(exc), retry_on=is_retryable, max_delay=_max_delay(queue),
                on_budget=spec.on_budget,
            )  # fmt: skip
            if isinstance(exc, Exception) and not isinstance(exc, _EXPECTED):
                log.exception("request %s: stage %s raised", request_id, spec.name)
            if ran.interrupted:
                log.exception("request %s: stage %s was interrupted", request_id, spec.name)
                interrupted = exc
        # Recorded once (lifecycle.record): a body that succeeded is never turned into a
        # failure or a re-run except by a lost lease (someone else owns the request now) or
        # a result the store refuses.
        if ran.kind == "lease_lost":
            trail["outcome"] = "lease_lost"
            return {**outcome, **_lease_lost(queue, claim)}
        recorded, followed = record(queue, ctx, ran, lambda: _heartbeats.recording(ctx), span)
        trail["outcome"] = recorded["outcome"]
        if recorded["outcome"] == "lease_lost":
            _count_lost(queue, claim, ran)
        if dispatch is not None:
            for made in followed:
                if made.created:
                    dispatch(
                        Dispatch(made.request_id, made.stage, made.worker_class, made.workspace_id)
                    )
        if interrupted is not None:
            raise interrupted
        return {**outcome, **recorded}
    finally:
        # Always, also on BaseException (worker shutdown): no heartbeat outlives its stage.
        _heartbeats.remove(ctx)


def _run_body(spec: StageSpec, ctx: StageContext, claim: Claim) -> Any:
    """The body's result (as the store takes it), or what it raised."""
    if isinstance(claim.request.input, Unreadable):  # stored before the depth limit
        raise PermanentError(f"input cannot be read: {claim.request.input['reason']}")
    try:
        data = spec.input_model.model_validate(claim.request.input)
    except ValidationError as exc:
        msg = f"input does not fit {spec.input_model.__name__}: {exc}"
        raise PermanentError(msg) from exc
    with metrics.in_progress(claim.request.worker_class):
        result = to_json_result(spec.func(ctx, data))
    ctx.check()
    return result


def _as_overrun(exc: BaseException) -> BaseException:
    """Celery's soft time limit (= the stage's ``max_runtime``) as the outcome table names a
    run past it: :class:`MaxRuntimeExceeded`, with the body's traceback (where it was)."""
    if isinstance(exc, SoftTimeLimitExceeded):
        return MaxRuntimeExceeded().with_traceback(exc.__traceback__)
    return exc


def _max_delay(queue: Queue) -> float:
    """The longest retry delay: the backoff's cap, a RetryLater's clamp."""
    return float(queue.settings.backoff_max_seconds)


def _count_lost(queue: Queue, claim: Claim, ran: Outcome) -> None:
    """A completion fenced off is a zombie write (counted); a failure report is not."""
    if ran.kind == "succeeded":
        _lease_lost(queue, claim)


CLAIM_RETRY_SECONDS = 10.0
#: The same on a database split by workspace: a worker slot waiting out a shard that is
#: down would hold up the other shards' wake-ups (bench/shard_sim.py measured it: the
#: shards that stayed up finished next to nothing while every slot waited on the stopped
#: one). The wake-up is dropped sooner; the sweeper of that shard re-sends it once it is back.
SHARDED_CLAIM_RETRY_SECONDS = 1.0


def _claim(
    queue: Queue, spec: StageSpec, request_id: str, worker_id: str, workspace_id: str | None
) -> Claim | None:
    """Claim the request, riding out a short database blip (a restart, a failover).

    A claim whose answer was lost may have committed: the retry then finds the row
    running under that lost claim's lease and returns None; the lease lapses and the
    sweeper re-dispatches — a delay, never a second run. Past the retry window the error
    propagates: the wake-up is dropped and the sweeper sends another.
    """
    window = CLAIM_RETRY_SECONDS if queue.shard_map is None else SHARDED_CLAIM_RETRY_SECONDS
    deadline = time.monotonic() + window
    delay = 0.1
    while True:
        try:
            return queue.claim(
                request_id,
                worker_id,
                lease_seconds=spec.lease_seconds,
                stage=spec.name,
                max_runtime=spec.max_runtime,
                workspace_id=workspace_id,
            )
        except DatabaseUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("request %s: claim hit a database blip (%s); retrying", request_id, exc)
            time.sleep(delay)
            delay = min(1.0, delay * 2)


def _lease_lost(queue: Queue, claim: Claim) -> dict[str, Any]:
    log.warning(
        "request %s: lease lost; result discarded (another worker owns it)", claim.request_id
    )
    _count_zombie(queue, claim)
    return {"outcome": "lease_lost"}


ZOMBIE_COUNTER = "zombie_writes_rejected"


def _count_zombie(queue: Queue, claim: Claim) -> None:
    """Count a zombie's rejected completion in the workspace's stats hash (best effort)."""
    try:
        redis = oplog_for(queue).redis()
        redis.hincrby(counters_key(claim.request.workspace_id), ZOMBIE_COUNTER, 1)
    except Exception as exc:  # a counter must never fail the stage's outcome
        log.warning("could not count a zombie write: %s", exc)


def _not_claimed(queue: Queue, request_id: str, workspace_id: str | None) -> dict[str, Any]:
    try:
        current = queue.get(request_id, workspace_id=workspace_id)
    except NotFound:
        return {"request_id": request_id, "outcome": "not_found"}
    reason = {
        Status.RUNNING: "running under a live lease elsewhere",
        Status.QUEUED: "not due yet (retry backoff) or of another stage",
    }.get(current.status, "finished")
    return {
        "request_id": request_id,
        "outcome": "not_claimed",
        "status": current.status.value,
        "reason": reason,
    }
