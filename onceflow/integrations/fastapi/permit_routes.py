"""Provider permits for pull workers (browser tabs, Python and JS ``PullWorker``): the same
limits and budgets as a Celery stage's ``provider.permit``, taken over HTTP under a claim.

A tab cannot reach Redis or Postgres: the server holds the permit for it. Each route is for
the holder of a claim (the same key scope and the same 409 lease_lost as the lock routes):

* ``POST /v1/claims/{request_id}/permits`` ``{claim_token, provider, tokens, permit_id,
  cell_key?, wait_seconds?}`` — a live claim only. The workspace's budgets are checked
  (402 ``budget_exceeded``: nothing reserved), then the provider's shared limits are
  waited for, at most ``wait_seconds`` (a long poll, at most :data:`MAX_WAIT_SECONDS`):
  200 ``{granted: true, granted_at_ms, expires_in_ms}``, or 429 ``provider_busy`` with
  ``Retry-After`` and ``retry_after_ms`` (at most :data:`MAX_RETRY_HINT_MS`: the long poll
  does the waiting, and a client that asks again soon keeps its workspace counted as
  waiting for its fair share) — nothing held; ask again with the same ``permit_id``. The
  client mints ``permit_id``: a POST repeated after a lost answer finds the permit granted
  and answers it again, without a second admit or a second slot. The id is the client's
  within its workspace and claim only: the provider's shared limits know the permit by an
  id the server derives from the workspace, the claim's request and the client's id.
* ``POST …/permits/{permit_id}/settle`` ``{usage: {input_tokens, output_tokens}, model?}``
  — the call's usage: the reserved estimate is corrected, the slot freed, the ledger row
  written (fenced by the claim's token).
* ``POST …/permits/{permit_id}/rate-limited`` ``{retry_after?}`` — the provider answered
  429: it cools for every client (browser tabs, Celery stages, scripts) that long, at most
  the provider's ``max_cooldown``.
* ``POST …/permits/{permit_id}/release`` ``{outcome}`` — given back without a settle:
  ``unused`` (no call was made: the estimate comes back, no ledger row), ``failed`` (the
  call failed) or ``unsettled`` (its usage is unknown: the estimate stays counted).

Settle, rate-limited and release need the claim's token, not a live lease: the call was
paid for whatever happened to the claim since (the ledger row is then ``fenced`` false).
Each is idempotent: a repeat with the same values answers as the first; another settle of a
settled permit is 422 and changes nothing. A permit not settled (a closed tab) frees its slot
at the provider's ``permit_ttl`` and its budget reservation at the ledger's own TTL.

The permit's record (its provider, estimate, claim and grant time; the claim token only as
a SHA-256) lives in Redis beside the workspace's other keys, for twice the permit's TTL.
The providers are those the server declares (``ONCEFLOW_PROVIDERS``, or ``register`` in the
app's module); an undeclared name is 422. A provider declared without spend hooks of its
own is held to the workspace budgets and recorded in the cost ledger of the app's database.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import random
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from onceflow.connector.trampoline import ado_step, adrive
from onceflow.errors import BudgetBusy, InvalidRequest, LeaseLost, NotFound, OnceflowError
from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.auth import PrincipalDep
from onceflow.integrations.fastapi.budget_refusals import remembered
from onceflow.integrations.fastapi.pull_routes import ClaimBodyIn, claim_holder
from onceflow.integrations.fastapi.responses import AsciiJSONResponse
from onceflow.keys import permit_key
from onceflow.spend import NO_HOOKS, AsyncPermit, Databases, Grant, LedgerHooks, Provider, Usage
from onceflow.spend.limits import POLL_MS, Decision, async_redis, translated
from onceflow.spend.provider import BUDGET_IN_FLIGHT, busy_wait_ms
from onceflow.spend.registry import get_provider

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.services import OnceflowServices

#: The longest a permit POST waits for the limits before answering 429 (a long poll).
MAX_WAIT_SECONDS: Final = 30.0
#: The default wait of a permit POST.
DEFAULT_WAIT_SECONDS: Final = 20.0
#: The largest token count a permit may ask for, or a settle report, per direction.
MAX_TOKENS: Final = 100_000_000
#: The longest "ask again in" a 429 ``provider_busy`` answers: the long poll waits already.
MAX_RETRY_HINT_MS: Final = 1000

ProviderName = Annotated[str, StringConstraints(min_length=1, max_length=200)]
#: A permit id, minted by the client (a uuid4 in hex is 32 of these characters).
PERMIT_ID_PATTERN: Final = r"^[A-Za-z0-9_-]{16,64}$"
PermitId = Annotated[str, StringConstraints(pattern=PERMIT_ID_PATTERN)]
PermitIdPath = Annotated[
    str,
    Path(
        min_length=16,
        max_length=64,
        pattern=PERMIT_ID_PATTERN,
        description="The permit id the client minted: 16 to 64 of A-Z a-z 0-9 _ -.",
    ),
]
CellKey = Annotated[str, StringConstraints(min_length=1, max_length=1000)]
Model = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class PermitIn(ClaimBodyIn):
    """Take a permit of a provider for one call."""

    provider: ProviderName = Field(description="A provider the server declares.")
    tokens: Tokens = Field(
        default=0, description="The call's estimate of input plus output tokens (reserved)."
    )
    permit_id: PermitId = Field(
        description="Minted by the client (a uuid4 in hex): a repeated POST is the same permit."
    )
    cell_key: CellKey | None = Field(
        default=None, description="The compute-lock cell the call is made for (ledger)."
    )
    wait_seconds: float = Field(
        default=DEFAULT_WAIT_SECONDS,
        ge=0,
        le=MAX_WAIT_SECONDS,
        description="How long to wait for the provider's limits before answering 429.",
    )


class PermitOut(BaseModel):
    """A granted permit: make the call, then settle it (or report a 429, or release it)."""

    permit_id: str
    provider: str
    granted: bool = True
    granted_at_ms: int = Field(description="When it was granted (Redis clock, ms since the epoch).")
    expires_in_ms: int = Field(
        description="The permit's TTL: an unsettled permit frees its slot after it."
    )


class PermitBusyOut(BaseModel):
    """429 ``provider_busy``: not granted within the wait; nothing is held."""

    detail: str
    code: Literal["provider_busy"] = "provider_busy"
    provider: str
    reason: str = Field(
        description="Why: cooling, state_lost, concurrency, rpm, tpm, share, budget_in_flight (the "
        "budget is held by calls in flight until they settle), or pending (a "
        "POST of the same permit is waiting already)."
    )
    retry_after_ms: int = Field(
        description="When to ask again (also `Retry-After`, seconds); at most 1000: the next "
        "POST's long poll waits for the rest."
    )


class BudgetExceededOut(BaseModel):
    """402 ``budget_exceeded``: a budget of the workspace has no room; nothing reserved."""

    detail: str
    code: Literal["budget_exceeded"] = "budget_exceeded"
    workspace_id: str
    period: str
    on_exceeded: Literal["fail", "wait"]
    retry_at: str | None = None
    retry_in: float | None = None
    reason: str


class UsageIn(BaseModel):
    """What the call used, as the provider reported it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_tokens: Tokens
    output_tokens: Tokens


