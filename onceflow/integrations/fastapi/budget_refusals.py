"""The budget refusals the permit route answered, kept per claim for the ``fail`` route.

A pull worker reports its failures itself. A ``BudgetExceeded`` in its report that the
server believed as sent would give the attempt back (a budget wait) on the worker's word:
any worker key could retry a failing stage past its ``max_attempts``, for ever. So the
server believes it only when it refused a permit of that very claim itself: the permit
route keeps its 402 answer (the budget's ``on_exceeded``, ``retry_at`` and ``retry_in``)
under the claim for :data:`KEEP_MS`, and the ``fail`` route reads it back and decides by
it, not by the report. A refusal the server did not answer is an ordinary failure, its
attempt counted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

from onceflow.errors import BudgetExceeded
from onceflow.keys import budget_refusal_key
from onceflow.spend import Grant
from onceflow.spend.limits import translated

T = TypeVar("T")

#: How long a refusal is kept for the claim's failure report (ms): a run that reports it
#: later than this has its attempt counted.
KEEP_MS: Final = 24 * 3600 * 1000


def _key(workspace_id: str, request_id: str, claim_token: str) -> str:
    token_hash = hashlib.sha256(claim_token.encode()).hexdigest()
    return budget_refusal_key(workspace_id, request_id, token_hash)


async def remembered(asked: Awaitable[T], redis: Any, grant: Grant) -> T:
    """``await asked`` (the permit route's admit and wait for ``grant``); a
    :class:`BudgetExceeded` it raises is kept under the grant's claim, then raised on (the
    route answers it 402)."""
    try:
        return await asked
    except BudgetExceeded as refusal:
        if grant.request_id is not None and grant.claim_token is not None:
            fields = {
                "on_exceeded": refusal.on_exceeded,
                "retry_at": refusal.retry_at,
                "retry_in": refusal.retry_in,
            }
            key = _key(grant.workspace_id, grant.request_id, grant.claim_token)
            with translated("budget refusal"):
                await redis.set(key, json.dumps(fields), px=KEEP_MS)
        raise


async def refused(
    redis: Any, workspace_id: str, request_id: str, claim_token: str
) -> dict[str, Any] | None:
    """The budget refusal the permit route answered this claim with (``on_exceeded``,
    ``retry_at``, ``retry_in``), or None when it answered none (or it is no longer kept)."""
    with translated("budget refusal"):
        raw = await redis.get(_key(workspace_id, request_id, claim_token))
    if raw is None:
        return None
    kept = json.loads(raw)
    return kept if isinstance(kept, dict) else None


__all__ = ["KEEP_MS", "refused", "remembered"]
