"""Rate limits of the HTTP API, on the `limits` library (what slowapi is built on).

Two limits, each a `limits` string (``"100/second;3000/minute"``; ``;`` between
limits, all must pass; empty turns it off):

* per key (``ONCEFLOW_API_RATE_LIMIT``), counted right after the key is
  authenticated, before its scope is checked and before the body is parsed: one
  tenant's flood gets 429 while every other key is served, and requests the key
  may not make (403) use its budget too;
* per client address on failed authentication (``ONCEFLOW_API_AUTH_FAILURE_LIMIT``):
  each 401 counts; past the limit an unknown key from that address gets 429
  instead of 401, so guessing keys is slowed. A valid key is never refused by it
  (only by its own per-key limit): failed guesses from an address, or from a
  proxy every tenant shares, cannot lock the tenants' keys out. The address is
  the connection's, or the ``X-Forwarded-For`` of a proxy the operator listed
  (``onceflow api --forwarded-allow-ips``); nothing else is trusted.

Counters live in ``ONCEFLOW_API_RATE_LIMIT_STORAGE``: ``memory://`` (default) is
per API process — N processes allow N times the rate; a ``redis://`` URL is
shared by every process, and so is a Redis Cluster (``redis+cluster://host:port,…``,
the form of ``ONCEFLOW_REDIS_URL``; `limits` keeps each counter in one slot). If that
Redis does not answer, requests are served (the limit fails open, with a warning) rather
than the API going down with it.

A refused request gets 429, ``Retry-After``, the ``RateLimit-*`` headers and the
body ``{"detail": …, "code": "rate_limited"}``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from limits import RateLimitItem, parse_many
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from limits.storage import storage_from_string
from starlette.requests import Request
from starlette.responses import JSONResponse

from onceflow.errors import AccessDenied, InvalidRequest
from onceflow.integrations.fastapi.auth import Principal
from onceflow.loops import PerLoop, drop_redis_sockets
from onceflow.settings import Settings

log = logging.getLogger("onceflow.api.ratelimit")

KEY_PREFIX = "onceflow:ratelimit"
_REDIS_SCHEMES = ("redis", "rediss", "redis+unix", "redis+cluster")


class RateLimited(Exception):
    """A request over a limit: the answer is :meth:`response` (429)."""

    def __init__(self, detail: str, item: RateLimitItem, retry_after: int) -> None:
        super().__init__(detail)
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
        self.detail = detail
        self.item = item
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        """429 with Retry-After and the RateLimit headers (IETF draft: Limit, Remaining, Reset)."""
        window = self.item.get_expiry()
        return JSONResponse(
            {"detail": self.detail, "code": "rate_limited"},
            status_code=429,
            headers={
                "Retry-After": str(self.retry_after),
                "RateLimit-Limit": str(self.item.amount),
                "RateLimit-Remaining": "0",
                "RateLimit-Reset": str(self.retry_after),
                "RateLimit-Policy": f"{self.item.amount};w={window}",
            },
        )


def parse_limits(name: str, value: str) -> list[RateLimitItem]:
    """The limits of a setting (empty: none); a malformed one is refused at start-up."""
    if not value.strip():
        return []
    try:
        return parse_many(value)
    except ValueError:
        raise InvalidRequest(
            f"{name}: expected limits such as '100/second;3000/minute' (empty turns it off)"
        ) from None


def storage_uri(value: str) -> str:
    """The async `limits` storage for a setting: ``memory://`` or a Redis URL."""
    scheme = urlsplit(value).scheme
    if scheme in ("memory", "async+memory"):
        return "async+memory://"
    if scheme in _REDIS_SCHEMES:
        return "async+" + value
    if scheme.removeprefix("async+") in _REDIS_SCHEMES:
        return value
    raise InvalidRequest(
        "ONCEFLOW_API_RATE_LIMIT_STORAGE: expected memory://, a redis:// URL or a "
        "redis+cluster:// URL"
    )


@dataclass
class _Counters:
    storage: Any
    limiter: SlidingWindowCounterRateLimiter

    def drop_sockets(self) -> None:
        """Shut the Redis sockets of a closed loop's storage (``limits``' redis-py bridge)."""
        drop_redis_sockets(getattr(getattr(self.storage, "bridge", None), "storage", None))


