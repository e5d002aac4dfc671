"""Spend control: what provider calls use and cost, and budgets per workspace.

- :mod:`~onceflow.spend.usage`: :class:`Usage` (tokens of one call), :class:`Price`.
- :mod:`~onceflow.spend.hooks`: the :class:`SpendHooks` a provider's permits report to,
  :class:`Grant`, :data:`NO_HOOKS`.
- :mod:`~onceflow.spend.ledger`: :class:`LedgerHooks`, the cost ledger and budget checks in
  Postgres.
- :mod:`~onceflow.spend.budget`: :func:`set_budget`, :func:`budgets`, :func:`clear_budget`.
- :mod:`~onceflow.spend.reads`: :func:`spend` (the ledger summed by workspace, stage,
  provider…), :func:`priced_savings` (the compute lock's savings in money).
"""

from __future__ import annotations

from onceflow.spend.budget import Budget, budgets, clear_budget, set_budget
from onceflow.spend.databases import Database, Databases
from onceflow.spend.hooks import NO_HOOKS, Grant, SpendHooks
from onceflow.spend.ledger import LedgerHooks
from onceflow.spend.reads import average_call_cost, priced_savings, spend
from onceflow.spend.usage import Price, Usage

__all__ = [
    "NO_HOOKS",
    "Budget",
    "Database",
    "Databases",
    "Grant",
    "LedgerHooks",
    "Price",
    "SpendHooks",
    "Usage",
    "average_call_cost",
    "budgets",
    "clear_budget",
    "priced_savings",
    "set_budget",
    "spend",
]
