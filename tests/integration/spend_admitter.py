"""A process that admits spend permits against one workspace's budget (the concurrent
budget test starts several): each waits at the barrier, then asks for ``n`` permits of
``tokens`` estimated tokens and reports how many were admitted."""

from __future__ import annotations

from typing import Any

from onceflow.errors import BudgetBusy, BudgetExceeded
from onceflow.spend import Grant, LedgerHooks


def admit_many(url: str, workspace_id: str, n: int, tokens: int, barrier: Any, out: Any) -> None:
    hooks = LedgerHooks(url)
    hooks.release(
        Grant(workspace_id=workspace_id, provider="warm", estimate_tokens=0)
    )  # connect before the start
    barrier.wait(timeout=60)
    admitted = refused = 0
    for _ in range(n):
        try:
            hooks.admit(Grant(workspace_id=workspace_id, provider="llm", estimate_tokens=tokens))
            admitted += 1
        except (BudgetExceeded, BudgetBusy):  # every reservation is held: busy
            refused += 1
    out.put((admitted, refused))
