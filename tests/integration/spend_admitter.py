"""A process that admits spend permits against one workspace's budget (the concurrent
budget test starts several): each waits at the barrier, then asks for ``n`` permits of
``tokens`` estimated tokens and reports how many were admitted."""

from __future__ import annotations

import uuid
from typing import Any

from onceflow.errors import BudgetExceeded
from onceflow.spend import Grant, LedgerHooks


def admit_many(url: str, workspace_id: str, n: int, tokens: int, barrier: Any, out: Any) -> None:
    hooks = LedgerHooks(url)
    hooks.release(Grant(uuid.uuid4().hex, workspace_id, "warm", 0))  # connect before the start
    barrier.wait(timeout=60)
    admitted = refused = 0
    for _ in range(n):
        try:
            hooks.admit(Grant(uuid.uuid4().hex, workspace_id, "llm", tokens))
            admitted += 1
        except BudgetExceeded:
            refused += 1
    out.put((admitted, refused))
