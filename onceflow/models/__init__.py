"""Tables and the typed values of onceflow (imports none of the other sub-packages)."""

from onceflow.models.attempts import workspace_request_attempts
from onceflow.models.cache import result_cache, result_cache_global
from onceflow.models.locks import compute_locks as compute_locks
from onceflow.models.requests import (
    Claim,
    ClaimRef,
    Dispatch,
    EnqueueResult,
    Fence,
    Heartbeat,
    NewRequest,
    Request,
    SweepResult,
)
from onceflow.models.scopes import WorkspaceScope
from onceflow.models.series import (
    onceflow_series,
    onceflow_series_savings,
    onceflow_series_spend,
)
from onceflow.models.spend import spend_budgets, spend_ledger, spend_reservations
from onceflow.models.status import Status, parse_status
from onceflow.models.subdocs import workspace_sub_doc_ops, workspace_sub_docs
from onceflow.models.tables import metadata, workspace_process_requests

__all__ = [
    "Claim",
    "ClaimRef",
    "Dispatch",
    "EnqueueResult",
    "Fence",
    "Heartbeat",
    "NewRequest",
    "Request",
    "Status",
    "SweepResult",
    "WorkspaceScope",
    "metadata",
    "onceflow_series",
    "onceflow_series_savings",
    "onceflow_series_spend",
    "parse_status",
    "result_cache",
    "result_cache_global",
    "spend_budgets",
    "spend_ledger",
    "spend_reservations",
    "workspace_process_requests",
    "workspace_request_attempts",
    "workspace_sub_doc_ops",
    "workspace_sub_docs",
]
