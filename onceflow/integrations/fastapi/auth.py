"""API keys, worker keys and worker tokens: keys hashed at rest, compared in constant time,
everything scoped.

Two kinds of key, one table each, keyed by the sha256 hex of the key:

* an **API key** (``{hash: [workspaces]}``) is scoped to workspaces: it may enqueue,
  write ops and read in those workspaces only;
* a **worker key** (``{hash: {"worker_classes": [...], "workspaces": [...]}}``) is
  scoped to worker classes and to the workspaces it may claim in: it may claim requests
  of those classes in those workspaces, and heartbeat, complete, fail and write for the
  claims it holds. The older form ``{hash: [worker classes]}`` means every workspace.

A hash may be in both tables: its API-key workspaces and its claim workspaces stay
apart. A **worker token** (:mod:`onceflow.worker_tokens`, a JWT an app's back end mints)
is a worker key's rights for a short time: its worker classes and workspaces, no API-key
rights at all.

``"*"`` as a scope means every workspace (or worker class); use it for trusted
back ends only. The server never sees a key in the clear at rest: settings and
tables hold ``sha256(key)``; a presented key is hashed and compared with every
stored hash through :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request

from onceflow.errors import AccessDenied, InvalidRequest
from onceflow.models.scopes import WorkspaceScope, allows
from onceflow.settings import Settings, WorkerKeyScopes
from onceflow.worker_tokens import check_secrets, verify_worker_token

log = logging.getLogger("onceflow.api")

WILDCARD = "*"
_HASH_RE = re.compile(r"[0-9a-f]{64}")

#: A worker key's entry: the old form (worker classes: every workspace) or the scoped one.
WorkerKeyEntry = Iterable[str] | Mapping[str, Iterable[str]] | WorkerKeyScopes


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
    #: The workspaces an API key may enqueue, write ops and read in.
    workspaces: frozenset[str]
    #: The worker classes a worker key may claim.
    worker_classes: frozenset[str]
    #: The workspaces a worker key may claim in (None: every workspace — a worker key
    #: of the older form, or a Principal an Authenticator built without it).
    claim_workspaces: WorkspaceScope | None = None

    def may_use_workspace(self, workspace_id: str) -> bool:
        """True if the key is scoped to ``workspace_id``."""
        return WILDCARD in self.workspaces or workspace_id in self.workspaces

    def may_work(self, worker_class: str) -> bool:
        """True if the key may claim requests of ``worker_class``."""
        return WILDCARD in self.worker_classes or worker_class in self.worker_classes

    def may_claim_in(self, workspace_id: str) -> bool:
        """True if the worker key may claim (and hold claims) in ``workspace_id``."""
        return allows(self.claim_workspaces, workspace_id)

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
    """Keys from two tables of hashes (from settings, a file or a database table), and
    worker tokens signed with ``token_secrets``."""

    def __init__(
        self,
        api_keys: Mapping[str, Iterable[str]] | None = None,
        worker_keys: Mapping[str, WorkerKeyEntry] | None = None,
        *,
        token_secrets: Sequence[str] = (),
        token_max_lifetime_seconds: float = 86_400.0,
    ) -> None:
        workspaces = _table("api_keys", api_keys or {})
        workers = _worker_table(worker_keys or {})
        self._token_secrets = check_secrets(list(token_secrets))
        self._token_max_lifetime = float(token_max_lifetime_seconds)
        self._entries: list[tuple[bytes, Principal]] = []
        for digest in sorted(set(workspaces) | set(workers)):
            classes, scope = workers.get(digest, (frozenset(), None))
            principal = Principal(
                key_id=digest[:12],
                workspaces=workspaces.get(digest, frozenset()),
                worker_classes=classes,
                claim_workspaces=scope,
            )
            self._entries.append((bytes.fromhex(digest), principal))

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyAuth:
        """The keys of ``ONCEFLOW_API_KEYS`` and ``ONCEFLOW_WORKER_KEYS``, and the worker
        tokens of ``ONCEFLOW_WORKER_TOKEN_SECRETS``."""
        return cls(
            settings.api_keys,
            settings.worker_keys,
            token_secrets=settings.worker_token_secret_list,
            token_max_lifetime_seconds=settings.worker_token_max_lifetime_seconds,
        )

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, key: str) -> Principal | None:
        """Hash ``key`` and compare it with every stored hash (no early exit); a key that
        matches none may be a worker token (verified with the token secrets)."""
        presented = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found: Principal | None = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal
        if found is None and self._token_secrets:
            token = verify_worker_token(key, self._token_secrets, self._token_max_lifetime)
            if token is not None:
                found = Principal(
                    key_id=token.token_id,
                    workspaces=frozenset(),  # claim rights only: no enqueue, no reads
                    worker_classes=token.worker_classes,
                    claim_workspaces=token.workspaces,
                )
        return found


def _table(name: str, table: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    """Validate a key table; a malformed one is refused at start-up (fail closed)."""
    out: dict[str, frozenset[str]] = {}
    for digest, scopes in table.items():
        _check_digest(name, digest)
        out[digest] = _names(name, scopes)
    return out


def _worker_table(
    table: Mapping[str, WorkerKeyEntry],
) -> dict[str, tuple[frozenset[str], WorkspaceScope | None]]:
    """Validate the worker keys: each hash's worker classes and claim workspaces (None:
    every workspace). A key of the older form (a list of classes) may claim in every
    workspace: one warning per such key at start-up, by key id."""
    out: dict[str, tuple[frozenset[str], WorkspaceScope | None]] = {}
    for digest, entry in table.items():
        _check_digest("worker_keys", digest)
        scoped = _scoped_entry(entry)
        if scoped is None:
            out[digest] = (_names("worker_keys", entry), None)
            log.warning(
                "worker key %s has no workspace scope (a list of worker classes): it may "
                'claim requests of every workspace; give it {"worker_classes": [...], '
                '"workspaces": [...]} unless it is a trusted back end\'s (docs/security.md)',
                digest[:12],
            )
            continue
        classes, patterns = scoped
        try:
            scope = WorkspaceScope.parse(patterns, what=f"worker_keys[{digest[:12]}].workspaces")
        except InvalidRequest as exc:
            raise InvalidRequest(f"worker_keys: {exc}") from None
        out[digest] = (_names("worker_keys", classes), scope)
    return out


def _scoped_entry(entry: Any) -> tuple[Any, Any] | None:
    """A scoped entry's (worker classes, workspace patterns); None for the older form."""
    if isinstance(entry, WorkerKeyScopes):
        return entry.worker_classes, entry.workspaces
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"worker_classes", "workspaces"}
        if unknown or "worker_classes" not in entry or "workspaces" not in entry:
            raise InvalidRequest(
                'worker_keys: each hash maps to {"worker_classes": [...], "workspaces": [...]} '
                "(or, the older form, to a list of worker classes)"
            )
        return entry["worker_classes"], entry["workspaces"]
    return None


