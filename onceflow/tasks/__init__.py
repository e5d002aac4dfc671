"""The Celery side: stages as tasks, leases held by heartbeats, fenced completion, the sweeper.

The Postgres table stays the source of truth; a Celery message carries only a
request id and is a wake-up: a duplicated, redelivered, late or lost message never
forks or loses work.
"""

from onceflow.context import StageContext, WorkContext
from onceflow.tasks.config import MAINTENANCE_QUEUE, SWEEP_TASK, celery_config
from onceflow.tasks.flow import Flow, StageSpec, StageTask, worker_id

__all__ = [
    "MAINTENANCE_QUEUE",
    "SWEEP_TASK",
    "Flow",
    "StageContext",
    "StageSpec",
    "StageTask",
    "WorkContext",
    "celery_config",
    "worker_id",
]
