"""Short-lived worker tokens: what an app's back end mints for a browser tab, as it would
presign a URL.

A worker token is a JWT (RFC 7519) signed with HS256 under a secret the app's back end
and the onceflow API share (``ONCEFLOW_WORKER_TOKEN_SECRETS``). It carries:

* ``aud`` ``"onceflow-worker"``, ``iat``, ``nbf`` and ``exp`` (seconds since the epoch);
* ``worker_classes``: the worker classes it may claim (a list of names);
* ``workspaces``: the workspaces it may claim in (ids and ``"prefix*"`` patterns; never
  ``"*"``: every workspace is a worker key's scope, for a trusted back end);
* ``sub`` (optional): who it was minted for, for the app's own logs.

It gives claim rights only — claim, heartbeat, complete, fail, write under the claim —
never an API key's (enqueue, read). Any JWT library can mint one (the format is the
standard's), so a back end in another language needs no onceflow code; in Python::

    token = onceflow.mint_worker_token(workspaces=["acme-1"], worker_classes=["tabs"])

The API verifies a presented token with every configured secret (rotation: the first one
mints), accepts HS256 only (``alg: none`` and every other algorithm are refused), requires
every time claim and the audience, and refuses a token whose lifetime (``exp - iat``) is
over ``ONCEFLOW_WORKER_TOKEN_MAX_LIFETIME_SECONDS``. A token is never logged.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jwt

from onceflow.errors import InvalidRequest
from onceflow.ids import check_id, check_worker_class
from onceflow.models.scopes import WorkspaceScope
from onceflow.settings import Settings, get_settings

#: The ``aud`` of every worker token: a JWT minted for anything else is not one.
AUDIENCE = "onceflow-worker"
#: The only algorithm minted and accepted.
ALGORITHM = "HS256"
#: The shortest secret accepted (bytes of its UTF-8): HS256's key should be as long as its hash.
MIN_SECRET_BYTES = 32
#: Clock skew allowed between the minting back end and the API, in seconds.
LEEWAY_SECONDS = 30
#: Default lifetime of a minted token.
DEFAULT_TTL_SECONDS = 900
#: Most patterns (workspaces, worker classes) one token may carry.
MAX_SCOPES = 100


@dataclass(frozen=True, slots=True)
class WorkerToken:
    """A verified worker token's scopes. ``token_id`` is the first 12 hex digits of the
    token's sha256: safe to log, never the token."""

    token_id: str
    worker_classes: frozenset[str]
    workspaces: WorkspaceScope
    expires_at: datetime
    subject: str | None = None