def _check_digest(name: str, digest: object) -> None:
    if not isinstance(digest, str) or not _HASH_RE.fullmatch(digest):
        raise InvalidRequest(
            f"{name}: keys must be stored as the lowercase hex sha256 of the key "
            "(onceflow.integrations.fastapi.hash_key), never in the clear"
        )


def _names(name: str, scopes: object) -> frozenset[str]:
    items = [] if isinstance(scopes, str) or not isinstance(scopes, Iterable) else list(scopes)
    if not items or not all(isinstance(s, str) and s for s in items):
        raise InvalidRequest(f"{name}: each hash maps to a list of non-empty scope names")
    return frozenset(items)


def get_principal(request: Request) -> Principal:
    """The key's principal, set by the router's routes once the key and its scope passed."""
    principal = getattr(request.state, "onceflow_principal", None)
    if not isinstance(principal, Principal):
        raise AccessDenied(401, "no API key was checked for this route")
    return principal


async def _principal(request: Request) -> Principal:
    """:func:`get_principal` as a coroutine: FastAPI runs a plain function dependency in its
    thread pool, and a heartbeat must never wait for a thread held by other work."""
    return get_principal(request)


PrincipalDep = Annotated[Principal, Depends(_principal)]


def bearer_key(request: Request) -> str:
    """The key of ``Authorization: Bearer <key>``; 401 if missing or malformed."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if not header:
        raise AccessDenied(401, "missing key: send Authorization: Bearer <key>")
    if scheme.lower() != "bearer" or not key:
        raise AccessDenied(401, "malformed Authorization header: expected Bearer <key>")
    return key
