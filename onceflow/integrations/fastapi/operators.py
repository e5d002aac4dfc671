"""Operator keys: who may read onceflow's own state (dashboard, ``/metrics``) and act on it.

An operator key is neither an API key nor a worker key: it is stored in its own table,
``ONCEFLOW_OPERATOR_KEYS`` = ``{"<sha256 hex of the key>": ["viewer"] | ["admin"]}``, hashed
like the others (:func:`~onceflow.integrations.fastapi.auth.hash_key`) and compared in
constant time. Roles:

* ``viewer`` reads: the dashboard's data and stream, and ``/metrics`` (give Prometheus a
  viewer key);
* ``admin`` reads and acts: requeue or cancel a request from the dashboard.

A key may be limited to some workspaces: ``{"<hash>": {"roles": ["viewer"], "workspaces":
["acme-*"]}}`` (patterns as a worker key's, :class:`~onceflow.models.WorkspaceScope`). The
dashboard then withholds the input, result and error of other workspaces' requests (the
request page says so); a list of roles alone means every workspace.

There is no login-less mode: with no operator key configured every operator route answers
401. :func:`~onceflow.integrations.fastapi.guard.operator_route_class` guards a router's
routes: safe methods (GET, HEAD) need ``viewer`` (:func:`role_for`), every other method
needs ``admin``; refusals answer in the API's error shape and failed authentications count
against the per-address limit like the API's.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from onceflow.errors import InvalidRequest
from onceflow.integrations.fastapi.auth import Principal
from onceflow.models.scopes import WorkspaceScope, allows
from onceflow.settings import Settings

VIEWER: Final = "viewer"
ADMIN: Final = "admin"
ROLES: Final = (VIEWER, ADMIN)
SAFE_METHODS: Final = frozenset({"GET", "HEAD"})
_HASH_LEN: Final = 64


@dataclass(frozen=True, slots=True)
class Operator:
    """An authenticated operator: the key's id (first 12 hex digits of its hash) and roles."""

    key_id: str
    roles: frozenset[str]
    #: The workspaces whose requests' payloads the key may read; None: every workspace.
    workspaces: WorkspaceScope | None = None

    def may(self, role: str) -> bool:
        """True if the key has ``role`` (``admin`` includes ``viewer``)."""
        return role in self.roles or ADMIN in self.roles

    def may_read(self, workspace_id: str) -> bool:
        """True if the key may read the inputs, results and errors of ``workspace_id``."""
        return allows(self.workspaces, workspace_id)

    def as_principal(self) -> Principal:
        """A scope-less principal with this key's id (what the rate limiter counts by)."""
        return Principal(key_id=self.key_id, workspaces=frozenset(), worker_classes=frozenset())


class OperatorAuth:
    """The operator keys of one table of hashes; a malformed table is refused at start-up."""

    def __init__(self, keys: Mapping[str, Iterable[str] | Mapping[str, Any]] | None = None) -> None:
        self._entries: list[tuple[bytes, Operator]] = []
        for digest, entry in sorted((keys or {}).items()):
            if (
                not isinstance(digest, str)
                or len(digest) != _HASH_LEN
                or digest.strip("0123456789abcdef")
            ):
                raise InvalidRequest(
                    "operator_keys: keys must be stored as the lowercase hex sha256 of the key "
                    "(onceflow.integrations.fastapi.hash_key), never in the clear"
                )
            roles, workspaces = _entry(entry)
            if isinstance(roles, str) or not roles or not all(r in ROLES for r in roles):
                raise InvalidRequest(
                    f"operator_keys: each hash maps to a non-empty list of roles from {ROLES} "
                    '(or {"roles": [...], "workspaces": [...]})'
                )
            scope = (
                None
                if workspaces is None
                else WorkspaceScope.parse(workspaces, what="operator_keys workspaces")
            )
            operator = Operator(key_id=digest[:12], roles=frozenset(roles), workspaces=scope)
            self._entries.append((bytes.fromhex(digest), operator))

    @classmethod
    def from_settings(cls, settings: Settings) -> OperatorAuth:
        """The keys of ``ONCEFLOW_OPERATOR_KEYS``."""
        return cls(settings.operator_keys)

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, key: str) -> Operator | None:
        """Hash ``key`` and compare it with every stored hash (no early exit)."""
        presented = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found: Operator | None = None
        for digest, operator in self._entries:
            if hmac.compare_digest(presented, digest):
                found = operator
        return found


def _entry(entry: Any) -> tuple[Any, Any]:
    """An entry's roles and workspace patterns (None: every workspace)."""
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"roles", "workspaces"}
        if unknown:
            raise InvalidRequest(
                f"operator_keys: unknown field(s) {sorted(unknown)}; fields: roles, workspaces"
            )
        return entry.get("roles"), entry.get("workspaces")
    return entry, None


def role_for(method: str) -> str:
    """The role a request method needs: ``viewer`` to read, ``admin`` for anything else."""
    return VIEWER if method.upper() in SAFE_METHODS else ADMIN