def check_secrets(secrets: Sequence[str]) -> list[str]:
    """``secrets`` if each is long enough, else :class:`InvalidRequest` (at start-up)."""
    for k, secret in enumerate(secrets):
        if len(secret.encode("utf-8")) < MIN_SECRET_BYTES:
            raise InvalidRequest(
                f"worker token secret #{k + 1} is shorter than {MIN_SECRET_BYTES} bytes: "
                "use e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
    return list(secrets)


def mint_worker_token(
    *,
    workspaces: Iterable[str],
    worker_classes: Iterable[str],
    ttl_seconds: float = DEFAULT_TTL_SECONDS,
    secret: str | None = None,
    subject: str | None = None,
    settings: Settings | None = None,
    now: datetime | None = None,
) -> str:
    """A worker token for ``worker_classes`` in ``workspaces``, valid for ``ttl_seconds``.

    Signed with ``secret``, else the first of ``ONCEFLOW_WORKER_TOKEN_SECRETS``. Raises
    :class:`InvalidRequest` for an empty or ``"*"`` scope, a bad pattern or class, a
    lifetime over ``ONCEFLOW_WORKER_TOKEN_MAX_LIFETIME_SECONDS`` (the API would refuse
    it), or no secret. Hand it to the page over your own authenticated route; it is a
    bearer credential until it expires.
    """
    st = settings or get_settings()
    if secret is None:
        configured = st.worker_token_secret_list
        if not configured:
            raise InvalidRequest("no secret: set ONCEFLOW_WORKER_TOKEN_SECRETS or pass secret=")
        secret = configured[0]
    check_secrets([secret])
    if isinstance(workspaces, str) or isinstance(worker_classes, str):
        raise InvalidRequest("workspaces and worker_classes are lists (of patterns, of names)")
    patterns = _workspace_patterns(list(workspaces))
    classes = _worker_classes(list(worker_classes))
    if (
        isinstance(ttl_seconds, bool)
        or not isinstance(ttl_seconds, int | float)
        or not math.isfinite(ttl_seconds)
        or not 1 <= ttl_seconds <= st.worker_token_max_lifetime_seconds
    ):
        raise InvalidRequest(
            f"ttl_seconds must be a number of seconds in [1, "
            f"{st.worker_token_max_lifetime_seconds:g}] "
            "(ONCEFLOW_WORKER_TOKEN_MAX_LIFETIME_SECONDS)"
        )
    issued = int((now or datetime.now(UTC)).timestamp())
    claims: dict[str, Any] = {
        "aud": AUDIENCE,
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(ttl_seconds),
        "worker_classes": classes,
        "workspaces": patterns,
    }
    if subject is not None:
        claims["sub"] = check_id("subject", subject)
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify_worker_token(
    token: str, secrets: Sequence[str], max_lifetime_seconds: float
) -> WorkerToken | None:
    """The scopes of ``token`` if one of ``secrets`` signed it and it is valid now; else None.

    Valid: HS256 only, audience ``onceflow-worker``, ``exp``, ``iat`` and ``nbf`` present
    and holding (``LEEWAY_SECONDS`` of clock skew), ``exp - iat`` within
    ``max_lifetime_seconds``, and well-formed scopes. Every refusal is the same None: the
    caller answers 401, as for an unknown key.
    """
    if not secrets or token.count(".") != 2:
        return None
    claims: dict[str, Any] | None = None
    for secret in secrets:
        try:
            claims = jwt.decode(
                token,
                secret,
                algorithms=[ALGORITHM],
                audience=AUDIENCE,
                leeway=LEEWAY_SECONDS,
                options={"require": ["aud", "exp", "iat", "nbf"]},
            )
            break
        except jwt.InvalidSignatureError:
            continue  # another secret may have signed it (rotation)
        except jwt.PyJWTError:
            return None  # expired, not yet valid, wrong audience or algorithm, malformed
    if claims is None:
        return None
    try:
        exp, iat = claims["exp"], claims["iat"]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (exp, iat)):
            return None
        if exp - iat > max_lifetime_seconds or exp <= iat:
            return None
        classes = frozenset(_worker_classes(claims.get("worker_classes")))
        scope = WorkspaceScope.parse(_workspace_patterns(claims.get("workspaces")))
        subject = claims.get("sub")
        if subject is not None and not isinstance(subject, str):
            return None
    except InvalidRequest:
        return None
    if scope is None:  # unreachable: "*" is refused above
        return None
    return WorkerToken(
        token_id=hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:12],
        worker_classes=classes,
        workspaces=scope,
        expires_at=datetime.fromtimestamp(exp, UTC),
        subject=subject,
    )


def _workspace_patterns(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or len(value) > MAX_SCOPES:
        raise InvalidRequest(f"workspaces: a list of 1 to {MAX_SCOPES} workspace ids or patterns")
    if "*" in value:
        raise InvalidRequest(
            'workspaces: a worker token is scoped to named workspaces, never "*" '
            "(every workspace is a worker key's scope, for a trusted back end)"
        )
    scope = WorkspaceScope.parse(value)
    assert scope is not None  # noqa: S101 - "*" refused above
    return scope.patterns()


def _worker_classes(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or len(value) > MAX_SCOPES:
        raise InvalidRequest(f"worker_classes: a list of 1 to {MAX_SCOPES} worker classes")
    return sorted({check_worker_class(wc) for wc in value})