class RateLimits:
    """The API's limits: per key, and per address on failed authentication."""

    def __init__(
        self,
        per_key: list[RateLimitItem],
        auth_failures: list[RateLimitItem],
        storage: str = "memory://",
    ) -> None:
        self.per_key = per_key
        self.auth_failures = auth_failures
        self.storage = storage_uri(storage)
        # The async storages bind to an event loop: one set of counters per loop, dropped
        # with a closed loop (a weak table kept them: a storage holds its loop).
        self._counters: PerLoop[_Counters] = PerLoop(_Counters.drop_sockets)

    @classmethod
    def from_settings(cls, settings: Settings) -> RateLimits:
        """The limits of ``ONCEFLOW_API_RATE_LIMIT`` and ``ONCEFLOW_API_AUTH_FAILURE_LIMIT``."""
        return cls(
            parse_limits("ONCEFLOW_API_RATE_LIMIT", settings.api_rate_limit),
            parse_limits("ONCEFLOW_API_AUTH_FAILURE_LIMIT", settings.api_auth_failure_limit),
            settings.api_rate_limit_storage,
        )

    def _limiter(self) -> SlidingWindowCounterRateLimiter:
        counters = self._counters.get()
        if counters is None:
            counters = self._counters.setdefault(self._new_counters)
        return counters.limiter

    def _new_counters(self) -> _Counters:
        options: dict[str, Any] = {}
        if not self.storage.startswith("async+memory"):
            options = {"implementation": "redispy", "key_prefix": KEY_PREFIX}
            options["socket_connect_timeout"] = 2
            options["socket_timeout"] = 2
        storage = storage_from_string(self.storage, **options)
        return _Counters(storage, SlidingWindowCounterRateLimiter(storage))

    async def authorize(
        self,
        request: Request,
        authenticate: Callable[[], Principal],
        permit: Callable[[Principal], None],
    ) -> Principal:
        """Authenticate, charge the key, then check what it may do; :class:`RateLimited` past
        a limit.

        In that order: ``authenticate()`` (a 401 counts against the client's address, and
        is a 429 once the address is past its limit), then the key's limit is charged, then
        ``permit(principal)`` (403 raises). A valid key is limited by its own budget only,
        whatever its address did. A request its key may not make (another workspace,
        worker class or role) uses the key's budget like any other, so a key cannot send
        such requests without limit.
        """
        try:
            principal = authenticate()
        except AccessDenied as exc:
            if exc.status == 401 and self.auth_failures:
                address = request.client.host if request.client else "unknown"
                await self._check(
                    self.auth_failures, ("auth-failures", address), hit=True,
                    detail="too many failed authentications from this address",
                )  # fmt: skip
            raise
        if self.per_key:
            await self._check(
                self.per_key, ("key", principal.key_id), hit=True,
                detail="too many requests for this key",
            )  # fmt: skip
        permit(principal)
        return principal

    async def charge(self, principal: Principal, units: int) -> None:
        """Charge ``principal``'s key ``units`` more than the call itself (a completion's
        follow-ups, one each); :class:`RateLimited`, with nothing charged, past its limit."""
        if self.per_key and units > 0:
            await self._check(
                self.per_key, ("key", principal.key_id), hit=True, cost=units,
                detail="too many requests for this key (each follow-up counts as one)",
            )  # fmt: skip

    async def _check(
        self,
        items: list[RateLimitItem],
        identifiers: tuple[str, str],
        *,
        hit: bool,
        detail: str | None = None,
        cost: int = 1,
    ) -> None:
        try:
            limiter = self._limiter()
            # Every limit is tested before any is charged: a request refused by the minute
            # limit does not use up the second's budget too.
            for item in items:
                if detail is None or await limiter.test(item, *identifiers, cost=cost):
                    continue
                raise await self._refusal(limiter, item, identifiers, detail)
            if hit:
                for item in items:
                    # hit() is the atomic check-and-count: a concurrent request may have
                    # taken the last slot since test() (a shared storage is a round trip away).
                    if not await limiter.hit(item, *identifiers, cost=cost) and detail is not None:
                        raise await self._refusal(limiter, item, identifiers, detail)
        except RateLimited:
            raise
        except Exception as exc:  # the shared storage is down: serve, do not fail closed
            log.warning("rate limit not checked (storage: %s)", type(exc).__name__)

    @staticmethod
    async def _refusal(
        limiter: SlidingWindowCounterRateLimiter,
        item: RateLimitItem,
        identifiers: tuple[str, str],
        detail: str,
    ) -> RateLimited:
        stats = await limiter.get_window_stats(item, *identifiers)
        retry_after = max(1, math.ceil(stats.reset_time - time.time()))
        return RateLimited(detail, item, min(retry_after, item.get_expiry()))