class SettleIn(ClaimBodyIn):
    """Settle a permit with the call's usage."""

    usage: UsageIn
    model: Model | None = Field(default=None, description="The model that served the call.")


class RateLimitedIn(ClaimBodyIn):
    """The provider answered 429: cool it for every client."""

    # A Field alike by shape to other bodies' on purpose: its own bounds and documented text.
    retry_after: float | None = Field(
        default=None,
        ge=0,
        le=86_400,
        description="The provider's Retry-After in seconds; none: the provider's cooldown. "
        "It cools the provider at most for the provider's max_cooldown.",
    )


class ReleaseIn(ClaimBodyIn):
    """Give a permit back without a settle."""

    outcome: Literal["unused", "failed", "unsettled"] = Field(
        description="`unused`: no call was made (the estimate comes back, no ledger row); "
        "`failed`: the call failed; `unsettled`: its usage is unknown (estimate counted)."
    )


class SettledOut(BaseModel):
    permit_id: str
    provider: str
    outcome: Literal["ok", "rate_limited", "unused", "failed", "unsettled"]


#: Write a granted permit's record and its TTL at once (a record never lives without one).
#: KEYS: 1 the record. ARGV: 1 TTL ms, then field, value, field, value, …
WRITE_RECORD: Final = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

#: Mark a permit's record settled, if it is still there: 1 marked now, 0 marked before,
#: -1 no record (expired): a settle never leaves a record without its TTL.
MARK_SETTLED: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('HSETNX', KEYS[1], 'settled', ARGV[1])
"""


class UnknownPermit(NotFound):
    """No permit of this id under the claim: never granted, or its record expired."""

    def __init__(self, permit_id: str) -> None:
        self.request_id = permit_id
        self.permit_id = permit_id
        OnceflowError.__init__(
            self, f"no permit {permit_id} under this claim (never granted, or expired)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.permit_id,))


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def slot_id(workspace_id: str, request_id: str, permit_id: str) -> str:
    """The id a client's permit has in the provider's shared limits: derived from its
    workspace, its claim's request and the client's id, so one client id sent under two
    claims (or workspaces) is two permits there, each counted."""
    named = "\x00".join((workspace_id, request_id, permit_id)).encode()
    return "h" + hashlib.sha256(named).hexdigest()[:32]


class ServedProviders:
    """The declared providers as this app serves them: with their own spend hooks, or the
    cost ledger and budgets of the app's database when they were declared without any."""

    def __init__(self, svc: OnceflowServices) -> None:
        self.svc = svc
        self._made: dict[str, tuple[Provider, Provider]] = {}
        self._ledger: LedgerHooks | None = None

    def ledger(self) -> LedgerHooks:
        if self._ledger is None:
            queue = self.svc.queue
            engines = [shard.engine for shard in queue.shards()]
            self._ledger = LedgerHooks(Databases(queue.shard_map, engines=engines))
        return self._ledger

    def get(self, name: str) -> Provider:
        """The provider ``name`` (:class:`~onceflow.spend.UnknownProvider`: 422)."""
        declared = get_provider(name, settings=self.svc.settings)
        made = self._made.get(name)
        if made is None or made[0] is not declared:
            hooks = declared.hooks if declared.hooks is not NO_HOOKS else self.ledger()
            served = Provider(
                name, hooks=hooks, redis_url=declared.redis_url or self.svc.settings.redis_url,
                **declared.declaration(),
            )  # fmt: skip
            made = self._made[name] = (declared, served)
        return made[1]


