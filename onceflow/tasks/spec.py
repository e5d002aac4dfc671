"""A declared stage: what :meth:`Flow.stage <onceflow.tasks.Flow.stage>` records about it.

Read by the Flow that declares it, by the Celery task that runs it and by the stage
lifecycle (:mod:`onceflow.tasks.runtime`); it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from onceflow.context import StageContext
from onceflow.lifecycle.outcome import OnBudget
from onceflow.models.sub_doc_scope import SubDocScope
from onceflow.tasks.routing import TASK_PREFIX

#: A stage's body: ``body(ctx, input) -> JSON``.
StageFunc = Callable[[StageContext, Any], Any]


@dataclass(frozen=True)
class StageSpec:
    """A declared stage: its body, input model and queue options."""

    name: str
    func: StageFunc
    input_model: type[BaseModel]
    worker_class: str
    dedupe: bool
    lease_seconds: float | None
    max_attempts: int | None
    max_crash_attempts: int | None
    priority: int
    retry_on: tuple[type[BaseException], ...] | None
    max_runtime: float | None = None  # seconds; None: no bound on the lease
    #: Other worker classes a caller may name for this stage (e.g. a pull-worker class).
    alternate_worker_classes: tuple[str, ...] = ()
    #: The sub-docs its claims may read and write (declared, or the job's by default).
    sub_docs: SubDocScope | None = None
    #: Whether ``sub_docs`` was declared (a stage body in this process is then held to it).
    sub_docs_declared: bool = False
    #: The stages it may hand off to; None: not declared (a pull worker may hand off to
    #: none, a stage body in this process to any).
    hands_off_to: tuple[str, ...] | None = None
    #: What a budget refusal (``BudgetExceeded``) does: ``"fail"``, ``"wait"``, or None
    #: (the budget's own ``on_exceeded``).
    on_budget: OnBudget = None

    @property
    def worker_classes(self) -> tuple[str, ...]:
        """Every worker class that may serve this stage: the declared one first."""
        return (self.worker_class, *self.alternate_worker_classes)

    @property
    def task_name(self) -> str:
        """The Celery task name (what Flower shows)."""
        return TASK_PREFIX + self.name
