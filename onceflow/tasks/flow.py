# Over ~400 lines on purpose: the Flow is the one public class users declare stages on; its
# stage decorator, enqueue and sweeper set-up share the registry and settings.
"""Declaring stages as Celery tasks, enqueueing them, and sweeping.

::

    flow = Flow()

    class EvaluateInput(BaseModel):
        columns: list[str]

    @flow.stage("evaluate", input=EvaluateInput, worker_class="llm", lease_seconds=60)
    def evaluate(ctx: StageContext, data: EvaluateInput) -> dict:
        ...
        return {"scores": ...}

    flow.enqueue("evaluate", "w1", "j1", "main", {"columns": ["fit"]})

Each stage becomes the Celery task ``onceflow.stage.<name>``, routed to its worker
class's queue ``onceflow.wc.<class>`` unless the app's ``task_routes`` routes that
task (:mod:`onceflow.tasks.routing`). Its only argument is the request id. The
worker class comes from the declaration: a caller may name only one the stage
declares (``worker_class`` or ``alternate_worker_classes``).

``Flow()`` builds and fully configures its own Celery app; ``Flow(app=your_app)``
leaves your app's settings to your tasks (:mod:`onceflow.tasks.config`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from celery import Celery
from opentelemetry import context as otel_context
from pydantic import BaseModel, ValidationError

from onceflow import tracing
from onceflow.context import oplog_for
from onceflow.errors import (
    InvalidRedisUrl,
    InvalidRequest,
    OnceflowError,
    OutOfScope,
    UnknownStage,
    validation_summary,
)
from onceflow.ids import check_id, check_worker_class, random_request_id
from onceflow.keys import queue_name
from onceflow.lifecycle.outcome import OnBudget, check_on_budget
from onceflow.locks.savings import read_savings
from onceflow.metrics import record as metrics
from onceflow.models.requests import Dispatch, EnqueueResult, NewRequest, Request, SweepResult
from onceflow.models.sub_doc_scope import SubDocScope
from onceflow.payloads import check_json
from onceflow.queue import Queue
from onceflow.queue.series import write_rollup
from onceflow.queue.sweep import traced_sweep
from onceflow.redis_clients import REDIS_OR_OS_ERRORS
from onceflow.settings import Settings, get_settings
from onceflow.shards import each_shard
from onceflow.spend.defaults import install_ledger
from onceflow.tasks import metrics_hooks as _metrics_hooks  # noqa: F401 - connects signals
from onceflow.tasks import worker_process as _worker_process  # noqa: F401 - connects signals
from onceflow.tasks.broker import harden
from onceflow.tasks.config import (
    MAINTENANCE_QUEUE,
    SWEEP_TASK,
    TASK_OPTIONS,
    celery_config,
    effective_broker_url,
    guest_defaults,
    maintenance_queue_for,
    redelivery_bound,
    time_limits,
)
from onceflow.tasks.identity import worker_id
from onceflow.tasks.routing import TASK_PREFIX, routed_queue, send_options
from onceflow.tasks.spec import StageFunc, StageSpec
from onceflow.tasks.stage_task import StageTask, task_body
from onceflow.tasks.sweeper import (
    BEAT_GAP_INTERVALS,
    broker_backlog,
    install_watchdog,
    sweep_name,
)

log = logging.getLogger("onceflow.flow")

# A wake-up that cannot be published quickly is left to the sweeper, not retried for long.
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2, "interval_max": 0.5}

F = TypeVar("F", bound=StageFunc)


class Flow:
    """A set of stages bound to one Celery app and one queue (built lazily per process)."""

    def __init__(
        self,
        app: Celery | None = None,
        *,
        settings: Settings | None = None,
        name: str = "onceflow",
        pull_worker_classes: tuple[str, ...] = (),
    ) -> None:
        """``pull_worker_classes``: worker classes served only by pull workers over HTTP
        (browser tabs, agents): their requests get no Celery wake-up, which no Celery
        worker would consume."""
        self._settings = settings
        self.pull_worker_classes = frozenset(
            check_worker_class(wc, name="pull worker class") for wc in pull_worker_classes
        )
        self.stages: dict[str, StageSpec] = {}
        #: Whether the app is yours (``Flow(app=…)``): its settings are then left to you.
        self.guest = app is not None
        self.app = app or Celery(name, set_as_current=False)
        # A hostile or malformed broker message (or a wrong-typed key) must not stop a worker.
        harden(self.app)
        #: The Flow's name (its Celery app's main name): with its stages, the key of its
        #: row in ``onceflow_sweeps``.
        self.name = (app.main if app is not None else None) or name
        #: Where beat sends this Flow's sweeps and its workers take them from: Flows on one
        #: broker must differ in name (as in worker classes) so none takes another's sweeps.
        self.maintenance_queue = maintenance_queue_for(self.name)
        # Evaluated when Celery first reads its config, not at import: nothing connects early.
        if self.guest:
            # Your app: your settings stay yours (docs/celery.md, "Your own Celery app").
            self.app.add_defaults(
                guest_defaults(self.app, lambda: self.settings, self.maintenance_queue)
            )
        else:
            self.app.add_defaults(
                lambda: celery_config(self.settings, maintenance_queue=self.maintenance_queue)
            )
        self._queue: tuple[int, Queue] | None = None
        #: pid -> the lock that builds that process's queue (see :meth:`_queue_lock`).
        self._locks: dict[int, threading.Lock] = {}
        flow = self

        # shared=False here and for stages: Celery would otherwise add this Flow's tasks to
        # every app of the process, and with two Flows one app's `onceflow.sweep` would be
        # the other Flow's (the first registered wins).
        @self.app.task(name=SWEEP_TASK, shared=False, flow=self, **TASK_OPTIONS)
        def sweep() -> dict[str, Any]:
            # Beat sends one per interval; one that arrives within half an interval of the
            # last sweep (database clock) — e.g. late, behind others — does nothing.
            gap = BEAT_GAP_INTERVALS * flow.settings.sweep_interval_seconds
            result = flow.sweep_if_due(gap, by=f"beat@{worker_id()}")
            if result is None:
                return {"skipped": True}
            return {
                "rescued": len(result.rescued),
                "quarantined": len(result.quarantined),
                "overran": len(result.overran),
                "dispatched": len(result.to_dispatch),
                "pruned": result.pruned,
            }

        # Every worker of this Flow keeps the sweeper alive when beat is not running.
        install_watchdog(self)

    @property
    def settings(self) -> Settings:
        """The settings given, or the environment's."""
        return self._settings or get_settings()

    @property
    def queue(self) -> Queue:
        """This process's :class:`Queue` (rebuilt after a fork). Building it installs the
        spend ledger's default hooks (:func:`onceflow.spend.defaults.install_ledger`)."""
        pid = os.getpid()
        current = self._queue
        if current is None or current[0] != pid:
            with self._queue_lock():
                current = self._queue
                if current is None or current[0] != pid:
                    current = (pid, Queue(settings=self.settings, resolver=self.resolve))
                    self._queue = current
                    # This process runs stages or serves their API: its providers record
                    # to the spend ledger (ONCEFLOW_SPEND_LEDGER).
                    install_ledger(self._settings)  # None: the environment's, as they change
        return current[1]

    def _queue_lock(self) -> threading.Lock:
        """This process's lock for building its queue. A forked child gets a lock of its
        own: one held at the fork by another thread of the parent (the sweep watchdog of a
        prefork worker's main process) would never be released in the child, and its
        first :attr:`queue` would wait forever."""
        pid = os.getpid()
        lock = self._locks.get(pid)
        if lock is None:
            lock = self._locks.setdefault(pid, threading.Lock())
        return lock

    @property
    def broker_url(self) -> str:
        """The broker this Flow's app publishes to, as far as it is known now: the app's
        ``broker_url`` once its configuration is loaded, else onceflow's broker
        (:func:`~onceflow.tasks.config.effective_broker_url`). Reading it loads nothing."""
        if self.app.configured:
            url = self.app.conf.broker_url
            if isinstance(url, str) and url:
                return url
        return effective_broker_url(self.settings)

    def stage(
        self,
        name: str,
        *,
        input: type[BaseModel],
        worker_class: str = "default",
        dedupe: bool = True,
        lease_seconds: float | None = None,
        max_attempts: int | None = None,
        max_crash_attempts: int | None = None,
        max_runtime: float | None = None,
        priority: int = 0,
        retry_on: tuple[type[BaseException], ...] | None = None,
        alternate_worker_classes: tuple[str, ...] = (),
        sub_docs: tuple[str, ...] | None = None,
        hands_off_to: tuple[str, ...] | None = None,
        on_budget: OnBudget = None,
    ) -> Callable[[F], F]:
        """Declare a stage; the decorated function is its body: ``body(ctx, input) -> JSON``.

        ``max_runtime`` (seconds; ``ONCEFLOW_MAX_RUNTIME_SECONDS`` by default) bounds one
        run: heartbeats stop extending the lease past it (database clock), Celery's soft
        time limit raises in the body then and its hard limit kills it a little later;
        the hard limit must stay below the broker's visibility timeout (Redis) or
        RabbitMQ's ``consumer_timeout`` (``ONCEFLOW_BROKER_CONSUMER_TIMEOUT_SECONDS``).

        ``worker_class`` (1 to 100 of ``A-Z a-z 0-9 _ . -``) names the broker queue
        ``onceflow.wc.<worker_class>``. A caller of :meth:`enqueue` (or of the HTTP API)
        may route a request elsewhere only to one of ``alternate_worker_classes`` (say,
        a pull-worker class of browser tabs); any other class is refused.

        ``sub_docs`` (templates over the claimed request: ``{workspace_id}``,
        ``{job_id}``, ``{request_id}``, ``{stage}``, and a trailing ``*`` for a prefix)
        are the sub-docs a claim of this stage may read and write; undeclared, the job's
        own, ``job:{job_id}`` and ``job:{job_id}:*``. ``hands_off_to`` names the stages a
        completion of this stage may hand off to; undeclared, a pull worker's completion
        (HTTP) may hand off to none. The HTTP claim routes hold every pull worker to both;
        a stage body run here (``ctx``) is held to what is declared.

        ``on_budget`` says what a run does when a workspace's budget refuses one of its
        provider calls (``BudgetExceeded``, from ``ctx.permit`` or any permit it takes):
        ``"fail"`` — dead at once; ``"wait"`` — retried when the budget's period turns,
        the attempt not counted; None (the default) — what the budget's ``on_exceeded``
        says.
        """
        check_id("stage", name)
        check_worker_class(worker_class)
        budget_choice = check_on_budget(on_budget)
        if isinstance(alternate_worker_classes, str):
            raise InvalidRequest("alternate_worker_classes must be a tuple of worker classes")
        alternates = tuple(
            check_worker_class(wc, name="alternate worker class") for wc in alternate_worker_classes
        )
        if name in self.stages:
            raise InvalidRequest(f"stage {name!r} is declared twice")
        scope = SubDocScope.of(name, sub_docs)
        targets = _hand_off_targets(name, hands_off_to)
        if not (isinstance(input, type) and issubclass(input, BaseModel)):
            raise InvalidRequest("input= must be a pydantic model class")
        runtime = self.settings.max_runtime_seconds if max_runtime is None else max_runtime
        if isinstance(runtime, bool) or not isinstance(runtime, int | float) or runtime <= 0:
            raise InvalidRequest("max_runtime must be a positive number of seconds")
        soft, hard = time_limits(float(runtime))
        what, bound = redelivery_bound(self.settings, self.broker_url)
        if hard >= bound:
            raise InvalidRequest(
                f"stage {name!r}: max_runtime {runtime:g} s gives a hard time limit of "
                f"{hard:g} s, not below {what} ({bound:g} s): "
                "the broker would redeliver the wake-up of a run still in progress"
            )

        # StageSpec by keyword on purpose (alike by shape to SQL column lists): each option by name.
        def register(func: F) -> F:
            spec = StageSpec(
                name=name,
                func=func,
                input_model=input,
                worker_class=worker_class,
                dedupe=dedupe,
                lease_seconds=lease_seconds,
                max_attempts=max_attempts,
                max_crash_attempts=max_crash_attempts,
                max_runtime=float(runtime),
                priority=priority,
                retry_on=retry_on,
                alternate_worker_classes=alternates,
                sub_docs=scope,
                sub_docs_declared=sub_docs is not None,
                hands_off_to=targets,
                on_budget=budget_choice,
            )
            self.stages[name] = spec
            self.app.task(
                name=spec.task_name,
                base=StageTask,
                bind=True,
                shared=False,  # this Flow's app only (see the sweep task)
                flow=self,
                spec=spec,
                # No `queue=` (deprecated by Celery, and it would beat task_routes): the
                # queue is chosen per wake-up (onceflow.tasks.routing).
                soft_time_limit=soft,
                time_limit=hard,
            )(task_body)
            return func

        return register

    # The enqueue signature repeats in each public entry point on purpose; all build via resolve.
    def enqueue(
        self,
        stage: str,
        workspace_id: str,
        job_id: str,
        branch_path: str = "",
        input: Any = None,
        *,
        priority: int | None = None,
        strict: bool = False,
        worker_class: str | None = None,
        dedupe: bool | None = None,
    ) -> EnqueueResult:
        """Validate ``input`` against the stage's model, commit the row, then send the wake-up.

        A duplicate that collapsed onto an existing row sends nothing. If the send
        fails the row stays queued and the sweeper sends it; the caller gets its
        request back either way.
        """
        item = self._unresolved(
            stage,
            workspace_id,
            job_id,
            branch_path,
            input,
            priority=priority,
            worker_class=worker_class,
            dedupe=dedupe,
        )
        # Resolved (the input validated) once, by the queue's resolver — this Flow's
        # resolve — before anything is written: not here and there again.
        [result] = self.queue.enqueue_many([item], strict=strict)
        if result.created:
            self.dispatch(
                Dispatch(result.request_id, stage, result.worker_class, result.workspace_id)
            )
        return result

    def wait(self, request_id: str, *, timeout: float, workspace_id: str | None = None) -> Request:
        """The request once it has ended (succeeded, dead or cancelled): :meth:`Queue.wait
        <onceflow.queue.done.DoneWaiter.wait>` on this Flow's queue — what Celery's
        ``AsyncResult.get()`` is to a task, woken by the database rather than by polling.

        Raises :class:`~onceflow.errors.WaitTimeout` when ``timeout`` seconds pass first,
        :class:`~onceflow.errors.NotFound` for no such request.
        """
        return self.queue.wait(request_id, timeout=timeout, workspace_id=workspace_id)

    # Same signature as enqueue and _unresolved on purpose: each is typed for its callers.
    def new_request(
        self,
        stage: str,
        workspace_id: str,
        job_id: str,
        branch_path: str = "",
        input: Any = None,
        **options: Any,
    ) -> NewRequest:
        """The request ``stage``'s declaration makes: see :meth:`resolve`.

        ``options`` are :class:`NewRequest` fields (``worker_class``, ``priority``,
        ``max_attempts``, …); ``None`` means "as declared".
        """
        return self.resolve(
            self._unresolved(stage, workspace_id, job_id, branch_path, input, **options)
        )

    # Same signature as new_request on purpose: the one place the caller's request is built.
    @staticmethod
    def _unresolved(
        stage: str,
        workspace_id: str,
        job_id: str,
        branch_path: str = "",
        input: Any = None,
        **options: Any,
    ) -> NewRequest:
        """The request as the caller gave it, before :meth:`resolve` completes it."""
        try:
            item = NewRequest(
                workspace_id=workspace_id,
                job_id=job_id,
                stage=stage,
                branch_path=branch_path,
                input={} if input is None else input,
                **{k: v for k, v in options.items() if v is not None},
            )
        except TypeError as exc:  # an unknown option name
            raise InvalidRequest(f"request for stage {stage!r}: {exc}") from None
        return item

    def resolve(self, item: NewRequest) -> NewRequest:
        """The one builder every entry point uses (enqueue, ``ctx.then``, hand-offs over
        HTTP, Django, the CLI, MCP): ``item`` completed from its stage's declaration.

        Unset fields (``None``) take the declared worker class, dedupe, priority,
        max attempts and crash budget; the input is validated against the stage's
        model. An undeclared stage raises :class:`UnknownStage`, an input that does
        not fit or a worker class the stage does not declare :class:`InvalidRequest` —
        before anything is written.
        """
        spec = self.spec(item.stage)
        if item.worker_class is not None and item.worker_class not in spec.worker_classes:
            shown = item.worker_class[:40] if isinstance(item.worker_class, str) else "?"
            raise InvalidRequest(
                f"stage {spec.name!r} is served by worker class "
                f"{' or '.join(repr(wc) for wc in spec.worker_classes)} (its declaration), "
                f"not {shown!r}"
            )
        # Before the model converts it (it would turn NaN into null): depth, NaN, NUL, ….
        what = f"input of stage {spec.name!r}"
        check_json(item.input, what=what, max_depth=self.settings.max_payload_depth)
        dedupe = spec.dedupe if item.dedupe is None else item.dedupe
        request_id = item.request_id
        if request_id is None and not dedupe:
            # Minted here, once: a hand-off repeated after a lost answer names the same row.
            request_id = random_request_id()
        return replace(
            item,
            request_id=request_id,
            input=self.validate_input(spec, item.input),
            worker_class=spec.worker_class if item.worker_class is None else item.worker_class,
            dedupe=dedupe,
            priority=spec.priority if item.priority is None else item.priority,
            max_attempts=spec.max_attempts if item.max_attempts is None else item.max_attempts,
            max_crash_attempts=(
                spec.max_crash_attempts
                if item.max_crash_attempts is None
                else item.max_crash_attempts
            ),
        )

    def spec(self, stage: str) -> StageSpec:
        """The declared stage ``stage``, or :class:`UnknownStage`."""
        try:
            return self.stages[stage]
        except (KeyError, TypeError):
            raise UnknownStage(str(stage)) from None

    def sub_doc_scope(self, stage: str) -> SubDocScope:
        """The sub-docs a claim of ``stage`` may read and write (its declaration's, or its
        job's by default); none for a stage this Flow does not declare."""
        found = self.stages.get(stage)
        if found is None:
            return SubDocScope.nothing(stage)
        return found.sub_docs or SubDocScope.of(stage, None)

    def check_hand_offs(self, stage: str, targets: Sequence[str], *, declared_only: bool) -> None:
        """Raise :class:`OutOfScope` unless ``stage`` may hand off to every one of ``targets``.

        A stage's ``hands_off_to`` permits; undeclared, ``declared_only`` (a pull worker's
        completion) permits none, else (a stage body in this process) any.
        """
        found = self.stages.get(stage)
        allowed = None if found is None else found.hands_off_to
        if allowed is None and not declared_only:
            return
        for target in targets:
            if allowed is None or target not in allowed:
                permitted = ", ".join(allowed) if allowed else "none"
                raise OutOfScope(
                    f"stage {stage!r} may not hand off to {target!r} (hands_off_to: "
                    f"{permitted}); a stage declares its targets with "
                    "Flow.stage(..., hands_off_to=...)"
                )

    def check_declarations(self) -> None:
        """Raise :class:`InvalidRequest` if a stage's ``hands_off_to`` names a stage this Flow
        does not declare (a typo): run when an app or worker starts, with every stage known."""
        for spec in self.stages.values():
            for target in spec.hands_off_to or ():
                if target not in self.stages:
                    raise InvalidRequest(
                        f"stage {spec.name!r}: hands_off_to names {target!r}, which is not a "
                        f"declared stage (declared: {', '.join(sorted(self.stages))})"
                    )

    @staticmethod
    def validate_input(spec: StageSpec, value: Any) -> Any:
        """``value`` checked against the stage's model, as JSON data; a clear error if not."""
        try:
            model = spec.input_model.model_validate({} if value is None else value)
        except ValidationError as exc:
            summary = validation_summary(exc)
            raise InvalidRequest(f"input of stage {spec.name!r} is invalid: {summary}") from None
        return model.model_dump(mode="json")

    def dispatch(self, item: Dispatch, *, kind: str = "first") -> bool:
        """Send the wake-up for one request; False (and logged) if the broker refused.

        Requests of a pull-worker class get none: pull workers claim by polling the API.
        ``kind`` (metrics): ``first``, or ``resent`` by the sweeper.
        """
        if item.worker_class in self.pull_worker_classes:
            return False
        try:
            check_worker_class(item.worker_class)
        except InvalidRequest:
            # A row stored before worker classes were checked (docs/security.md,
            # "Upgrading"): no queue of onceflow's can carry it. Not marked unsent, so the
            # sweeper tries again only after the redispatch interval, not every sweep.
            log.error(
                "request %s: worker class %r is not one onceflow can route to; "
                "re-route the row to its stage's class (docs/security.md, 'Upgrading')",
                item.request_id,
                item.worker_class[:40] if isinstance(item.worker_class, str) else None,
            )
            return False
        try:
            # The request's key: a worker claims by it (and, sharded, finds the row's shard).
            args = (
                [item.request_id]
                if item.workspace_id is None
                else [item.request_id, item.workspace_id]
            )
            with _in_trace(item.trace_context):
                self.app.send_task(
                    TASK_PREFIX + item.stage,
                    args=args,
                    retry=True,
                    retry_policy=PUBLISH_RETRY,
                    serializer="json",  # whatever the app's task_serializer
                    **send_options(self.app, item.stage, item.worker_class, args),
                )
        except InvalidRedisUrl:  # a configuration error (a Redis Cluster as the broker)
            with contextlib.suppress(OnceflowError):
                self.queue.mark_undispatched(item.request_id, workspace_id=item.workspace_id)
            raise
        except Exception as exc:  # kombu/redis errors: the row is durable, the sweeper resends
            log.warning(
                "request %s: wake-up not sent (%s); the sweeper will send it", item.request_id, exc
            )
            with contextlib.suppress(OnceflowError):
                self.queue.mark_undispatched(item.request_id, workspace_id=item.workspace_id)
            return False
        metrics.wakeup(item.worker_class, kind)
        return True

    @property
    def sweep_name(self) -> str:
        """This Flow's row in ``onceflow_sweeps``: its name and the stages it declares."""
        return sweep_name(self.name, list(self.stages))

    def sweep_once(
        self, *, redispatch_after: float | None = None, now: datetime | None = None
    ) -> SweepResult:
        """Sweep now (and record it, so watchdogs and late beat sweeps stand down).

        Rescues lapsed leases and sends wake-ups — only for the stages this Flow
        declares, the only ones it can send — re-sending a wake-up only when it cannot
        be waiting in the broker (see :meth:`Queue.due_for_dispatch`); prunes per the
        retention settings. ``now`` injects the database time (tests).
        """

        def one(shard: Queue) -> SweepResult:
            shard.begin_sweep(self.sweep_name, f"call@{worker_id()}", min_gap=0)
            return self._sweep_shard(shard, redispatch_after=redispatch_after, now=now)

        return self._per_shard(one)

    def sweep_if_due(self, min_gap: float, *, by: str) -> SweepResult | None:
        """Sweep unless a sweep of this Flow began less than ``min_gap`` seconds ago.

        Decided by a compare-and-set on the database clock, never this process's clock;
        of several callers at once, one sweeps. None when it did not sweep. On a
        database split by workspace each shard holds its own election and is swept on
        its own (a shard that is down stalls only its own workspaces).
        """
        won: list[bool] = []

        def one(shard: Queue) -> SweepResult:
            if not shard.begin_sweep(self.sweep_name, by, min_gap=min_gap).won:
                return SweepResult([], [], [])
            won.append(True)
            return self._sweep_shard(shard)

        result = self._per_shard(one)
        return result if won else None

    def run_sweep(
        self, *, redispatch_after: float | None = None, now: datetime | None = None
    ) -> SweepResult:
        """One sweep, without recording it (callers record it: :meth:`sweep_once`).

        Each batch of wake-ups is sent right after the statement that marked its rows
        dispatched; the prunes (the queue's, then the op log's) come last and a failing
        one is logged, never allowed to cost a wake-up or fail the sweep.
        """
        return self._per_shard(
            lambda shard: self._sweep_shard(shard, redispatch_after=redispatch_after, now=now)
        )

    def _per_shard(self, sweep: Callable[[Queue], SweepResult]) -> SweepResult:
        """``sweep`` of each shard's queue (the queue itself on one database), merged. With
        several shards, one that fails is logged and left for the next sweep while the
        others are swept; the error is raised only if every shard failed."""
        shards = self.queue.shards()
        if len(shards) == 1:
            return sweep(shards[0])
        done, _ = each_shard(
            shards,
            sweep,
            lambda index, exc: log.warning(
                "sweep: shard %d skipped this time: %s: %s", index, type(exc).__name__, exc
            ),
        )
        return SweepResult(
            rescued=[r for d in done for r in d.rescued],
            quarantined=[r for d in done for r in d.quarantined],
            to_dispatch=[r for d in done for r in d.to_dispatch],
            pruned=sum(d.pruned for d in done),
            overran=[r for d in done for r in d.overran],
        )

    def _sweep_shard(
        self, queue: Queue, *, redispatch_after: float | None = None, now: datetime | None = None
    ) -> SweepResult:
        """One sweep of one database (traced as ``onceflow.sweep``, its rescues each in
        its row's trace: :func:`~onceflow.queue.sweep.traced_sweep`)."""
        result = traced_sweep(
            lambda: queue.sweep_once(
                redispatch_after=redispatch_after,
                stages=sorted(self.stages),
                backlog=self.broker_backlog,
                send=self._send_wakeups,
                now=now,
            )
        )
        self._write_rollup(queue, result, now)
        if self.settings.op_retention_seconds is not None:
            try:
                oplog_for(queue).prune(older_than_seconds=self.settings.op_retention_seconds)
            except Exception as exc:  # retention waits for the next sweep; nothing else does
                log.warning(
                    "sweep: op-log prune failed, tried again next sweep: %s: %s",
                    type(exc).__name__,
                    exc,
                )
        if result.rescued or result.quarantined:
            log.info(
                "sweep: %d rescued, %d quarantined, %d wake-ups",
                len(result.rescued),
                len(result.quarantined),
                len(result.to_dispatch),
            )
        return result

    def _write_rollup(self, queue: Queue, result: SweepResult, now: datetime | None) -> None:
        """The dashboard's per-minute rollup of this database (:mod:`onceflow.queue.series`) at
        the first sweep of each minute, with the Redis savings counters on the first
        database only (Redis is shared). A failure is logged: the rollup is written at the
        next sweep, nothing else waits."""

        def savings() -> dict[str, Any] | None:
            try:
                return read_savings(oplog_for(queue).redis())
            except REDIS_OR_OS_ERRORS as exc:
                log.info("sweep: savings counters not read: %s: %s", type(exc).__name__, exc)
                return None

        try:
            write_rollup(
                queue.engine, result=result,
                savings=savings if queue is self.queue.shards()[0] else None,
                retention_seconds=self.settings.retention_seconds, once_a_minute=True,
                now=now,
            )  # fmt: skip
        except Exception as exc:  # any error: the next sweep recomputes the minutes
            log.warning(
                "sweep: dashboard rollup failed, written next sweep: %s: %s",
                type(exc).__name__,
                exc,
            )

    def _send_wakeups(self, batch: Sequence[Dispatch]) -> None:
        """A sweep's sender: the rows are already marked dispatched (a failed send unmarks)."""
        for item in batch:
            self.dispatch(item, kind="resent")

    def broker_backlog(self, worker_classes: Sequence[str]) -> dict[str, int] | None:
        """Messages waiting in the broker per worker class (None: the broker cannot tell).

        Pull-worker classes get no messages: 0.
        """
        celery_classes = [wc for wc in worker_classes if wc not in self.pull_worker_classes]
        queues = {wc: self._routed_queues([wc]) for wc in celery_classes}
        waiting = broker_backlog(self.app, queues) if celery_classes else {}
        if waiting is None:
            return None
        return {wc: waiting.get(wc, 0) for wc in worker_classes}

    def queues(self) -> list[str]:
        """The worker classes of the declared stages (alternates included), pull classes
        excepted: the classes Celery workers of this Flow serve."""
        classes = {wc for spec in self.stages.values() for wc in spec.worker_classes}
        return sorted(classes - self.pull_worker_classes)

    def broker_queues(self, worker_classes: Sequence[str] | None = None) -> list[str]:
        """The broker queues a worker of ``worker_classes`` (default: :meth:`queues`)
        consumes: ``onceflow.wc.<class>`` each, the Flow's maintenance queue, and with
        ``ONCEFLOW_LEGACY_QUEUES`` the classes' old unprefixed queues too (upgrades)."""
        classes = list(self.queues() if worker_classes is None else worker_classes)
        names = [queue_name(wc) for wc in classes]
        names += [q for q in self._routed_queues(classes) if q not in names]
        if self.settings.legacy_queues:
            names += [wc for wc in classes if wc not in names]
        return [*names, self.maintenance_queue]

    def _routed_queues(self, worker_classes: Sequence[str]) -> list[str]:
        """The queues the wake-ups of ``worker_classes`` go to: each class's
        ``onceflow.wc.<class>``, or where the app's ``task_routes`` sends a stage's."""
        out: list[str] = []
        classes = set(worker_classes)
        for wc in worker_classes:
            with contextlib.suppress(InvalidRequest):
                out.append(queue_name(wc))
        for spec in self.stages.values():
            for wc in classes.intersection(spec.worker_classes):
                with contextlib.suppress(InvalidRequest):
                    routed = routed_queue(self.app, spec.name, wc)
                    if routed is not None and routed not in out:
                        out.append(routed)
        return out


__all__ = ["MAINTENANCE_QUEUE", "Flow", "StageSpec", "StageTask", "worker_id"]


@contextlib.contextmanager
def _in_trace(stored: str | None) -> Iterator[None]:
    """The trace context ``stored`` with a row current in the block (a sweeper's re-send):
    Celery's own instrumentation, where installed, sends the wake-up in the row's trace,
    so the task that runs it is there too. Nothing when tracing is off or none is stored."""
    parent = tracing.context_from(stored) if stored is not None and tracing.active() else None
    if parent is None:
        yield
        return
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


def _hand_off_targets(stage: str, targets: Sequence[str] | None) -> tuple[str, ...] | None:
    """``hands_off_to`` checked: a tuple of stage names (their existence is checked once
    every stage is declared: :meth:`Flow.check_declarations`)."""
    if targets is None:
        return None
    if isinstance(targets, str):
        raise InvalidRequest(f"stage {stage!r}: hands_off_to must be a tuple of stage names")
    return tuple(check_id("hands_off_to stage", t) for t in targets)
