"""onceflow: each stage runs once, each expensive call is paid once, each write applies once.

Layer 1 (this release): :class:`Queue`, the durable stage queue on Postgres.
Nothing here connects at import time.
"""

from onceflow.errors import (
    DatabaseUnavailable,
    InputMismatch,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    NotFound,
    OnceflowError,
    PayloadTooLarge,
    RetryLater,
    StoreError,
)
from onceflow.ids import request_id_for
from onceflow.models import Claim, EnqueueResult, Heartbeat, NewRequest, Request, Status
from onceflow.queue import Queue
from onceflow.settings import Settings, get_settings

__version__ = "0.1.0"

__all__ = [
    "Claim",
    "DatabaseUnavailable",
    "EnqueueResult",
    "Heartbeat",
    "InputMismatch",
    "InvalidRequest",
    "InvalidTransition",
    "LeaseLost",
    "NewRequest",
    "NotFound",
    "OnceflowError",
    "PayloadTooLarge",
    "Queue",
    "Request",
    "RetryLater",
    "Settings",
    "Status",
    "StoreError",
    "get_settings",
    "request_id_for",
]
