"""A client process that queues ops offline, then dies mid-replay (the test kills it)."""

from __future__ import annotations

import sys
import time
from typing import Any

from onceflow.models.ops import NodeInsert, NodeMove
from onceflow.oplog import ApplyResult, InProcessTransport, OpLog, WorkspaceClient


class HangAfterCommit:
    """Forwards the op (the server commits it), then never answers: the process is killed."""

    def __init__(self, inner: InProcessTransport) -> None:
        self.inner = inner

    def apply(self, *args: Any) -> ApplyResult:
        result = self.inner.apply(*args)
        print(f"COMMITTED {result.op_id} {result.clock}", flush=True)
        while True:
            time.sleep(60)


def main() -> None:
    database_url, outbox = sys.argv[1], sys.argv[2]
    client = WorkspaceClient(HangAfterCommit(InProcessTransport(OpLog(database_url))), "w1",
                             outbox=outbox)  # fmt: skip
    ops = [
        NodeMove(node="d", after=None),
        NodeInsert(node="e", after="a"),
        NodeMove(node="b", after="e"),
        NodeInsert(node="f", after=None),
        NodeMove(node="a", after="f"),
    ]
    for op in ops:  # offline: stored in the outbox, nothing sent yet
        client.apply("board", op, send=False)
    print("QUEUED", flush=True)
    client.replay()


if __name__ == "__main__":
    main()