def _busy(provider: str, reason: str, wait_ms: int) -> JSONResponse:
    wait_ms = max(1, min(int(wait_ms), MAX_RETRY_HINT_MS))
    body = PermitBusyOut(
        detail=f"no permit from provider {provider} yet ({reason}); ask again in {wait_ms} ms",
        provider=provider,
        reason=reason,
        retry_after_ms=wait_ms,
    )
    headers = {"Retry-After": str(max(1, math.ceil(wait_ms / 1000)))}
    return AsciiJSONResponse(body.model_dump(), 429, headers=headers)


async def _acquire(provider: Provider, grant: Grant, slot: str, wait_seconds: float) -> Decision:
    """Admit (budgets), then wait up to ``wait_seconds`` for the limits. Not granted: the
    admit is given back (nothing held) and the last refusal is answered.

    A budget held only by calls in flight (:class:`BudgetBusy`) is asked again until they
    settle or ``wait_seconds`` ends; then the answer is "not yet" (``budget_in_flight``),
    nothing reserved — the client asks again, as for the rate limits."""
    limits, keys = provider.alimits, provider.keys  # the limits know the permit as `slot`
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    while True:
        try:
            await run_in_threadpool(provider.hooks.admit, grant)
            break
        except BudgetBusy as busy:
            wait_ms = busy_wait_ms(busy)
            left = deadline - loop.time()
            if left <= 0:
                return Decision(False, wait_ms=wait_ms, reason=BUDGET_IN_FLIGHT)
            await asyncio.sleep(min(wait_ms / 1000 * random.uniform(0.5, 1.0), left))
    try:
        while True:
            decided = await limits.acquire(
                keys, provider.spec, slot, grant.workspace_id, grant.estimate_tokens,
                provider.epoch_seen,
            )  # fmt: skip
            provider.epoch_seen = decided.epoch
            left = deadline - loop.time()
            if decided.granted or left <= 0:
                break
            # Jittered, so waiters woken by one freed slot do not all ask at once.
            pause = min(decided.wait_ms, POLL_MS) / 1000 * random.uniform(0.5, 1.0)
            await asyncio.sleep(min(pause, left))
    except BaseException:
        await limits.abandon(keys, slot)
        await run_in_threadpool(provider.hooks.release, grant)
        raise
    if not decided.granted:
        await limits.abandon(keys, slot)
        await run_in_threadpool(provider.hooks.release, grant)
    return decided


