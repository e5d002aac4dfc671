"""Spend control: providers with limits shared by every process, the permit one call takes,
the cascade of a primary provider and its fallbacks, and the seam to the spend ledger
(:mod:`onceflow.spend.hooks`). docs/spend.md tells the whole story.

Nothing here connects at import time.
"""

from onceflow.errors import (
    CascadeExhausted,
    LimitsUnavailable,
    PermitCancelled,
    PermitTimeout,
    ProviderError,
)
from onceflow.spend.cascade import Cascade
from onceflow.spend.hooks import NO_HOOKS, Grant, SpendHooks
from onceflow.spend.provider import AsyncPermit, Permit, Provider
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
    "Cascade",
    "CascadeExhausted",
    "Grant",
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
    "get_provider",
    "providers",
    "register",
    "use_hooks",
]
