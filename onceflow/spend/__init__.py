"""Spend control: provider limits shared by every process, the cascade, and the seam to the
spend ledger (:mod:`onceflow.spend.hooks`)."""

from onceflow.spend.hooks import NO_HOOKS, Grant, SpendHooks
from onceflow.spend.usage import Price, Usage

__all__ = ["NO_HOOKS", "Grant", "Price", "SpendHooks", "Usage"]
