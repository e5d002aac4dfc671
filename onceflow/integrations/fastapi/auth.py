"""API keys and worker keys: hashed at rest, compared in constant time, scoped.

Two kinds of key, one table each, both ``{sha256 hex of the key: [scopes]}``:

* an **API key** is scoped to workspaces: it may enqueue, write ops and read in
  those workspaces only;
* a **worker key** is scoped to worker classes: it may claim requests of those
  classes and heartbeat, complete, fail and write for the claims it holds.

``"*"`` as a scope means every workspace (or worker class); use it for trusted
back ends only. The server never sees a key in the clear at rest: settings and
tables hold ``sha256(key)``; a presented key is hashed and compared with every
stored hash through :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Protocol

from fastapi import Depends, Request

from onceflow.errors import AccessDenied, InvalidRequest
from onceflow.settings import Settings

WILDCARD = "*"
_HASH_RE = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """The form a key is stored in: the hex sha256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh random key (256 bits from ``secrets``) and its hash (store only the hash)."""
    key = "of_" + secrets.token_urlsafe(32)
    return key, hash_key(key)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from: the scopes of the key it presented.

    ``key_id`` is the first 12 hex digits of the key's hash: safe to log, never the key.
    """

    key_id: str
    workspaces: frozenset[str]
    worker_classes: frozenset[str]

    def may_use_workspace(self, workspace_id: str) -> bool:
        """True if the key is scoped to ``workspace_id``."""
        return WILDCARD in self.workspaces or workspace_id in self.workspaces

    def may_work(self, worker_class: str) -> bool:
        """True if the key may claim requests of ``worker_class``."""
        return WILDCARD in self.worker_classes or worker_class in self.worker_classes

    @property
    def is_worker(self) -> bool:
        """True if the key is a worker key for at least one worker class."""
        return bool(self.worker_classes)


class Authenticator(Protocol):
    """Turns a presented key into a :class:`Principal` (None: unknown key). Plug your own."""

    def authenticate(self, key: str) -> Principal | None:
        """The principal of ``key``, or None if no key matches."""
        ...


class KeyAuth:
    """Keys from two tables of hashes (from settings, a file or a database table)."""

    def __init__(
        self,
        api_keys: Mapping[str, Iterable[str]] | None = None,
        worker_keys: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        workspaces = _table("api_keys", api_keys or {})
        classes = _table("worker_keys", worker_keys or {})
        self._entries: list[tuple[bytes, Principal]] = []
        for digest in sorted(set(workspaces) | set(classes)):
            principal = Principal(
                key_id=digest[:12],
                workspaces=workspaces.get(digest, frozenset()),
                worker_classes=classes.get(digest, frozenset()),
            )
            self._entries.append((bytes.fromhex(digest), principal))

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyAuth:
        """The keys of ``ONCEFLOW_API_KEYS`` and ``ONCEFLOW_WORKER_KEYS``."""
        return cls(settings.api_keys, settings.worker_keys)

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, key: str) -> Principal | None:
        """Hash ``key`` and compare it with every stored hash (no early exit)."""
        presented = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found: Principal | None = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal
        return found


def _table(name: str, table: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    """Validate a key table; a malformed one is refused at start-up (fail closed)."""
    out: dict[str, frozenset[str]] = {}
    for digest, scopes in table.items():
        if not isinstance(digest, str) or not _HASH_RE.fullmatch(digest):
            raise InvalidRequest(
                f"{name}: keys must be stored as the lowercase hex sha256 of the key "
                "(onceflow.integrations.fastapi.hash_key), never in the clear"
            )
        if isinstance(scopes, str) or not all(isinstance(s, str) and s for s in scopes):
            raise InvalidRequest(f"{name}: each hash maps to a list of non-empty scope names")
        out[digest] = frozenset(scopes)
    return out


def get_principal(request: Request) -> Principal:
    """The key's principal, set by the router's routes once the key and its scope passed."""
    principal = getattr(request.state, "onceflow_principal", None)
    if not isinstance(principal, Principal):
        raise AccessDenied(401, "no API key was checked for this route")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]
