"""Running a :class:`~onceflow.tasks.Flow`'s stages inline, in a test's own process.

What Celery's ``task_always_eager`` gives a task, for a Flow — without a second set of
rules: :func:`run_until_idle` claims the due requests of the Flow's stages from the real
(test) database, one at a time and in the order a worker claims them
(:meth:`Queue.claim_next <onceflow.queue.claims.ClaimOps.claim_next>`: worker class by
worker class, priority then due time), runs each body here through the path the Celery
stage task runs (:func:`onceflow.tasks.runtime.run_claimed`: the same
:class:`~onceflow.context.StageContext`, heartbeats, outcome table and fenced writes), and
goes on until nothing is due. So a hand-off (``ctx.then``) is enqueued with its stage's
completion and then run too; ops go through the op log; compute locks are taken in Redis.

::

    from onceflow.testing import run_until_idle

    flow.enqueue("evaluate", "ws-test", "job-1", "main", {"columns": ["fit"]})
    report = run_until_idle(flow, workspace_id="ws-test")
    assert report.outcomes() == {"succeeded": 2}

Rules:

* A request retried with a delay (:class:`~onceflow.errors.RetryLater`, the backoff) is
  not due yet: it is not waited for. It is listed in :attr:`RunReport.delayed` (its row,
  ``run_after`` included). ``include_delayed=True`` runs it anyway: once nothing is due,
  the next claim is made with the queue's clock moved to the latest ``run_after`` of the
  rows still queued (database time) — the claim statement's ``:now``, which every queue
  statement takes; no row is rewritten to make it due, and the claim order is the
  workers'. A run taken that way still counts as an attempt, so a body that keeps asking
  for a retry ends ``dead`` at its ``max_attempts``. With the clock moved, a request
  *running* elsewhere whose lease would have lapsed by then is taken over too (and the
  claim's lease runs from that time): keep a test's database to the test.
* ``max_runs`` bounds the runs of one call: past it, with requests still due (an endless
  hand-off chain), :class:`TooManyRuns` is raised, carrying the report so far.
* ``workspace_id`` limits the claims to one workspace (the filter is the claim's own);
  ``worker_classes`` to some of the Flow's worker classes (default: every class its
  stages declare, alternates included, in declaration order). A due request of one of
  those classes whose stage the Flow does not declare is handed back and raises
  :class:`UnknownStageDue`: no worker of this Flow could run it either.
* Hand-offs get no broker wake-up here (the runner claims them from the database);
  :meth:`Flow.enqueue <onceflow.tasks.Flow.enqueue>` sends its own as usual — no worker
  consumes it in a test, and with no broker reachable the row stays queued all the same.

For pytest, ``onceflow.testing.pytest_plugin`` (registered as the ``onceflow`` plugin)
gives the fixture ``onceflow_runner``; pytest is imported only by that module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from onceflow.errors import OnceflowError
from onceflow.models.requests import Claim, Request
from onceflow.queue import Queue, StageTerms
from onceflow.tasks import Flow
from onceflow.tasks.identity import worker_id
from onceflow.tasks.routing import TASK_PREFIX
from onceflow.tasks.runtime import run_claimed
from onceflow.tasks.stage_task import StageTask

#: The most delayed rows listed per stage.
DELAYED_LISTED = 1000


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a stage body: what the Celery stage task returns for it.

    ``outcome``: ``succeeded``, ``retry`` (queued again, after a delay or the backoff),
    ``dead``, ``cancelled`` — or, rarely, ``lease_lost`` / ``completion_unknown`` /
    ``failure_unknown`` as under a worker. ``detail``: the whole outcome mapping.
    """

    request_id: str
    workspace_id: str
    stage: str
    attempt: int
    outcome: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunReport:
    """What :func:`run_until_idle` ran, in order, and what it left queued for later."""

    runs: list[Run]
    #: Rows of the Flow's stages still queued once nothing was due (a retry delay, the
    #: backoff): their ``run_after`` says when they will be.
    delayed: list[Request]

    def outcomes(self, stage: str | None = None) -> dict[str, int]:
        """How many runs (of ``stage``, or of all) ended in each outcome."""
        return dict(Counter(r.outcome for r in self.runs if stage in (None, r.stage)))

    def of(self, request_id: str) -> list[Run]:
        """The runs of one request, in order."""
        return [r for r in self.runs if r.request_id == request_id]

    def summary(self) -> str:
        """One line: runs per outcome, and how many requests wait on a delay."""
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.outcomes().items()))
        return f"{len(self.runs)} run(s): {counts or 'none'}; {len(self.delayed)} delayed"


