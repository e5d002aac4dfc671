"""The seam between a provider's limits and what is recorded about its calls.

A provider's permit calls :meth:`SpendHooks.admit` before it takes any rate limit (a budget
may refuse the call there), then exactly one of :meth:`SpendHooks.settle` (the call was made,
failed, or was abandoned) or :meth:`SpendHooks.release` (the permit was given back without a
call). :data:`NO_HOOKS` records nothing; :class:`onceflow.spend.ledger.LedgerHooks` keeps a
ledger in Postgres and enforces budgets.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Protocol, runtime_checkable

from onceflow.spend.usage import Usage


@dataclass(frozen=True, slots=True)
class Grant:
    """One permit as the hooks see it; ``permit_id`` (uuid4 hex) is its idempotency key."""

    permit_id: str
    workspace_id: str
    provider: str
    estimate_tokens: int
    estimate_cost: Decimal | None = None
    stage: str | None = None
    request_id: str | None = None
    cell_key: str | None = None
    claim_token: str | None = None


@runtime_checkable
class SpendHooks(Protocol):
    """What a provider's permits report; every method is idempotent on ``grant.permit_id``."""

    def admit(self, grant: Grant) -> None:
        """Before the rate limits: may raise :class:`~onceflow.errors.BudgetExceeded`."""

    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime | None,
        ended_at: datetime | None,
    ) -> None:
        """Once per permit that made (or tried) a call; ``usage`` None: failed or abandoned."""

    def release(self, grant: Grant) -> None:
        """A permit given back without a call."""


class _NoHooks:
    """Records nothing and refuses nothing."""

    def admit(self, grant: Grant) -> None:
        return None

    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime | None,
        ended_at: datetime | None,
    ) -> None:
        return None

    def release(self, grant: Grant) -> None:
        return None


NO_HOOKS: SpendHooks = _NoHooks()

__all__ = ["NO_HOOKS", "Grant", "SpendHooks"]
