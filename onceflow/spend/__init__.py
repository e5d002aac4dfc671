"""Spend control: providers with limits shared by every process, the permit one call takes,
the cascade of a primary provider and its fallbacks, and what calls use and cost: the cost
ledger and budgets per workspace.

- :mod:`~onceflow.spend.provider`: :class:`Provider`, :class:`Permit`, :class:`AsyncPermit`.
- :mod:`~onceflow.spend.cascade`: :class:`Cascade`.
- :mod:`~onceflow.spend.usage`: :class:`Usage` (tokens of one call), :class:`Price`.
- :mod:`~onceflow.spend.hooks`: the :class:`SpendHooks` a provider's permits report to,
  :class:`Grant`, :data:`NO_HOOKS`.
- :mod:`~onceflow.spend.ledger`: :class:`LedgerHooks`, the cost ledger and budget checks in
  Postgres.
- :mod:`~onceflow.spend.budget`: :func:`set_budget`, :func:`budgets`, :func:`clear_budget`.
- :mod:`~onceflow.spend.reads`: :func:`spend` (the ledger summed by workspace, stage,
  provider…), :func:`priced_savings` (the compute lock's savings in money).

docs/spend.md and docs/spend-budgets.md tell the whole story. Nothing here connects at
import time.
"""

from __future__ import annotations

from onceflow.errors import (
    BudgetBusy,
    CascadeExhausted,
    LimitsUnavailable,
    PermitCancelled,
    PermitTimeout,
    ProviderError,
)
from onceflow.spend.budget import Budget, budgets, clear_budget, set_budget
from onceflow.spend.cascade import Cascade
from onceflow.spend.databases import Database, Databases
from onceflow.spend.hooks import NO_HOOKS, Grant, SpendHooks
from onceflow.spend.ledger import LedgerHooks
from onceflow.spend.provider import AsyncPermit, Permit, Provider
from onceflow.spend.reads import average_call_cost, priced_savings, spend
from onceflow.spend.registry import (
    UnknownProvider,
    get_provider,
    providers,
    register,
    use_hooks,
)
from onceflow.spend.usage import Price, Usage

__all__ = [
    "NO_HOOKS",
    "AsyncPermit",
    "Budget",
    "BudgetBusy",
    "Cascade",
    "CascadeExhausted",
    "Database",
    "Databases",
    "Grant",
    "LedgerHooks",
    "LimitsUnavailable",
    "Permit",
    "PermitCancelled",
    "PermitTimeout",
    "Price",
    "Provider",
    "ProviderError",
    "SpendHooks",
    "UnknownProvider",
    "Usage",
    "average_call_cost",
    "budgets",
    "clear_budget",
    "get_provider",
    "priced_savings",
    "providers",
    "register",
    "set_budget",
    "spend",
    "use_hooks",
]