class TooManyRuns(OnceflowError):
    """``max_runs`` runs were made and requests are still due (an endless hand-off chain?)."""

    def __init__(self, max_runs: int, report: RunReport) -> None:
        last = ", ".join(r.stage for r in report.runs[-5:])
        super().__init__(
            f"run_until_idle made {max_runs} runs and requests are still due — a hand-off "
            f"chain that never ends? (last stages run: {last}); raise max_runs if the flow "
            "really needs more"
        )
        self.report = report


class UnknownStageDue(OnceflowError):
    """A due request of the Flow's worker classes is of a stage the Flow does not declare."""


def run_until_idle(
    flow: Flow,
    *,
    workspace_id: str | None = None,
    worker_classes: Sequence[str] | None = None,
    include_delayed: bool = False,
    max_runs: int = 1000,
) -> RunReport:
    """Run the due requests of ``flow``'s stages here, one at a time, until none is due.

    See the module's rules. Returns a :class:`RunReport`; raises :class:`TooManyRuns`
    past ``max_runs`` runs with requests still due.
    """
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
        raise ValueError("max_runs must be a positive integer")
    queue = flow.queue
    classes = list(worker_classes) if worker_classes is not None else flow_worker_classes(flow)
    tasks = {name: stage_task(flow, name) for name in flow.stages}
    terms = {
        name: StageTerms(queue.lease_for(t.spec.lease_seconds), t.spec.max_runtime)
        for name, t in tasks.items()
    }
    me = worker_id()
    runs: list[Run] = []

    def claim_at(now: datetime | None) -> list[Claim]:
        return queue.claim_next(
            classes,
            me,
            workspaces=None if workspace_id is None else [workspace_id],
            stage_terms=terms,
            now=now,
        )

    def next_claim() -> Claim | None:
        if not classes:
            return None
        claims = claim_at(None)
        if not claims and include_delayed:
            waiting = delayed(queue, tasks, workspace_id)
            if waiting:
                claims = claim_at(max(r.run_after for r in waiting))
        if not claims:
            return None
        claim = claims[0]
        if claim.request.stage not in tasks:
            queue.release([claim])
            raise UnknownStageDue(
                f"request {claim.request_id} (worker class {claim.request.worker_class!r}) "
                f"is of stage {claim.request.stage!r}, which this Flow does not declare; "
                "give run_until_idle a workspace_id or worker_classes to leave it out"
            )
        return claim

    while (claim := next_claim()) is not None:
        if len(runs) >= max_runs:
            queue.release([claim])
            raise TooManyRuns(max_runs, RunReport(runs, []))
        task = tasks[claim.request.stage]
        # dispatch=None: the hand-offs' rows are claimed by this loop, not woken by a broker.
        done = run_claimed(queue, task.spec, claim, me, task.spec_is_retryable, None)
        runs.append(
            Run(
                claim.request_id,
                claim.request.workspace_id,
                claim.request.stage,
                claim.attempt,
                str(done.get("outcome")),
                done,
            )
        )
    return RunReport(runs, delayed(queue, flow.stages, workspace_id))


def flow_worker_classes(flow: Flow) -> list[str]:
    """Every worker class ``flow``'s stages declare (alternates included), once each, in
    declaration order: the classes a worker serving the whole Flow claims from."""
    seen: dict[str, None] = {}
    for spec in flow.stages.values():
        seen.update(dict.fromkeys(spec.worker_classes))
    return list(seen)


def stage_task(flow: Flow, stage: str) -> StageTask:
    """The Celery task ``flow`` registered for ``stage``: its spec and retry rule."""
    task = flow.app.tasks[TASK_PREFIX + stage]
    if not isinstance(task, StageTask):  # pragma: no cover - a Flow registers only these
        raise TypeError(f"task {TASK_PREFIX + stage} is not a stage task")
    return task


def delayed(queue: Queue, stages: Iterable[str], workspace_id: str | None) -> list[Request]:
    """The queued rows of ``stages`` (in ``workspace_id``, if given): none was due."""
    rows: list[Request] = []
    for stage in stages:
        rows += queue.list(
            stage=stage, status="queued", workspace_id=workspace_id, limit=DELAYED_LISTED
        )
    return sorted(rows, key=lambda r: r.run_after)


__all__ = [
    "Run",
    "RunReport",
    "TooManyRuns",
    "UnknownStageDue",
    "flow_worker_classes",
    "run_until_idle",
]
