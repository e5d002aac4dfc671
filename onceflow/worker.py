# Over ~400 lines on purpose: one Worker whose body threads and four helper threads share
# its held claims under one condition variable; split, the locking would scatter.
"""A standalone layer-1 worker: stage bodies run from the Postgres queue, without Celery.

For consumers that embed the queue (agent back-ends, batch jobs, services without a
broker)::

    from onceflow import Queue
    from onceflow.worker import Worker

    def handler(ctx):                      # a StageContext, as in a Celery stage body
        ctx.check()                        # LeaseLost / Cancelled: stop here
        return {"summary": summarise(ctx.request.input)}

    Worker(Queue(), ["llm"], handler, concurrency=8).run()   # SIGTERM: graceful stop

One process, ``concurrency`` threads running bodies, and four threads around them:

* the **fetcher** claims up to the free capacity (plus ``prefetch``) in one round trip
  (:meth:`Queue.claim_next`) and, when nothing is claimable, sleeps in
  :meth:`Queue.wait_for_work` (LISTEN/NOTIFY, and the next due time or lease expiry the
  database knows of) — no polling loop, no latency-or-load trade-off;
* the **completer** records finished bodies in batches
  (:func:`onceflow.lifecycle.record.record_many`, the one write path of every runner's
  outcomes: one round trip for the successes and one for the failures that finished
  meanwhile — group commit), each row fenced by its own claim token;
* the **heartbeater** extends every held lease in one round trip every lease/3
  (:meth:`Queue.heartbeat_many`) and tells bodies whose lease was lost or whose request
  was cancelled (``ctx.check()`` raises);
* the **sweeper** (``sweep=True``) rescues lapsed leases of this worker's classes, elected
  on the database clock (one sweep per interval among every worker), and never sends a
  Celery wake-up — the rescue-only sweep a consumer without Celery needs.

Work in flight is bounded, so a slow database delays results but never runs a finished
body again. The worker holds at most ``max_held`` claims — waiting for a thread, running,
or finished and not yet recorded — and stops claiming while its finished bodies wait for
the completer (backpressure), so every claim it holds fits one heartbeat and one
completion batch (:data:`~onceflow.queue.batch.BATCH_MAX`). Heartbeats never wait for a
completion: a heartbeat round skips only the rows whose outcome is being written at that
moment (fenced when their write began), and a write waits for a heartbeat in flight, so
no heartbeat ever reaches a row just recorded. A finished body whose outcome cannot be
recorded yet keeps its lease alive through those heartbeats while the completer retries.

Shutdown (:meth:`stop`, SIGTERM or SIGINT): claiming stops, claims not yet started are
handed back (:meth:`Queue.release`: queued again, no attempt counted), running bodies
finish and are recorded, then :meth:`run` returns. A second signal stops at once: bodies
still running are abandoned and their leases lapse (the sweeper or another worker takes
them up, counting a crash). Leases, due times and the sweep election use the database
clock only; this process's monotonic clock schedules heartbeats and retries.

The connection pool is sized for the worker: ``concurrency`` (bodies writing ops) plus
one each for the fetcher, completer, heartbeater and sweeper; LISTEN holds one more
connection of its own.

A database split by workspace (``ONCEFLOW_DATABASE_URLS`` / ``ONCEFLOW_SHARD_MAP``, or a
sharded :class:`Queue` given): the worker claims from every shard (``claim_next`` visits
them in turn and skips one that cannot be reached), waits on every shard's LISTEN, and
runs one completer and one heartbeater per shard, so a shard that is down (whose
batches retry until their leases would lapse) never holds up another's outcomes or
leases; the sweeper sweeps each shard in turn, each in its own ``try``. Each shard has
its own pool of the size above (a thread uses one shard at a time) and its own LISTEN.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from opentelemetry.trace import Span

from onceflow.context import StageContext, to_json_result
from onceflow.db import redact_url
from onceflow.errors import (
    Cancelled,
    InvalidRequest,
    LeaseLost,
    OnceflowError,
    PermanentError,
    RetryLater,
)
from onceflow.ids import check_id, check_worker_class
from onceflow.lifecycle import spans
from onceflow.lifecycle.outcome import OnBudget, Outcome, check_on_budget, decide, failed, succeeded
from onceflow.lifecycle.record import record_many
from onceflow.metrics import record as metrics
from onceflow.models.requests import Claim
from onceflow.payloads import Unreadable, encode_json
from onceflow.queue import Queue
from onceflow.queue.batch import BATCH_MAX
from onceflow.queue.notify import WAIT_MAX_SECONDS
from onceflow.queue.sweep import traced_sweep
from onceflow.settings import get_settings
from onceflow.spend.databases import Databases
from onceflow.spend.defaults import install_ledger

log = logging.getLogger("onceflow.worker")

#: What a body raises on purpose: not logged with a traceback.
_EXPECTED = (LeaseLost, Cancelled, RetryLater, PermanentError, InvalidRequest)

#: What record_many reports for rows the database did not confirm (tried again while the
#: lease may hold).
_UNKNOWN = frozenset({"completion_unknown", "failure_unknown"})

#: A stage body: gets the context, returns the result (JSON-able or a pydantic model).
Handler = Callable[[StageContext], Any]

#: Threads besides the bodies' that use the pool: fetcher, completer, heartbeater, sweeper.
SERVICE_CONNECTIONS = 4
SWEEP_NAME = "onceflow.worker"
#: The most claims one claim_next returns (Queue's limit).
CLAIM_LIMIT = 1000
#: The longest RetryLater delay honoured as given (the queue's own bound).
MAX_RETRY_DELAY = 366 * 86_400


# Counters as dataclass fields (alike by shape with other option records): data, not logic.
@dataclass
class WorkerStats:
    """What this worker did since it started (counts, this process only)."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    released: int = 0
    lease_lost: int = 0
    unrecorded: int = 0
    rescued: int = 0
    overran: int = 0  # runs past max_runtime this worker's sweeps failed


