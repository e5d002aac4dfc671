"""A provider with limits shared by every process, and the permit that one call takes.

::

    openai = Provider("openai", rpm=500, tpm=200_000, concurrency=20,
                      price=Price("2.50", "10.00"), model="gpt-4o")

    with openai.permit(workspace_id, tokens=1_500, heartbeat=claim.heartbeat) as permit:
        reply = call_the_api()
        if reply.status == 429:
            permit.rate_limited(reply.retry_after)   # every client waits it out
            raise RetryLater(...)
        permit.settle(Usage(reply.input_tokens, reply.output_tokens))

Entering the block asks the spend hooks first (a budget, which may refuse), then waits —
bounded by ``timeout``, cancellable by ``cancel``, calling ``heartbeat`` between attempts
so a stage's lease is extended — until the provider's requests, tokens and concurrency
allow the call (:mod:`onceflow.spend.limits`). A budget whose room is held only by the
workspace's calls in flight (their reserved estimates) makes the permit wait the same way,
asking again as those calls settle. The estimate is reserved in the tokens-per-window
count and corrected by :meth:`Permit.settle`. A block left without a
settle frees the concurrency slot and keeps the estimate counted (the call may have been
made); a permit whose process died frees its slot after ``permit_ttl``, counted as expired.

The same body serves ``with provider.permit(…)`` and ``async with provider.apermit(…)``:
both run one generator of steps on the trampoline (:mod:`onceflow.connector.trampoline`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Generator
from datetime import UTC, datetime
from decimal import Decimal
from types import TracebackType
from typing import Any, Final, Literal

from onceflow.cache import capture
from onceflow.connector.trampoline import Call, Sleep, ado_step, adrive, do_step, drive
from onceflow.errors import BudgetBusy, InvalidRequest, PermitCancelled, PermitTimeout
from onceflow.ids import check_id
from onceflow.spend import checks, spans
from onceflow.spend.hooks import (
    NO_HOOKS,
    OUTCOME_ERROR,
    OUTCOME_OK,
    OUTCOME_RATE_LIMITED,
    OUTCOME_UNSETTLED,
    Grant,
    SpendHooks,
)
from onceflow.spend.limits import (
    POLL_MS,
    AsyncLimits,
    Decision,
    LimitSpec,
    ProviderKeys,
    Settled,
    SyncLimits,
)
from onceflow.spend.usage import Price, Usage

#: How long every client waits after a 429 that carried no Retry-After.
DEFAULT_COOLDOWN: Final = 5.0
#: The longest a 429 cools a provider by default, whatever Retry-After it reports.
DEFAULT_MAX_COOLDOWN: Final = 300.0
#: A permit's default lifetime: past it, a holder that never settled frees its slot.
DEFAULT_PERMIT_TTL: Final = 600.0
#: The default bound of a permit's wait.
DEFAULT_TIMEOUT: Final = 60.0
#: A permit's wait that ends while its budget's room is held by calls in flight: the reason
#: its :class:`~onceflow.errors.PermitTimeout` gives.
BUDGET_IN_FLIGHT: Final = "budget_in_flight"

ColdStart = Literal["known", "full", "empty"]
Steps = Generator[Any, Any, Any]


def busy_wait_ms(busy: BudgetBusy) -> int:
    """How long a permit whose budget is busy waits before asking again (ms): the budget's
    hint, at most :data:`~onceflow.spend.limits.POLL_MS` (so heartbeats and cancels are
    seen)."""
    hint = busy.retry_in
    if isinstance(hint, bool) or not isinstance(hint, int | float) or not math.isfinite(hint):
        return POLL_MS
    return max(1, min(math.ceil(hint * 1000), POLL_MS))


def _ms(at_ms: int) -> datetime:
    return datetime.fromtimestamp(at_ms / 1000, tz=UTC)


class Provider:
    """A third-party API with limits shared by every process (see the module docstring).

    ``rpm`` and ``tpm`` count requests and tokens (input and output) over a sliding window
    of ``window_seconds`` (60: per minute; a provider that publishes per-second limits is
    declared with ``window_seconds=1``); ``concurrency`` bounds the calls in flight. Any
    may be None: no limit. ``price`` turns usage into money for the spend hooks. ``model``
    and ``operation`` (``chat`` by default) name a call's trace span
    (:mod:`onceflow.spend.spans`).

    A 429 cools the provider for every client for its ``Retry-After``, else ``cooldown``
    seconds, and never longer than ``max_cooldown`` (300 by default; it bounds ``cooldown``
    too): a caller that reports a day's Retry-After, by mistake or on purpose, stops the
    others for minutes at most.

    ``cold_start`` says what a Redis that lost the provider's state (a restart without
    persistence) means: the calls of the window before the loss are unknown. ``"known"``
    (the default) counts that window as full once a process that had seen the state finds
    it gone or begun again, so a running deployment never goes over, while a new provider
    (no process has seen it) starts at once. ``"full"`` counts it as full on every new
    state, the provider's first use included; ``"empty"`` never does (a Redis with
    persistence, where a lost state is not expected).
    """

    # Provider's keywords spelled out on purpose: the public constructor, for the docs and typing.
    def __init__(
        self,
        name: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        concurrency: int | None = None,
        price: Price | None = None,
        model: str | None = None,
        operation: str = "chat",
        window_seconds: float = 60.0,
        permit_ttl: float = DEFAULT_PERMIT_TTL,
        cooldown: float = DEFAULT_COOLDOWN,
        max_cooldown: float = DEFAULT_MAX_COOLDOWN,
        cold_start: ColdStart = "known",
        hooks: SpendHooks = NO_HOOKS,
        redis_url: str | None = None,
    ) -> None:
        self.name = check_id("provider name", name, max_len=200)
        self.rpm = checks.limit("rpm", rpm)
        self.tpm = checks.limit("tpm", tpm)
        self.concurrency = checks.limit("concurrency", concurrency)
        if price is not None and not isinstance(price, Price):
            raise InvalidRequest(f"price must be a Price, got {price!r}")
        self.price = price
        self.model = None if model is None else check_id("model", model, max_len=200)
        #: What a call does, for its trace span (``gen_ai.operation.name``: ``chat``,
        #: ``embeddings``, ``text_completion``, …).
        self.operation = check_id("operation", operation, max_len=100)
        self.window_seconds = checks.seconds(
            "window_seconds", window_seconds, low=0.001, zero=False
        )
        self.permit_ttl = checks.seconds("permit_ttl", permit_ttl, low=0.001, zero=False)
        self.cooldown = checks.seconds("cooldown", cooldown)
        self.max_cooldown = checks.seconds("max_cooldown", max_cooldown)
        if cold_start not in ("known", "full", "empty"):
            raise InvalidRequest(
                f'cold_start must be "known", "full" or "empty", got {cold_start!r}'
            )
        self.cold_start: ColdStart = cold_start
        if not all(callable(getattr(hooks, m, None)) for m in ("admit", "settle", "release")):
            raise InvalidRequest(f"hooks must have admit, settle and release, got {hooks!r}")
        self.hooks = hooks
        self.redis_url = redis_url
        self.keys = ProviderKeys(self.name)
        self.spec = LimitSpec(
            rpm=-1 if self.rpm is None else self.rpm,
            tpm=-1 if self.tpm is None else self.tpm,
            concurrency=-1 if self.concurrency is None else self.concurrency,
            window_ms=max(1, round(self.window_seconds * 1000)),
            ttl_ms=max(1, round(self.permit_ttl * 1000)),
            cold_start=cold_start,
        )
        #: The epoch of the provider's state in Redis as this process last saw it.
        self.epoch_seen = ""
        self.limits = SyncLimits(redis_url)
        self.alimits = AsyncLimits(redis_url)

    def __repr__(self) -> str:
        return (
            f"Provider({self.name!r}, rpm={self.rpm}, tpm={self.tpm}, "
            f"concurrency={self.concurrency})"
        )

    def declaration(self) -> dict[str, Any]:
        """What the provider was declared with (two declarations of a name must agree)."""
        return {
            "rpm": self.rpm,
            "tpm": self.tpm,
            "concurrency": self.concurrency,
            "price": self.price,
            "model": self.model,
            "operation": self.operation,
            "window_seconds": self.window_seconds,
            "permit_ttl": self.permit_ttl,
            "cooldown": self.cooldown,
            "max_cooldown": self.max_cooldown,
            "cold_start": self.cold_start,
        }

    # ------------------------------------------------------------------ permits

    # Keyword options alike by shape to record_hit's on purpose: the stage run a permit serves.
    def grant_for(
        self,
        workspace_id: str,
        tokens: int,
        *,
        stage: str | None = None,
        request_id: str | None = None,
        cell_key: str | None = None,
        claim_token: str | None = None,
    ) -> Grant:
        """The :class:`Grant` a permit asks for (every argument checked, nothing written)."""
        check_id("workspace_id", workspace_id)
        checks.tokens("tokens", tokens)
        if self.tpm is not None and tokens > self.tpm:
            raise InvalidRequest(
                f"an estimate of {tokens} tokens is above provider {self.name}'s tpm of "
                f"{self.tpm}: it could never be granted"
            )
        for what, value in (("stage", stage), ("request_id", request_id),
                            ("cell_key", cell_key), ("claim_token", claim_token)):  # fmt: skip
            if value is not None:
                check_id(what, value)
        return Grant(
            workspace_id=workspace_id,
            provider=self.name,
            estimate_tokens=tokens,
            estimate_cost=self.estimate_cost(tokens),
            stage=stage,
            request_id=request_id,
            cell_key=cell_key,
            claim_token=claim_token,
        )

    def estimate_cost(self, tokens: int) -> Decimal | None:
        """An upper bound of what ``tokens`` may cost: each at the dearer of the two prices."""
        if self.price is None:
            return None
        dearer = max(self.price.input_per_million, self.price.output_per_million)
        return tokens * dearer / Decimal(1_000_000)

    # Same parameters as Cascade.call on purpose: the public signature, for the docs and typing.
    def permit(
        self,
        workspace_id: str,
        tokens: int = 0,
        *,
        stage: str | None = None,
        request_id: str | None = None,
        cell_key: str | None = None,
        claim_token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: Callable[[], Any] | None = None,
        heartbeat_every: float = checks.DEFAULT_HEARTBEAT_EVERY,
        cancel: checks.CancelFlag | None = None,
    ) -> PermitContext:
        """A context manager that waits for a permit and gives a :class:`Permit`.

        :class:`~onceflow.errors.PermitTimeout` (retryable) when none is granted within
        ``timeout`` seconds, :class:`~onceflow.errors.PermitCancelled` once ``cancel`` is
        set. ``heartbeat`` is called every ``heartbeat_every`` seconds while the permit
        waits (a stage's ``ctx.heartbeat`` keeps its lease); whatever it raises (a lost
        lease) stops the wait too. The spend hooks may refuse first (``BudgetExceeded``:
        the period's spend leaves no room for the estimate); a budget whose room is held
        only by the workspace's calls in flight makes the permit wait within the same
        bound (its ``PermitTimeout`` then gives the reason ``budget_in_flight``).
        """
        grant = self.grant_for(
            workspace_id, tokens, stage=stage, request_id=request_id, cell_key=cell_key,
            claim_token=claim_token,
        )  # fmt: skip
        wait = checks.Wait.checked(timeout, heartbeat, heartbeat_every, cancel)
        return PermitContext(self, grant, wait)

    # Same parameters as permit on purpose: its asyncio twin, a public signature spelled out.
    def apermit(
        self,
        workspace_id: str,
        tokens: int = 0,
        *,
        stage: str | None = None,
        request_id: str | None = None,
        cell_key: str | None = None,
        claim_token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: Callable[[], Any] | None = None,
        heartbeat_every: float = checks.DEFAULT_HEARTBEAT_EVERY,
        cancel: checks.CancelFlag | None = None,
    ) -> AsyncPermitContext:
        """:meth:`permit` for asyncio: ``async with provider.apermit(…) as permit``.

        ``heartbeat`` may be a coroutine function; the spend hooks run in a worker thread.
        """
        grant = self.grant_for(
            workspace_id, tokens, stage=stage, request_id=request_id, cell_key=cell_key,
            claim_token=claim_token,
        )  # fmt: skip
        wait = checks.Wait.checked(timeout, heartbeat, heartbeat_every, cancel)
        return AsyncPermitContext(self, grant, wait)

    def try_acquire_steps(self, grant: Grant, limits: SyncLimits | AsyncLimits) -> Steps:
        """One attempt, no wait: the :class:`Decision` (the cascade's probe; it admits and
        releases with the hooks itself)."""
        decided: Decision = yield Call(
            limits.acquire, self.keys, self.spec, grant.permit_id, grant.workspace_id,
            grant.estimate_tokens, self.epoch_seen,
        )  # fmt: skip
        self.epoch_seen = decided.epoch
        if not decided.granted:
            yield Call(limits.abandon, self.keys, grant.permit_id)
        return decided

    def admit_steps(
        self,
        grant: Grant,
        wait: checks.Wait,
        clock: Callable[[], float],
        deadline: float,
        beat_due: Callable[[], bool],
        span: spans.CallSpan | None = None,
    ) -> Steps:
        """Ask the spend hooks to admit ``grant``. While they answer
        :class:`~onceflow.errors.BudgetBusy` (the budget's room is held by calls in flight,
        which usually settle below their estimates), wait and ask again: until ``deadline``
        (:class:`~onceflow.errors.PermitTimeout`, reason :data:`BUDGET_IN_FLIGHT`), or the
        cancel event, calling the heartbeat when due. ``BudgetExceeded`` leaves at once."""
        while True:
            if wait.cancel is not None and wait.cancel.is_set():
                raise PermitCancelled(self.name)
            try:
                yield Call.in_thread(self.hooks.admit, grant)
                return
            except BudgetBusy as busy:
                held = busy
            if span is not None:
                span.waiting(BUDGET_IN_FLIGHT)
            left = deadline - clock()
            if left <= 0:
                raise PermitTimeout(self.name, wait.timeout, BUDGET_IN_FLIGHT) from held
            if wait.heartbeat is not None and beat_due():
                yield Call(wait.heartbeat)
            # Jittered, so the waiters of one workspace do not all ask at once.
            yield Sleep(min(busy_wait_ms(held) / 1000 * random.uniform(0.5, 1.0), left))

    def acquire_steps(
        self,
        grant: Grant,
        limits: SyncLimits | AsyncLimits,
        wait: checks.Wait,
        clock: Callable[[], float],
        span: spans.CallSpan | None = None,
    ) -> Steps:
        """Admit (waiting while the budget's room is held by calls in flight), then wait
        for the limits: the granting :class:`Decision`. ``span``: the call's trace span,
        told of each wait."""
        deadline = clock() + wait.timeout
        beat_due = wait.beats(clock)
        yield from self.admit_steps(grant, wait, clock, deadline, beat_due, span)
        reason = ""
        try:
            while True:
                if wait.cancel is not None and wait.cancel.is_set():
                    raise PermitCancelled(self.name)
                decided: Decision = yield Call(
                    limits.acquire, self.keys, self.spec, grant.permit_id, grant.workspace_id,
                    grant.estimate_tokens, self.epoch_seen,
                )  # fmt: skip
                self.epoch_seen = decided.epoch
                if decided.granted:
                    return decided
                reason = decided.reason
                if span is not None:
                    span.waiting(reason)
                left = deadline - clock()
                if left <= 0:
                    raise PermitTimeout(self.name, wait.timeout, reason)
                if wait.heartbeat is not None and beat_due():
                    yield Call(wait.heartbeat)
                # Jittered, so waiters woken by one freed slot do not all ask at once.
                pause = min(decided.wait_ms, POLL_MS) / 1000 * random.uniform(0.5, 1.0)
                yield Sleep(min(pause, left))
        except BaseException:
            yield Call(limits.abandon, self.keys, grant.permit_id)
            yield Call.in_thread(self.hooks.release, grant)
            raise

    # ------------------------------------------------------------------ shared state

    def rate_limited(self, retry_after: float | None = None) -> int:
        """Cool the provider for every client (a 429 seen outside a permit): the ms left."""
        return self.limits.cool(self.keys, self.spec, self.cooling_ms(retry_after))

    def cooling_ms(self, retry_after: float | None) -> int:
        """How long a 429 cools the provider: ``retry_after``, else :attr:`cooldown`; at
        most :attr:`max_cooldown` (one caller's report cannot stop every client for long)."""
        seconds = (
            self.cooldown if retry_after is None else checks.seconds("retry_after", retry_after)
        )
        return max(1, math.ceil(min(seconds, self.max_cooldown) * 1000))

    def stats(self) -> dict[str, int]:
        """The provider's counters in Redis: ``granted``, ``denied_<reason>``, ``expired``
        (permits freed by their TTL), ``cooled``, ``state_lost``, ``settled_<outcome>``, and
        now: ``in_flight``, ``window_requests``, ``window_tokens``, ``cooling_ms``."""
        return self.limits.stats(self.keys)

    def reset(self) -> None:
        """Forget the provider's shared state (its windows, holders, cooling and counters).

        Meant for tests and for an operator who knows no call is in flight: the next
        acquire starts as on a new provider (``cold_start`` applies).
        """
        self.limits.reset(self.keys)


class Permit:
    """One granted call on a provider: settle it with the call's usage, or report a 429."""

    def __init__(
        self, provider: Provider, grant: Grant, granted_at_ms: int, slot_id: str | None = None
    ) -> None:
        self.provider = provider
        self.grant = grant
        #: Its entry in the provider's shared limits: the permit id, unless whoever took the
        #: permit named it otherwise (a permit taken over HTTP: an id the server derives, so
        #: a client's own id never meets another workspace's or claim's).
        self.slot_id = grant.permit_id if slot_id is None else slot_id
        #: When it was granted, on the Redis clock (ms since the epoch).
        self.granted_at_ms = granted_at_ms
        self.outcome: str | None = None
        self.usage: Usage | None = None
        #: What the settled usage cost at the provider's price (None when either is unknown).
        self.cost: Decimal | None = None
        #: The model named at settle, else the provider's.
        self.model: str | None = None
        self._released: Settled | None = None
        self._pending: tuple[Usage | None, str, str | None] | None = None

    @property
    def permit_id(self) -> str:
        return self.grant.permit_id

    @property
    def settled_at_ms(self) -> int | None:
        """When its slot was given back, on the Redis clock (None before)."""
        return None if self._released is None else self._released.at_ms

    @property
    def settled(self) -> bool:
        """Whether the permit was settled (with usage, a 429, or on leaving its block)."""
        return self.outcome is not None

    def settle_steps(
        self,
        usage: Usage | None,
        outcome: str,
        model: str | None,
        limits: SyncLimits | AsyncLimits,
    ) -> Steps:
        if usage is not None and not isinstance(usage, Usage):
            raise InvalidRequest(
                f"settle takes a Usage(input_tokens, output_tokens), got {usage!r}"
            )
        if model is not None:
            check_id("model", model, max_len=200)
        if self.outcome is not None:
            raise InvalidRequest(
                f"permit {self.permit_id} on provider {self.provider.name} is already "
                f"settled ({self.outcome})"
            )
        released = self._released
        if released is None:
            actual = None if usage is None else usage.total_tokens
            released = yield Call(
                limits.settle, self.provider.keys, self.provider.spec, self.slot_id,
                self.grant.workspace_id, self.grant.estimate_tokens, actual, outcome,
            )  # fmt: skip
            self._released = released
            self._pending = (usage, outcome, model)
        elif self._pending is not None and self._pending != (usage, outcome, model):
            # The limits were settled, the hooks failed: only the same settle may finish it.
            first, first_outcome, _ = self._pending
            raise InvalidRequest(
                f"permit {self.permit_id} was settled with {first!r} ({first_outcome}); "
                "its record can only be retried with the same usage"
            )
        price = self.provider.price
        cost = price.cost(usage) if price is not None and usage is not None else None
        yield Call.in_thread(
            self.provider.hooks.settle, self.grant, usage, outcome, self.provider.name,
            model or self.provider.model, cost, _ms(self.granted_at_ms), _ms(released.at_ms),
        )  # fmt: skip
        self.outcome = outcome
        self.usage = usage
        self.cost = cost
        self.model = model or self.provider.model
        if usage is not None:  # what a cached computation paid (onceflow.cache.capture)
            capture.settled(
                self.provider.name, model or self.provider.model, usage.input_tokens,
                usage.output_tokens, cost,
            )  # fmt: skip

    def settle(self, usage: Usage, *, model: str | None = None) -> None:
        """The call's usage: the reserved estimate is corrected to it (usage above the
        estimate is counted in full), the concurrency slot freed, the spend recorded.
        A second settle, or usage that is not a :class:`Usage`, is refused (nothing changes)."""
        if not isinstance(usage, Usage):
            raise InvalidRequest(
                f"settle takes a Usage(input_tokens, output_tokens), got {usage!r}"
            )
        drive(self.settle_steps(usage, OUTCOME_OK, model, self.provider.limits), do_step)

    def rate_limited(self, retry_after: float | None = None) -> None:
        """The provider answered 429: it cools for every client for ``retry_after`` seconds
        (else the provider's ``cooldown``), on the Redis clock; this permit is settled with
        its estimate counted (outcome ``rate_limited``)."""
        drive(self.rate_limited_steps(retry_after, self.provider.limits), do_step)

    def rate_limited_steps(
        self, retry_after: float | None, limits: SyncLimits | AsyncLimits
    ) -> Steps:
        ms = self.provider.cooling_ms(retry_after)
        if self.outcome is not None:
            raise InvalidRequest(f"permit {self.permit_id} is already settled ({self.outcome})")
        yield Call(limits.cool, self.provider.keys, self.provider.spec, ms)
        yield from self.settle_steps(None, OUTCOME_RATE_LIMITED, None, limits)

    def leave_steps(self, failed: bool, limits: SyncLimits | AsyncLimits) -> Steps:
        """The block is left unsettled: free the slot, keep the estimate counted. A settle
        whose record failed (the limits were settled) is retried as it was."""
        if self.outcome is not None:
            return
        if self._pending is not None:
            yield from self.settle_steps(*self._pending, limits)
        else:
            outcome = OUTCOME_ERROR if failed else OUTCOME_UNSETTLED
            yield from self.settle_steps(None, outcome, None, limits)


class AsyncPermit(Permit):
    """:class:`Permit` for asyncio: ``await permit.settle(usage)``."""

    async def settle(self, usage: Usage, *, model: str | None = None) -> None:  # type: ignore[override]
        if not isinstance(usage, Usage):
            raise InvalidRequest(
                f"settle takes a Usage(input_tokens, output_tokens), got {usage!r}"
            )
        await adrive(self.settle_steps(usage, OUTCOME_OK, model, self.provider.alimits), ado_step)

    async def rate_limited(self, retry_after: float | None = None) -> None:  # type: ignore[override]
        await adrive(self.rate_limited_steps(retry_after, self.provider.alimits), ado_step)


class PermitContext:
    """``with provider.permit(…) as permit``: waits on enter, settles what is left on exit."""

    def __init__(self, provider: Provider, grant: Grant, wait: checks.Wait) -> None:
        self.provider = provider
        self.grant = grant
        self.wait = wait
        self.permit: Permit | None = None
        self.span: spans.CallSpan | None = None

    def __enter__(self) -> Permit:
        span = self.span = spans.start(self.provider)
        if span is not None:
            span.attach()
        steps = self.provider.acquire_steps(
            self.grant, self.provider.limits, self.wait, time.monotonic, span
        )
        try:
            decided: Decision = drive(steps, do_step)
        except BaseException as exc:
            if span is not None:
                span.refused(exc)
            raise
        if span is not None:
            span.granted()
        self.permit = Permit(self.provider, self.grant, decided.at_ms)
        return self.permit

    # The context-manager protocol (alike by shape everywhere): Python fixes its signature.
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.permit is None:  # the wait failed: nothing was granted
            return
        leave = self.permit.leave_steps(exc is not None, self.provider.limits)
        try:
            if exc is None:
                drive(leave, do_step)
                return
            try:
                drive(leave, do_step)
            except Exception as error:  # the block's own exception is the one to see
                exc.add_note(f"and settling permit {self.grant.permit_id} failed: {error!r}")
        finally:
            if self.span is not None:
                self.span.end(exc, self.permit)


class AsyncPermitContext:
    """``async with provider.apermit(…) as permit``."""

    def __init__(self, provider: Provider, grant: Grant, wait: checks.Wait) -> None:
        self.provider = provider
        self.grant = grant
        self.wait = wait
        self.permit: AsyncPermit | None = None
        self.span: spans.CallSpan | None = None

    async def __aenter__(self) -> AsyncPermit:
        loop = asyncio.get_running_loop()
        span = self.span = spans.start(self.provider)
        if span is not None:
            span.attach()
        limits = self.provider.alimits
        steps = self.provider.acquire_steps(self.grant, limits, self.wait, loop.time, span)
        try:
            decided: Decision = await adrive(steps, ado_step)
        except BaseException as exc:
            if span is not None:
                span.refused(exc)
            raise
        if span is not None:
            span.granted()
        self.permit = AsyncPermit(self.provider, self.grant, decided.at_ms)
        return self.permit

    # The async context-manager protocol (alike by shape everywhere): Python fixes its signature.
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.permit is None:
            return
        leave = self.permit.leave_steps(exc is not None, self.provider.alimits)
        try:
            if exc is None:
                await adrive(leave, ado_step)
                return
            try:
                await adrive(leave, ado_step)
            except Exception as error:
                exc.add_note(f"and settling permit {self.grant.permit_id} failed: {error!r}")
        finally:
            if self.span is not None:
                self.span.end(exc, self.permit)
