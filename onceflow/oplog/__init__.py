"""Layer 3: the op log — writes applied once by op id, with gapless commit clocks."""

from onceflow.oplog.client import (
    AsyncInProcessTransport,
    AsyncTransport,
    AsyncWorkspaceClient,
    InProcessTransport,
    OpsParked,
    Transport,
    TransportError,
    WorkspaceClient,
)
from onceflow.oplog.store import (
    ApplyResult,
    AsyncOpLog,
    OpLog,
    OpRecord,
    SubDoc,
    check_op_id,
    new_op_id,
    stage_op_id,
)

__all__ = [
    "ApplyResult",
    "AsyncInProcessTransport",
    "AsyncOpLog",
    "AsyncTransport",
    "AsyncWorkspaceClient",
    "InProcessTransport",
    "OpLog",
    "OpRecord",
    "OpsParked",
    "SubDoc",
    "Transport",
    "TransportError",
    "WorkspaceClient",
    "check_op_id",
    "new_op_id",
    "stage_op_id",
]
