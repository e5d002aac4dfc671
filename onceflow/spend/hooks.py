"""The seam between the provider limits (Redis) and what records and budgets spend.

A :class:`~onceflow.spend.provider.Provider` calls its :class:`SpendHooks` at three points
of a permit's life:

- :meth:`SpendHooks.admit` before any rate limit is taken: a budget check, which may raise
  ``BudgetExceeded`` (no room: the permit is refused) or ``BudgetBusy`` (room held by calls
  in flight: the permit waits, within its timeout, and asks again); nothing has been
  reserved yet, so a refusal costs nothing.
- :meth:`SpendHooks.settle` once per permit that was granted and may have been used: at
  ``permit.settle(usage)`` (``outcome="ok"``), or when the block is left without a settle
  (an error, a 429: ``usage=None``). It must be idempotent on ``grant.permit_id``: a retried
  settle records one row.
- :meth:`SpendHooks.release` for a permit given back before any call was made (the
  rate limits refused it in time, the wait was cancelled or timed out).

:data:`NO_HOOKS` does nothing: the limits work alone.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Final, Protocol, runtime_checkable

from onceflow.errors import InvalidRequest
from onceflow.spend.usage import Usage

#: ``outcome`` of a settle: the call was made and its usage reported.
OUTCOME_OK: Final = "ok"
#: The provider answered 429 (rate limited); usage unknown.
OUTCOME_RATE_LIMITED: Final = "rate_limited"
#: The call failed (an exception left the permit's block, a 5xx, a timeout); usage unknown.
OUTCOME_ERROR: Final = "error"
#: The block was left normally without a settle; usage unknown, the estimate is counted.
OUTCOME_UNSETTLED: Final = "unsettled"

OUTCOMES: Final = frozenset({OUTCOME_OK, OUTCOME_RATE_LIMITED, OUTCOME_ERROR, OUTCOME_UNSETTLED})


def new_permit_id() -> str:
    """A fresh permit id (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, kw_only=True)
class Grant:
    """One permit asked for: who, on which provider, how much, and for which stage run.

    ``permit_id`` (uuid4 hex, fresh by default) names the permit everywhere: its Redis
    holder entry, and the ledger's row (settle is idempotent on it).
    """

    # Fields as dataclass fields (alike by shape with other records): data, not logic.
    permit_id: str = field(default_factory=new_permit_id)
    workspace_id: str
    provider: str
    estimate_tokens: int
    estimate_cost: Decimal | None = None
    stage: str | None = None
    request_id: str | None = None
    cell_key: str | None = None
    #: The claim's token (a secret): kept out of the repr, so logs and tracebacks never show it.
    claim_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.estimate_tokens, bool) or not isinstance(self.estimate_tokens, int):
            raise InvalidRequest(
                f"estimate_tokens must be a whole number, got {self.estimate_tokens!r}"
            )
        if self.estimate_tokens < 0:
            raise InvalidRequest(
                f"estimate_tokens must not be negative, got {self.estimate_tokens}"
            )


@runtime_checkable
class SpendHooks(Protocol):
    """What a provider tells the spend ledger (see the module docstring)."""

    def admit(self, grant: Grant) -> None:
        """Before the rate limits: raise ``BudgetExceeded`` to refuse the permit,
        ``BudgetBusy`` to have it wait and ask again."""

    # The Protocol method every hooks class spells out again (alike by shape): declared, not shared.
    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime,
        ended_at: datetime,
    ) -> None:
        """Once per used permit; idempotent on ``grant.permit_id``."""

    def release(self, grant: Grant) -> None:
        """A granted or admitted permit given back without a call."""


class NoHooks:
    """Spend hooks that do nothing: the provider limits alone."""

    def admit(self, grant: Grant) -> None:
        return None

    # SpendHooks.settle's signature (alike by shape): the protocol method, spelled out.
    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime,
        ended_at: datetime,
    ) -> None:
        return None

    def release(self, grant: Grant) -> None:
        return None


#: The default: nothing recorded, nothing budgeted.
NO_HOOKS: Final[SpendHooks] = NoHooks()
