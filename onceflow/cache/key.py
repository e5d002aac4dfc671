""":class:`CacheKey`: what makes two expensive calls the same call, where, and for how long.

A key is any text — a prompt, a canonical JSON encoding of a request — hashed with sha256,
so its length and characters never reach a table or a lock key. Its scope says who shares
an entry: ``"workspace"`` (the calls of one workspace) or ``"global"`` (every workspace).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Final, Literal

from onceflow.errors import InvalidRequest

Scope = Literal["workspace", "global"]
SCOPES: Final[tuple[Scope, ...]] = ("workspace", "global")
#: The longest TTL of an entry: ten years (a database interval holds it exactly).
TTL_MAX_SECONDS: Final = 10 * 366 * 86_400.0
#: The job id of a workspace-scope key's lock cell, which no request can share: the cell
#: ``(workspace, "onceflow.cache", <digest>)``.
LOCK_JOB: Final = "onceflow.cache"
#: A global key's lock cell is the pseudo-workspace ``onceflow.cache.<digest>``: one hash
#: tag (and one broadcast channel) per key, so keys spread over a Redis Cluster.
GLOBAL_LOCK_PREFIX: Final = "onceflow.cache."


def digest_of(key: str) -> str:
    """The sha256 of ``key`` (UTF-8) in hex: the name an entry is stored and locked under."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def check_ttl(ttl: object) -> float:
    """``ttl`` as seconds; :class:`InvalidRequest` unless a finite number in (0, ten years]."""
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not math.isfinite(ttl)
        or not 0 < ttl <= TTL_MAX_SECONDS
    ):
        raise InvalidRequest(
            f"a cache ttl must be a number of seconds in (0, {TTL_MAX_SECONDS:.0f}], got {ttl!r}"
        )
    return float(ttl)


def check_scope(scope: object) -> Scope:
    """``scope`` if it is ``"workspace"`` or ``"global"``, else :class:`InvalidRequest`."""
    if scope == "workspace":
        return "workspace"
    if scope == "global":
        return "global"
    raise InvalidRequest(f"a cache scope is 'workspace' or 'global', got {scope!r}")


def check_digest(digest: object) -> str:
    """A key's digest as given on the command line: 64 lowercase hex digits."""
    if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef") != "":
        raise InvalidRequest(f"a cache key digest is 64 lowercase hex digits, got {digest!r}")
    return digest


@dataclass(frozen=True)
class CacheKey:
    """An entry of the result cache: ``scope`` (``"workspace"`` or ``"global"``), ``key``
    (any non-empty text; stored as its sha256, :attr:`digest`) and ``ttl`` (seconds the
    entry lives after it is written, on the database clock).

    Bad input — another scope, an empty or non-text key, a ttl that is not a positive
    finite number — raises :class:`InvalidRequest` here, before anything is read or written.
    """

    scope: Scope
    key: str = field(repr=False)
    ttl: float
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        check_scope(self.scope)
        if not isinstance(self.key, str) or not self.key:
            raise InvalidRequest(f"a cache key must be non-empty text, got {self.key!r:.60}")
        try:
            digest = digest_of(self.key)
        except UnicodeEncodeError:
            raise InvalidRequest("a cache key must be valid text (a lone surrogate)") from None
        object.__setattr__(self, "ttl", check_ttl(self.ttl))
        object.__setattr__(self, "digest", digest)

    def lock_cell(self, workspace_id: str) -> tuple[str, str, str]:
        """The compute-lock cell ``(workspace, job, task)`` that identical calls merge on."""
        if self.scope == "global":
            return GLOBAL_LOCK_PREFIX + self.digest, LOCK_JOB, self.digest
        return workspace_id, LOCK_JOB, self.digest
