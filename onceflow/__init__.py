"""onceflow: each stage runs once, each expensive call is paid once, each write applies once.

Layer 1: :class:`Queue`, the durable stage queue on Postgres (stages on Celery in
:mod:`onceflow.tasks`). Layer 2: :func:`compute_once`, the compute lock. Layer 3:
:class:`OpLog` and the retry-safe :class:`WorkspaceClient` (asyncio: :class:`AsyncQueue`,
:func:`acompute_once`, :class:`AsyncOpLog`, :class:`AsyncWorkspaceClient`). Spend control:
:class:`Provider` (limits shared by every process) and :class:`Cascade` (:mod:`onceflow.spend`).
Nothing here connects at import time.
"""

from onceflow.cache import CacheKey
from onceflow.errors import (
    BudgetExceeded,
    ConnectionLost,
    DatabaseUnavailable,
    InputMismatch,
    InvalidDatabaseUrl,
    InvalidRedisUrl,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    LockLost,
    LockUnavailable,
    NotFound,
    NotMigrated,
    OnceflowError,
    OpIdConflict,
    PartitionLayoutMismatch,
    PayloadTooDeep,
    PayloadTooLarge,
    RetryLater,
    StoreError,
    WaitTimeout,
)
from onceflow.ids import request_id_for
from onceflow.locks import acompute_once, compute_once
from onceflow.models import Claim, ClaimRef, EnqueueResult, Heartbeat, NewRequest, Request, Status
from onceflow.oplog import AsyncOpLog, AsyncWorkspaceClient, OpLog, WorkspaceClient
from onceflow.queue import AsyncQueue, Queue
from onceflow.settings import Settings, get_settings
from onceflow.spend import Cascade, Price, Provider, Usage
from onceflow.worker_tokens import mint_worker_token

__version__ = "0.1.0"

__all__ = [
    "AsyncOpLog",
    "AsyncQueue",
    "AsyncWorkspaceClient",
    "BudgetExceeded",
    "CacheKey",
    "Cascade",
    "Claim",
    "ClaimRef",
    "ConnectionLost",
    "DatabaseUnavailable",
    "EnqueueResult",
    "Heartbeat",
    "InputMismatch",
    "InvalidDatabaseUrl",
    "InvalidRedisUrl",
    "InvalidRequest",
    "InvalidTransition",
    "LeaseLost",
    "LockLost",
    "LockUnavailable",
    "NewRequest",
    "NotFound",
    "NotMigrated",
    "OnceflowError",
    "OpIdConflict",
    "OpLog",
    "PartitionLayoutMismatch",
    "PayloadTooDeep",
    "PayloadTooLarge",
    "Price",
    "Provider",
    "Queue",
    "Request",
    "RetryLater",
    "Settings",
    "Status",
    "StoreError",
    "Usage",
    "WaitTimeout",
    "WorkspaceClient",
    "acompute_once",
    "compute_once",
    "get_settings",
    "mint_worker_token",
    "request_id_for",
]