# Route decorators alike by shape on purpose: FastAPI builds the OpenAPI contract from each one.
def add_permit_routes(
    router: APIRouter, svc: OnceflowServices, responses: dict[int | str, dict[str, Any]]
) -> None:
    """Add the provider-permit routes for claim holders to the ``/v1`` router."""
    served = ServedProviders(svc)

    def redis() -> Any:
        client, _ = async_redis(svc.settings.redis_url)
        return client

    async def record_of(ws: str, permit_id: str) -> dict[str, str]:
        with translated("permit record"):
            raw = await redis().hgetall(permit_key(ws, permit_id))
        return {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }

    def check_holder(record: dict[str, str], request_id: str, token: str) -> None:
        # Another claim's permit answers as a wrong token does: 409 lease_lost, nothing said.
        if record.get("request_id") != request_id or record.get("token") != _token_hash(token):
            raise LeaseLost(request_id)

    def granted(record: dict[str, str], permit_id: str, provider: Provider) -> PermitOut:
        return PermitOut(
            permit_id=permit_id, provider=provider.name,
            granted_at_ms=int(record["granted_at_ms"]),
            expires_in_ms=provider.spec.ttl_ms,
        )  # fmt: skip

    # Route decorator alike by shape on purpose: FastAPI builds the OpenAPI contract from it.
    @router.post(
        "/claims/{request_id}/permits",
        operation_id="take_permit",
        tags=["pull workers"],
        response_model=PermitOut,
        responses={
            **responses,
            402: {"model": BudgetExceededOut, "description": "A budget has no room (nothing "
                  "reserved): `on_exceeded` says whether the stage fails or waits"},
            429: {"model": PermitBusyOut, "description": "Not granted within the wait "
                  "(code provider_busy), or the key's request rate is spent (rate_limited); "
                  "ask again after Retry-After"},
        },
    )  # fmt: skip
    async def take(request_id: s.RequestIdPath, body: PermitIn, principal: PrincipalDep) -> Any:
        """Wait (at most ``wait_seconds``) for a permit of ``provider`` under the workspace's
        budgets and the provider's limits shared with every other client (a live claim)."""
        request = await claim_holder(svc, request_id, body, principal, live=True)
        provider = served.get(body.provider)
        ws = request.workspace_id
        asked = provider.grant_for(
            ws, body.tokens, stage=request.stage, request_id=request.request_id,
            cell_key=body.cell_key, claim_token=body.claim_token,
        )  # fmt: skip
        grant = dataclasses.replace(asked, permit_id=body.permit_id)
        key = permit_key(ws, body.permit_id)
        record = await record_of(ws, body.permit_id)
        if record:
            check_holder(record, request_id, body.claim_token)
            if record.get("provider") != provider.name:
                raise InvalidRequest(
                    f"permit {body.permit_id} is a permit of provider {record.get('provider')}"
                )
            if "settled" in record:
                raise InvalidRequest(
                    f"permit {body.permit_id} is already settled: mint a new permit id"
                )
            if "granted_at_ms" in record:  # a repeated POST whose answer was lost
                return granted(record, body.permit_id, provider)
        waiting = permit_key(ws, body.permit_id, "wait")
        hold_ms = math.ceil((body.wait_seconds + 30) * 1000)
        with translated("permit record"):
            if not await redis().set(waiting, "1", nx=True, px=hold_ms):
                return _busy(provider.name, "pending", 1000)
        try:
            slot = slot_id(ws, request_id, body.permit_id)
            decided = await remembered(
                _acquire(provider, grant, slot, body.wait_seconds), redis(), grant
            )
            if not decided.granted:
                return _busy(provider.name, decided.reason, decided.wait_ms)
            fields = {
                "provider": provider.name, "request_id": request_id,
                "token": _token_hash(body.claim_token), "tokens": str(grant.estimate_tokens),
                "stage": request.stage, "cell_key": body.cell_key or "",
                "granted_at_ms": str(decided.at_ms),
            }  # fmt: skip
            pairs = [part for item in fields.items() for part in item]
            with translated("permit record"):
                await redis().eval(WRITE_RECORD, 1, key, 2 * provider.spec.ttl_ms, *pairs)
            return granted(fields, body.permit_id, provider)
        finally:
            with translated("permit record"):
                await redis().delete(waiting)

    async def held_permit(
        request_id: str, permit_id: str, body: ClaimBodyIn, principal: Any
    ) -> AsyncPermit:
        """The granted permit ``permit_id`` of the body's claim, as it was granted."""
        request = await claim_holder(svc, request_id, body, principal, live=False)
        record = await record_of(request.workspace_id, permit_id)
        if not record or "granted_at_ms" not in record:
            raise UnknownPermit(permit_id)
        check_holder(record, request_id, body.claim_token)
        provider = served.get(record["provider"])
        tokens = int(record["tokens"])
        grant = Grant(
            permit_id=permit_id, workspace_id=request.workspace_id, provider=provider.name,
            estimate_tokens=tokens, estimate_cost=provider.estimate_cost(tokens),
            stage=record.get("stage") or None, request_id=request_id,
            cell_key=record.get("cell_key") or None, claim_token=body.claim_token,
        )  # fmt: skip
        slot = slot_id(request.workspace_id, request_id, permit_id)
        return AsyncPermit(provider, grant, int(record["granted_at_ms"]), slot)

    async def first_settle(permit: AsyncPermit, how: dict[str, Any]) -> None:
        """Mark the permit settled ``how``; a repeat of the same settle may go on (each step
        below is idempotent), another is 422."""
        key = permit_key(permit.grant.workspace_id, permit.permit_id)
        mark = json.dumps(how, sort_keys=True)
        with translated("permit record"):
            marked = int(await redis().eval(MARK_SETTLED, 1, key, mark))
            if marked == 1:
                return
            if marked == -1:
                raise UnknownPermit(permit.permit_id)
            before = await redis().hget(key, "settled")
        before = before.decode() if isinstance(before, bytes) else before
        if before != mark:
            raise InvalidRequest(
                f"permit {permit.permit_id} is already settled ({before}); a repeat must "
                "send the same values"
            )

    def settled_out(permit: AsyncPermit, outcome: str) -> SettledOut:
        return SettledOut(
            permit_id=permit.permit_id,
            provider=permit.provider.name,
            outcome=outcome,  # type: ignore[arg-type]
        )

    @router.post(
        "/claims/{request_id}/permits/{permit_id}/settle",
        operation_id="settle_permit",
        tags=["pull workers"],
        response_model=SettledOut,
        responses={**responses, 404: {"model": s.ErrorOut, "description": "No such permit "
                                     "(never granted, or expired)"}},
    )  # fmt: skip
    async def settle(
        request_id: s.RequestIdPath,
        permit_id: PermitIdPath,
        body: SettleIn,
        principal: PrincipalDep,
    ) -> SettledOut:
        """The call's usage: the estimate corrected, the slot freed, the ledger row written."""
        permit = await held_permit(request_id, permit_id, body, principal)
        usage = Usage(body.usage.input_tokens, body.usage.output_tokens)
        await first_settle(permit, {"outcome": "ok", "usage": [usage.input_tokens,
                                    usage.output_tokens], "model": body.model})  # fmt: skip
        await permit.settle(usage, model=body.model)
        return settled_out(permit, "ok")

    # Route decorator alike by shape on purpose: FastAPI builds the OpenAPI contract from it.
    @router.post(
        "/claims/{request_id}/permits/{permit_id}/rate-limited",
        operation_id="permit_rate_limited",
        tags=["pull workers"],
        response_model=SettledOut,
        responses={**responses, 404: {"model": s.ErrorOut, "description": "No such permit"}},
    )
    async def rate_limited(
        request_id: s.RequestIdPath,
        permit_id: PermitIdPath,
        body: RateLimitedIn,
        principal: PrincipalDep,
    ) -> SettledOut:
        """The provider answered 429: every client waits ``retry_after`` (else the
        provider's cooldown); the permit is settled ``rate_limited``."""
        permit = await held_permit(request_id, permit_id, body, principal)
        await first_settle(permit, {"outcome": "rate_limited", "retry_after": body.retry_after})
        await permit.rate_limited(body.retry_after)
        return settled_out(permit, "rate_limited")

    # Route decorator alike by shape on purpose: FastAPI builds the OpenAPI contract from it.
    @router.post(
        "/claims/{request_id}/permits/{permit_id}/release",
        operation_id="release_permit",
        tags=["pull workers"],
        response_model=SettledOut,
        responses={**responses, 404: {"model": s.ErrorOut, "description": "No such permit"}},
    )
    async def release(
        request_id: s.RequestIdPath,
        permit_id: PermitIdPath,
        body: ReleaseIn,
        principal: PrincipalDep,
    ) -> SettledOut:
        """Give the permit back without a settle (see ``outcome``)."""
        permit = await held_permit(request_id, permit_id, body, principal)
        await first_settle(permit, {"outcome": body.outcome})
        provider, grant = permit.provider, permit.grant
        if body.outcome == "unused":  # no call: the slot and the estimate's tokens come back
            await provider.alimits.settle(
                provider.keys, provider.spec, permit.slot_id, grant.workspace_id,
                grant.estimate_tokens, 0, "released",
            )  # fmt: skip
            await run_in_threadpool(provider.hooks.release, grant)
        else:
            await adrive(permit.leave_steps(body.outcome == "failed", provider.alimits), ado_step)
        return settled_out(permit, body.outcome)
