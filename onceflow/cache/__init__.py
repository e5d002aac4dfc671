"""The result cache across jobs: an identical expensive call, anywhere in a key's scope
within its TTL, is paid once.

- :mod:`~onceflow.cache.key`: :class:`CacheKey` (scope, key, ttl).
- :mod:`~onceflow.cache.store`: :class:`ResultCache`, the entries in Postgres;
  :func:`invalidate`, :func:`purge`.
- :mod:`~onceflow.cache.capture`: what a computation paid, as its provider permits settle.

``onceflow.compute_once(..., cache=CacheKey(...))`` (and ``ctx.compute_once``) runs it;
docs/locks.md ("Result cache") tells the whole story. Nothing here connects at import time.
"""

from __future__ import annotations

from typing import Any

from onceflow.cache.key import CacheKey
from onceflow.cache.store import Entry, ResultCache, default_cache


def invalidate(
    scope: Any,
    *,
    key: str | None = None,
    digest: str | None = None,
    workspace_id: str | None = None,
) -> bool:
    """Delete an entry of the settings' database (:meth:`ResultCache.invalidate`)."""
    return default_cache().invalidate(scope, key=key, digest=digest, workspace_id=workspace_id)


def purge() -> int:
    """Delete every expired entry of the settings' database(s); how many."""
    return default_cache().purge()


__all__ = [
    "CacheKey",
    "Entry",
    "ResultCache",
    "default_cache",
    "invalidate",
    "purge",
]