@dataclass
class _Done:
    """A finished body waiting to be recorded: its claim and what the run came to (with
    its run span, ended once the outcome is recorded, and what the body raised)."""

    ctx: StageContext
    outcome: Outcome
    span: Span | None = None
    error: BaseException | None = None


class Worker:
    """Runs ``handler`` for requests of ``worker_classes`` claimed from ``queue``.

    ``queue``: a :class:`Queue`, or a database URL (None: the settings' URL) — then
    the worker builds its own queue with a pool sized for it. ``concurrency``: bodies
    run at once (threads). ``prefetch``: extra claims held ready beyond the free
    threads (heartbeated meanwhile; handed back at shutdown), to hide the claim round
    trip at saturation. ``retry_on(exc)`` decides whether an exception is worth a retry
    (default: every exception except :class:`PermanentError` and
    :class:`InvalidRequest`). ``on_budget`` (``"fail"``, ``"wait"`` or None) is what a
    body's ``BudgetExceeded`` does, as a Flow stage's ``on_budget`` (None: the budget's
    own ``on_exceeded``). ``max_held``: the most claims held at once — waiting,
    running, or finished and not yet recorded (default twice ``concurrency + prefetch``,
    at most :data:`~onceflow.queue.batch.BATCH_MAX`); claiming pauses at it, so a slow
    database holds results back instead of piling up claims. ``max_runtime`` bounds a run
    as on Celery — heartbeats stop extending the lease past claim time + ``max_runtime``
    (time a prefetched claim waits counts too) — but a thread cannot be interrupted: a
    body still running then loses its lease (``ctx.check()`` raises) and its later writes
    are fenced off; the sweeper records the run as failed, ``MaxRuntimeExceeded``, retried
    after the backoff (dead at ``max_attempts``), as on Celery. Default: no bound (a hung
    body holds its lease until the process stops). ``max_wait`` bounds one sleep in
    :meth:`Queue.wait_for_work` — a safety net only, since the wait already ends at the
    first notification, due time or lease expiry.
    """

    def __init__(
        self,
        queue: Queue | str | None,
        worker_classes: str | Sequence[str],
        handler: Handler,
        *,
        concurrency: int = 4,
        prefetch: int = 0,
        worker_id: str | None = None,
        lease_seconds: float | None = None,
        max_runtime: float | None = None,
        retry_on: Callable[[BaseException], bool] | None = None,
        on_budget: OnBudget = None,
        sweep: bool = True,
        max_wait: float = 30.0,
        max_held: int | None = None,
    ) -> None:
        classes = [worker_classes] if isinstance(worker_classes, str) else list(worker_classes)
        if not classes:
            raise InvalidRequest("a worker needs at least one worker class")
        for wc in classes:
            check_worker_class(wc)
        for name, value, low in (("concurrency", concurrency, 1), ("prefetch", prefetch, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 1000:
                raise InvalidRequest(f"{name} must be an integer in [{low}, 1000]")
        if not callable(handler):
            raise InvalidRequest("handler must be callable")
        if concurrency + prefetch > CLAIM_LIMIT:
            raise InvalidRequest(f"concurrency + prefetch must be at most {CLAIM_LIMIT}")
        if max_held is None:
            max_held = 2 * (concurrency + prefetch)
        if (
            not isinstance(max_held, int)
            or isinstance(max_held, bool)
            or not concurrency + prefetch <= max_held <= BATCH_MAX
        ):
            raise InvalidRequest(
                f"max_held must be an integer in [concurrency + prefetch, {BATCH_MAX}]"
            )
        if not _positive_seconds(max_wait) or max_wait > WAIT_MAX_SECONDS:
            raise InvalidRequest(
                f"max_wait must be a number of seconds in (0, {WAIT_MAX_SECONDS:g}]"
            )
        if max_runtime is not None and not _positive_seconds(max_runtime):
            raise InvalidRequest("max_runtime must be a positive number of seconds")
        budget_choice = check_on_budget(on_budget)
        self._owns_queue = not isinstance(queue, Queue)
        if isinstance(queue, Queue):
            self.queue = queue
        else:
            # None: the settings' database(s) — every shard of a split database, each with
            # a pool of this size (a thread uses one shard at a time).
            pool = concurrency + SERVICE_CONNECTIONS
            self.queue = Queue(queue, get_settings(), pool_size=pool)
        # Its providers record to the spend ledger, in the databases it claims from.
        install_ledger(self.queue.settings, databases=self._ledger_databases)
        #: The databases claims come from (1, or the shards of a split database).
        self.shard_count = len(self.queue.shards())
        self.worker_classes = classes
        self.handler = handler
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.max_held = max_held
        self.worker_id = check_id(
            "worker_id", worker_id or f"{socket.gethostname()[:60]}:{os.getpid()}:worker"
        )
        self.lease_seconds = self.queue.lease_for(lease_seconds)
        self.max_runtime = max_runtime
        self.retry_on = retry_on or (lambda exc: True)
        self.on_budget = budget_choice
        self._max_delay = float(self.queue.settings.backoff_max_seconds)
        self.sweep = sweep
        self.max_wait = float(max_wait)
        self.stats = WorkerStats()

        self._cond = threading.Condition()
        self._ready: deque[StageContext] = deque()  # claimed, not started
        self._held: dict[str, StageContext] = {}  # every claim this worker holds
        # Claims whose outcome (or hand-back) is being written now: left out of heartbeat
        # rounds, which would reach a row just recorded (a false "lease lost"). A write
        # waits while its shard's heartbeat round is in flight (_beating); a round never
        # waits for a write.
        self._in_write: set[StageContext] = set()
        # The run span of each body running or waiting to be recorded (tracing on): a failed
        # heartbeat is noted on it.
        self._run_spans: dict[StageContext, Span] = {}
        self._beating = [False] * self.shard_count
        self._running = 0
        self._finished = 0  # bodies finished whose outcome is not recorded yet
        self._done: list[list[_Done]] = [[] for _ in range(self.shard_count)]  # per shard
        self._stopping = threading.Event()  # no more claims; finish what runs
        self._abandon = threading.Event()  # a second signal: do not wait for running bodies
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._background: threading.Thread | None = None

    def _ledger_databases(self) -> Databases:
        """The spend ledger's databases: this worker's own engines, one per shard."""
        engines = [shard.engine for shard in self.queue.shards()]
        return Databases(self.queue.shard_map, engines=engines)

    # ------------------------------------------------------------------ control

    def run(self) -> None:
        """Work until :meth:`stop` (or SIGTERM/SIGINT in the main thread); then shut down."""
        with self._signals():
            self._start_threads()
            self._log_start()
            try:
                self._fetch_loop()
            finally:
                self._shutdown()

    def start(self) -> Worker:
        """Run in a background thread (``with worker:`` does this); returns the worker."""
        self._background = threading.Thread(target=self.run, name="onceflow-worker", daemon=True)
        self._background.start()
        return self

    def stop(self, *, wait: bool = True, abandon: bool = False) -> None:
        """Stop claiming, hand back unstarted claims, let running bodies finish.

        ``abandon=True`` does not wait for running bodies (their leases lapse).
        ``wait``: block until the worker has shut down (when it runs in the background).
        """
        if abandon:
            self._abandon.set()
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if (
            wait
            and self._background is not None
            and self._background is not threading.current_thread()
        ):
            self._background.join()

    def __enter__(self) -> Worker:
        return self.start()

    # The context-manager protocol (alike by shape everywhere): Python fixes its signature.
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _log_start(self) -> None:
        shards = self.queue.shards()
        where = redact_url(shards[0].engine.url)
        if len(shards) > 1:
            where += f" and {len(shards) - 1} more shard(s)"
        log.info(
            "worker %s: classes %s, concurrency %d (+%d prefetch, at most %d held), lease %gs, "
            "database %s",
            self.worker_id, ", ".join(self.worker_classes), self.concurrency, self.prefetch,
            self.max_held, self.lease_seconds, where,
        )  # fmt: skip

    @property
    def held(self) -> int:
        """Claims this worker holds now (ready, running or being recorded)."""
        with self._cond:
            return len(self._held)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self._stopping.is_set():
                log.warning("worker: second signal; abandoning running bodies")
                self._abandon.set()
            else:
                log.info(
                    "worker: signal %s; stopping (a second one abandons running bodies)", signum
                )
            self.stop(wait=False)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _shard(self, ctx: StageContext) -> int:
        """The shard of ``ctx``'s claim (0 on one database)."""
        shard_map = self.queue.shard_map
        return 0 if shard_map is None else shard_map.shard_of(ctx.claim.request.workspace_id)

    def _start_threads(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = [
            (f"onceflow-body-{i}", self._body_loop) for i in range(self.concurrency)
        ]
        for shard in range(self.shard_count):
            suffix = f"-{shard}" if self.shard_count > 1 else ""
            targets += [
                (f"onceflow-completer{suffix}", functools.partial(self._complete_loop, shard)),
                (f"onceflow-heartbeats{suffix}", functools.partial(self._heartbeat_loop, shard)),
            ]
        if self.sweep:
            targets.append(("onceflow-sweeper", self._sweep_loop))
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # ------------------------------------------------------------------ fetcher

    def _capacity(self) -> int:
        """How many more claims to take now (caller holds the lock): free threads (plus
        ``prefetch``), within ``max_held`` claims in all — finished bodies waiting to be
        recorded count, so claiming pauses while the completer is behind."""
        waiting_or_running = self._running + len(self._ready)
        slots = self.concurrency + self.prefetch - waiting_or_running
        return min(slots, self.max_held - waiting_or_running - self._finished)

    def _should_claim(self) -> bool:
        """Claim now: a slot is free and no claim waits for it, or a batch's worth is free.

        While prefetched claims wait, freed slots accumulate to a quarter of the worker
        (one round trip for several claims) instead of one claim per finished body.
        """
        capacity = self._capacity()
        batch = max(1, (self.concurrency + self.prefetch) // 4)
        return capacity > 0 and (not self._ready or capacity >= batch)

    def _fetch_loop(self) -> None:
        delay = 0.05
        while not self._stopping.is_set():
            with self._cond:
                while not self._should_claim() and not self._stopping.is_set():
                    self._cond.wait()
                want = self._capacity()
            if self._stopping.is_set():
                break
            try:
                claims = self.queue.claim_next(
                    self.worker_classes,
                    self.worker_id,
                    want,
                    lease_seconds=self.lease_seconds,
                    max_runtime=self.max_runtime,
                )
                if not claims:
                    self.queue.wait_for_work(
                        self.worker_classes, self.max_wait, interrupt=self._stopping
                    )
            except InvalidRequest:
                raise  # a bug or a bad option, not an outage: retrying cannot help
            except OnceflowError as exc:  # the database is away: back off, interruptibly
                log.warning("worker: claim failed (%s); retrying in %.2f s", exc, delay)
                self._stopping.wait(delay)
                delay = min(2.0, delay * 2)
                continue
            delay = 0.05
            if claims:
                self._hold(claims)

    def _drop(self, ctx: StageContext) -> None:
        """Stop holding ``ctx``'s claim (caller holds the lock).

        Only if it is still this claim: after a lost lease the same request may have been
        claimed again by this worker, and that newer claim must keep its heartbeats.
        """
        if self._held.get(ctx.claim.request_id) is ctx:
            del self._held[ctx.claim.request_id]
        if self._run_spans:
            self._run_spans.pop(ctx, None)

    def _hold(self, claims: list[Claim]) -> None:
        with self._cond:
            for claim in claims:
                ctx = StageContext(self.queue, claim, self.worker_id)
                self._supersede(self._held.get(claim.request_id))
                self._held[claim.request_id] = ctx
                self._ready.append(ctx)
            self.stats.claimed += len(claims)
            self._cond.notify_all()

    def _supersede(self, old: StageContext | None) -> None:
        """This worker took over a request whose earlier claim it still holds (its lease
        lapsed: a database away past the lease; a run past ``max_runtime`` is taken again
        only once the sweeper failed it and its backoff passed). The
        earlier claim is gone: its body is told (``ctx.check()`` raises — no heartbeat
        reaches it any more), an unstarted one is dropped, and an outcome it still
        produces is discarded (``_record``). Caller holds the lock."""
        if old is None:
            return
        log.warning("request %s: taken over by a new claim; the earlier one is gone",
                    old.claim.request_id)  # fmt: skip
        old.mark_lease_lost()
        if old in self._ready:
            self._ready.remove(old)
            self.stats.lease_lost += 1

    # ------------------------------------------------------------------- bodies

    def _body_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._stopping.is_set():
                    self._cond.wait()
                if not self._ready or self._stopping.is_set():
                    return  # unstarted claims are handed back by _shutdown
                ctx = self._ready.popleft()
                self._running += 1
            done: _Done | None = None
            try:
                done = self._run_body(ctx)
            except BaseException:  # even recording the error failed: never lose the thread
                rid = ctx.claim.request_id
                log.exception("request %s: the body's outcome could not be built", rid)
                done = _Done(ctx, failed({"type": "WorkerError"}, retryable=True))
            finally:
                with self._cond:
                    self._running -= 1
                    if done is not None:
                        self._done[self._shard(ctx)].append(done)
                        self._finished += 1
                    else:
                        self._drop(ctx)
                    self._cond.notify_all()

    def _run_body(self, ctx: StageContext) -> _Done | None:
        """Run one body; what to record (None: nothing — the lease is gone).

        Traced as ``onceflow.run {stage}`` (:mod:`onceflow.lifecycle.spans`): current while
        the body runs, ended by the completer once the outcome is recorded. Every log line
        of the body carries the run's request, workspace, stage and attempt.
        """
        claim = ctx.claim
        request = claim.request
        span = spans.start_claimed(claim)
        if span is not None:
            with self._cond:
                self._run_spans[ctx] = span
        with spans.running(
            span, request_id=request.request_id, workspace_id=request.workspace_id,
            stage=request.stage, attempt=claim.attempt,
        ):  # fmt: skip
            try:
                return _Done(ctx, succeeded(self._body(ctx)), span)
            except BaseException as exc:  # the outcome table decides, SystemExit included
                return self._outcome(ctx, exc, span)

    def _body(self, ctx: StageContext) -> Any:
        """The body's result, checked as the store takes it; or what it raised."""
        claim = ctx.claim
        settings = self.queue.settings
        if isinstance(claim.request.input, Unreadable):  # stored before the depth limit
            raise PermanentError(f"input cannot be read: {claim.request.input['reason']}")
        ctx.check()  # a prefetched claim may have lost its lease while it waited
        with metrics.in_progress(claim.request.worker_class):
            result = to_json_result(self.handler(ctx))
        ctx.check()
        # Refused results (too large, too deep, not JSON) fail the request here, per row,
        # rather than failing a whole batch of completions later.
        encode_json(
            result,
            settings.payload_limit_bytes,
            what="result",
            max_depth=settings.max_payload_depth,
        )
        return result

    def _outcome(self, ctx: StageContext, exc: BaseException, span: Span | None) -> _Done | None:
        """What to record for a body that raised ``exc`` (:func:`onceflow.lifecycle.decide`)."""
        claim = ctx.claim
        ran = decide(
            exc, retry_on=self.retry_on, max_delay=self._max_delay, on_budget=self.on_budget
        )
        if ran.kind == "lease_lost":
            log.warning("request %s: lease lost; the result is discarded", claim.request_id)
            spans.end_run(span, "lease_lost", exc)
            with self._cond:
                self.stats.lease_lost += 1
            return None
        if ran.interrupted:
            # Interrupted, not wrong: recorded as a retryable failure, and this thread
            # lives on to run the next body (re-raising would only end the thread).
            log.exception("request %s: the body was interrupted", claim.request_id)
        elif not isinstance(exc, _EXPECTED):
            log.exception("request %s: the body raised", claim.request_id)
        return _Done(ctx, ran, span, exc)

    # ---------------------------------------------------------------- completer

    def _complete_loop(self, shard: int) -> None:
        """Records the outcomes of one shard's claims (one such thread per shard)."""
        delay = 0.05
        while True:
            with self._cond:
                while not self._done[shard] and not self._completer_may_exit():
                    self._cond.wait()
                if not self._done[shard]:
                    return
                waiting = self._done[shard]
                batch, self._done[shard] = waiting[:BATCH_MAX], waiting[BATCH_MAX:]
            retry = self._record(batch, shard)
            if retry:
                with self._cond:
                    self._done[shard][:0] = retry
                time.sleep(delay)  # the database is away; _may_retry bounds how long
                delay = min(1.0, delay * 2)
            else:
                delay = 0.05

    def _completer_may_exit(self) -> bool:
        """Nothing left to record, ever (caller holds the lock)."""
        return self._stopping.is_set() and (self._abandon.is_set() or self._running == 0)

    def _record(self, batch: list[_Done], shard: int) -> list[_Done]:
        """Record a batch of one shard (:func:`onceflow.lifecycle.record.record_many`);
        returns the items to try again (the database did not confirm them)."""
        with self._cond:  # outcomes of claims taken over since (_supersede): never written
            current = [d for d in batch if self._held.get(d.ctx.claim.request_id, d.ctx) is d.ctx]
            kept = {id(d) for d in current}
            for d in batch:
                if id(d) in kept:
                    continue
                log.warning("worker: a run's claim was taken over; its outcome is discarded")
                spans.end_run(d.span, "lease_lost", d.error)
                self.stats.lease_lost += 1
                self._finished -= 1
        if not current:
            return []
        ctxs = [d.ctx for d in current]
        run_spans = [d.span for d in current] if any(d.span for d in current) else None
        recorded = record_many(
            self.queue,
            [(d.ctx, d.outcome) for d in current],
            functools.partial(self._writing, shard, ctxs),
            run_spans,
        )
        retry: list[_Done] = []
        given_up: list[_Done] = []
        ended: list[_Done] = []
        for d, rec in zip(current, recorded, strict=True):
            if rec["outcome"] in _UNKNOWN:
                if self._may_retry(d):
                    retry.append(d)
                else:
                    given_up.append(d)
                    spans.end_run(d.span, rec["outcome"], d.error)
                continue
            if rec["outcome"] == "not_recorded":  # refused even in brief: the lease lapses
                given_up.append(d)
                spans.end_run(d.span, "not_recorded", d.error)
                continue
            ended.append(d)
            spans.end_run(d.span, rec["outcome"], d.error)
            with self._cond:
                if rec["outcome"] == "lease_lost":
                    log.warning("request %s: lease lost; outcome discarded", d.ctx.claim.request_id)
                    self.stats.lease_lost += 1
                elif rec["outcome"] == "succeeded":
                    self.stats.succeeded += 1
                else:
                    self.stats.failed += 1
            _log_outcome(d, rec)
        if retry:
            log.warning("worker: %d outcome(s) not recorded yet; retrying", len(retry))
        self._forget(ended)
        self._forget(given_up, unrecorded=True)
        return retry

    @contextlib.contextmanager
    def _writing(self, shard: int, ctxs: list[StageContext]) -> Iterator[None]:
        """Write the outcomes of ``ctxs`` (one shard's): after the heartbeat round in flight,
        if any, and with ``ctxs`` left out of the rounds that start meanwhile."""
        with self._cond:
            while self._beating[shard]:
                self._cond.wait()
            self._in_write.update(ctxs)
        try:
            yield
        finally:
            with self._cond:
                self._in_write.difference_update(ctxs)

    def _may_retry(self, d: _Done) -> bool:
        """Keep trying while the database may still confirm the lease (it alone decides)."""
        silent = time.monotonic() - d.ctx.confirmed_at
        return (
            not d.ctx.lease_lost
            and silent <= d.ctx.claim.lease_seconds
            and not self._abandon.is_set()
        )

    def _forget(self, items: list[_Done], *, unrecorded: bool = False) -> None:
        with self._cond:
            for d in items:
                self._drop(d.ctx)
                self._finished -= 1
                if unrecorded:
                    log.error(
                        "request %s: outcome not recorded; its lease will lapse",
                        d.ctx.claim.request_id,
                    )
                    self.stats.unrecorded += 1
            self._cond.notify_all()

    # ------------------------------------------------------------- heartbeater

    def _heartbeat_loop(self, shard: int) -> None:
        """Extends the leases of one shard's claims (one such thread per shard).

        Every held claim but those whose outcome is being written right now (their write
        was fenced when it began): running bodies, prefetched claims, and finished bodies
        whose outcome waits to be recorded — a slow database keeps their leases.
        """
        interval = self.lease_seconds / 3
        while not self._stopped.wait(interval):
            with self._cond:
                held = [
                    ctx
                    for ctx in self._held.values()
                    if self._shard(ctx) == shard and ctx not in self._in_write
                ]
                if not held:
                    continue
                self._beating[shard] = True
            try:
                beats = self._beat(held)
            except OnceflowError as exc:  # the database may be back before the leases lapse
                log.warning("worker: heartbeat failed: %s", exc)
                self._note_failed_beats(held, exc)
                continue
            except Exception:  # the one thread of every lease must never die
                log.exception("worker: heartbeat raised; carrying on")
                continue
            finally:
                with self._cond:
                    self._beating[shard] = False
                    self._cond.notify_all()
            now = time.monotonic()
            with self._cond:
                for ctx, beat in zip(held, beats, strict=True):
                    if isinstance(beat, LeaseLost):
                        if not ctx.lease_lost:
                            log.warning("request %s: lease lost", ctx.claim.request_id)
                            spans.heartbeat_failed(self._run_spans.get(ctx), beat)
                        ctx.mark_lease_lost()
                        if ctx in self._ready:  # not started: nothing to run or record
                            self._ready.remove(ctx)
                            self._drop(ctx)
                            self.stats.lease_lost += 1
                        continue
                    ctx.lease_confirmed(now)
                    if beat.cancel_requested:
                        ctx.mark_cancel_requested()
                self._cond.notify_all()

    def _note_failed_beats(self, held: list[StageContext], error: BaseException) -> None:
        """A failed heartbeat round, noted on the run span of each body it was for."""
        if not self._run_spans:
            return
        with self._cond:
            traced = [self._run_spans.get(ctx) for ctx in held]
        for span in traced:
            spans.heartbeat_failed(span, error)

    def _beat(self, held: list[StageContext]) -> list[Any]:
        """One heartbeat round, in batches the queue takes (``max_held`` keeps it to one)."""
        beats: list[Any] = []
        for start in range(0, len(held), BATCH_MAX):
            part = held[start : start + BATCH_MAX]
            beats += self.queue.heartbeat_many([ctx.claim for ctx in part])
        return beats

    # ----------------------------------------------------------------- sweeper

    def _sweep_loop(self) -> None:
        settings = self.queue.settings
        interval = settings.sweep_interval_seconds
        while not self._stopping.wait(interval):
            for index, shard in enumerate(self.queue.shards()):  # each elected on its own
                self._sweep_shard(shard, index, interval)

    def _sweep_shard(self, queue: Queue, index: int, interval: float) -> None:
        where = f" (shard {index})" if self.shard_count > 1 else ""
        try:
            turn = queue.begin_sweep(SWEEP_NAME, self.worker_id, min_gap=interval / 2)
            if not turn.won:
                return
            rescued = traced_sweep(lambda: queue.rescue_expired(worker_classes=self.worker_classes))
        except OnceflowError as exc:
            log.warning("worker: sweep failed%s: %s", where, exc)
            return
        except Exception:
            log.exception("worker: sweep raised%s; carrying on", where)
            return
        if rescued.rescued or rescued.quarantined or rescued.overran:
            log.info(
                "worker: sweep requeued %d and quarantined %d lapsed request(s), and failed "
                "%d run(s) past max_runtime%s",
                len(rescued.rescued),
                len(rescued.quarantined),
                len(rescued.overran),
                where,
            )
            with self._cond:
                self.stats.rescued += len(rescued.rescued) + len(rescued.quarantined)
                self.stats.overran += len(rescued.overran)

    # ---------------------------------------------------------------- shutdown

    def _shutdown(self) -> None:
        self._stopping.set()
        with self._cond:
            unstarted = list(self._ready)
            self._ready.clear()
            self._cond.notify_all()
        self._release(unstarted)
        for thread in self._threads:
            if thread.name.startswith(("onceflow-body-", "onceflow-completer")):
                while thread.is_alive() and not self._abandon.is_set():
                    thread.join(timeout=0.2)
        self._stopped.set()  # the heartbeater stops with the last recorded outcome
        if self._abandon.is_set():
            with self._cond:
                left = len(self._held)
            if left:
                log.warning("worker: abandoned %d running request(s); their leases lapse", left)
        if self._owns_queue:
            self.queue.close()
            for shard in self.queue.shards():
                shard.engine.dispose()

    def _release(self, unstarted: list[StageContext]) -> None:
        if not unstarted:
            return
        released = 0
        for shard in range(self.shard_count):  # a shard that is down keeps only its own
            mine = [ctx for ctx in unstarted if self._shard(ctx) == shard]
            if mine:
                released += self._release_shard(mine, shard)
        log.info("worker: handed back %d unstarted claim(s)", released)

    def _release_shard(self, unstarted: list[StageContext], shard: int) -> int:
        with self._writing(shard, unstarted):
            try:
                outcomes = self.queue.release([ctx.claim for ctx in unstarted])
            except OnceflowError as exc:
                log.warning("worker: could not hand back %d claim(s): %s", len(unstarted), exc)
                outcomes = []
            released = sum(1 for o in outcomes if not isinstance(o, LeaseLost))
            with self._cond:
                for ctx in unstarted:
                    self._drop(ctx)
                self.stats.released += released
        return released


def _log_outcome(d: _Done, recorded: dict[str, Any]) -> None:
    """One INFO line per recorded request, as Celery's worker logs each task."""
    request = d.ctx.claim.request
    if recorded["outcome"] == "lease_lost":
        return
    if recorded["outcome"] == "succeeded":
        ended = "succeeded"
    else:
        status = recorded.get("status", "failed")
        ended = {"queued": "failed, retried later"}.get(status, status)
    log.info("request %s (stage %s, class %s): %s",
             request.request_id, request.stage, request.worker_class, ended)  # fmt: skip


def _positive_seconds(value: object) -> bool:
    return _seconds_within(value, MAX_RETRY_DELAY) and float(value) > 0  # type: ignore[arg-type]


def _seconds_within(value: object, most: float) -> bool:
    """A finite number of seconds in [0, most] (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 <= value <= most


__all__ = ["Handler", "Worker", "WorkerStats"]
