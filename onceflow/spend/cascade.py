"""The cascade: a primary provider and its fallbacks, tried in order.

::

    cascade = Cascade([openai, anthropic, local])

    def ask(permit):
        reply = client_for(permit.provider.name).complete(prompt)   # your call
        if reply.status == 429:
            raise ProviderError(permit.provider.name, 429, retry_after=reply.retry_after)
        if reply.status >= 500:
            raise ProviderError(permit.provider.name, reply.status)
        permit.settle(Usage(reply.input_tokens, reply.output_tokens))
        return reply.text

    text = cascade.call(workspace_id, ask, tokens=1_500)

(``await cascade.acall(workspace_id, ask, …)`` for asyncio: ``ask`` is then a coroutine
function of an :class:`~onceflow.spend.provider.AsyncPermit`.)

A call goes to the first provider that has room now (its requests, tokens and concurrency
allow it, and it is not cooling after a 429). When the function raises
:class:`~onceflow.errors.ProviderError` — a 429 (the provider then cools for every client,
for its ``retry_after``), a 5xx, a timeout (``status=None``) — or a builtin ``TimeoutError``,
the cascade moves on to the next provider and does not come back to the failed one within
this call. Any other exception is the caller's and leaves at once. When no provider has
room, the cascade waits for the first one that has: at most ``timeout`` seconds, calling
``heartbeat`` every ``heartbeat_every`` seconds, ending once ``cancel`` is set. While it
waits, each provider is admitted by the budgets once and asked again under the same permit
id, so the workspace counts as waiting for every provider's fair share, as a caller of
``provider.permit`` does; what still waits when one provider grants, or when the call ends,
is given back. A budget
whose room is held only by the workspace's calls in flight counts as no room yet (reason
``budget_in_flight``); a budget whose period's spend leaves no room (``BudgetExceeded``)
ends the call at once. Each permit
is settled on its own provider, so the spend ledger records which provider served (and
which failed); :class:`~onceflow.errors.CascadeExhausted` when none served.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, TypeVar

from onceflow.connector.trampoline import Call, Sleep, ado_step, adrive, do_step, drive
from onceflow.errors import (
    BudgetBusy,
    BudgetExceeded,
    CascadeExhausted,
    InvalidRequest,
    PermitCancelled,
    ProviderError,
)
from onceflow.spend import checks, spans
from onceflow.spend.hooks import Grant
from onceflow.spend.limits import POLL_MS, Decision
from onceflow.spend.provider import (
    BUDGET_IN_FLIGHT,
    DEFAULT_TIMEOUT,
    AsyncPermit,
    Permit,
    Provider,
    busy_wait_ms,
)

T = TypeVar("T")


class Cascade:
    """Providers tried in order (see the module docstring)."""

    def __init__(self, providers: Sequence[Provider]) -> None:
        chain = list(providers)
        if not chain:
            raise InvalidRequest("a cascade needs at least one provider")
        for p in chain:
            if not isinstance(p, Provider):
                raise InvalidRequest(f"a cascade takes Providers, got {p!r}")
        names = [p.name for p in chain]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"a cascade names each provider once, got {names}")
        self.providers = chain

    def __repr__(self) -> str:
        return f"Cascade([{', '.join(p.name for p in self.providers)}])"

    # Same parameters as Provider.permit on purpose: the public signature, for the docs and typing.
    def call(
        self,
        workspace_id: str,
        fn: Callable[[Permit], T],
        *,
        tokens: int = 0,
        stage: str | None = None,
        request_id: str | None = None,
        cell_key: str | None = None,
        claim_token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: Callable[[], Any] | None = None,
        heartbeat_every: float = checks.DEFAULT_HEARTBEAT_EVERY,
        cancel: checks.CancelFlag | None = None,
    ) -> T:
        """``fn(permit)`` on the first provider with room; its answer (see the module)."""
        grants = self._grants(workspace_id, fn, tokens, stage, request_id, cell_key, claim_token)
        wait = checks.Wait.checked(timeout, heartbeat, heartbeat_every, cancel)
        steps = self._steps(grants, fn, wait, time.monotonic, Permit, asynchronous=False)
        result: T = drive(steps, do_step)
        return result

    # Same parameters as call on purpose: its asyncio twin, a public signature spelled out.
    async def acall(
        self,
        workspace_id: str,
        fn: Callable[[AsyncPermit], Awaitable[T]],
        *,
        tokens: int = 0,
        stage: str | None = None,
        request_id: str | None = None,
        cell_key: str | None = None,
        claim_token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat: Callable[[], Any] | None = None,
        heartbeat_every: float = checks.DEFAULT_HEARTBEAT_EVERY,
        cancel: checks.CancelFlag | None = None,
    ) -> T:
        """:meth:`call` for asyncio: ``await fn(permit)`` with an
        :class:`~onceflow.spend.provider.AsyncPermit` (``await permit.settle(usage)``)."""
        grants = self._grants(workspace_id, fn, tokens, stage, request_id, cell_key, claim_token)
        wait = checks.Wait.checked(timeout, heartbeat, heartbeat_every, cancel)
        clock = asyncio.get_running_loop().time
        steps = self._steps(grants, fn, wait, clock, AsyncPermit, asynchronous=True)
        result: T = await adrive(steps, ado_step)
        return result

    def _grants(
        self,
        workspace_id: str,
        fn: object,
        tokens: int,
        stage: str | None,
        request_id: str | None,
        cell_key: str | None,
        claim_token: str | None,
    ) -> Callable[[Provider], Grant]:
        """Every argument checked, against every provider, before anything is asked: a
        function that makes a provider's next grant."""
        if not callable(fn):
            raise InvalidRequest(f"call takes a function of the permit, got {fn!r}")

        def grant(p: Provider) -> Grant:
            return p.grant_for(
                workspace_id, tokens, stage=stage, request_id=request_id, cell_key=cell_key,
                claim_token=claim_token,
            )  # fmt: skip

        for p in self.providers:
            grant(p)
        return grant

    def _steps(
        self,
        grant_for: Callable[[Provider], Grant],
        fn: Callable[[Any], Any],
        wait: checks.Wait,
        clock: Callable[[], float],
        permit_class: type[Permit],
        *,
        asynchronous: bool,
    ) -> Generator[Any, Any, Any]:
        """The cascade, written once: rounds over the providers until one serves. Whatever
        is still waiting when it ends is given back."""
        waiting: dict[str, Grant] = {}
        try:
            value = yield from self._rounds(
                grant_for, fn, wait, clock, permit_class, waiting, asynchronous=asynchronous
            )
        except BaseException:
            yield from self._give_back(waiting, asynchronous=asynchronous)
            raise
        yield from self._give_back(waiting, asynchronous=asynchronous)
        return value

    def _give_back(
        self, waiting: dict[str, Grant], *, asynchronous: bool
    ) -> Generator[Any, Any, None]:
        """The waiters of this call stop waiting; their admits are released."""
        for p in self.providers:
            grant = waiting.get(p.name)
            if grant is None:
                continue
            del waiting[p.name]
            limits = p.alimits if asynchronous else p.limits
            yield Call(limits.abandon, p.keys, grant.permit_id)
            yield Call.in_thread(p.hooks.release, grant)

    def _rounds(
        self,
        grant_for: Callable[[Provider], Grant],
        fn: Callable[[Any], Any],
        wait: checks.Wait,
        clock: Callable[[], float],
        permit_class: type[Permit],
        waiting: dict[str, Grant],
        *,
        asynchronous: bool,
    ) -> Generator[Any, Any, Any]:
        """Each provider is admitted once and then waits under one permit id across the
        rounds (``waiting``): its workspace counts as waiting for the provider's fair share,
        and no round opens an admit of its own. A provider that grants has the others given
        back before the call; one whose admit finds the budget's room held (by this call's
        other admits among them) has those given back and is asked once more."""
        first_ask = time.monotonic()
        deadline = clock() + wait.timeout
        beat_due = wait.beats(clock)
        failed: dict[str, str] = {}
        refused: dict[str, str] = {}
        slept = False  # the cascade waited for room (the call's span says so, and why)
        while True:
            hint_ms = POLL_MS
            for p in self.providers:
                if p.name in failed:
                    continue
                if wait.cancel is not None and wait.cancel.is_set():
                    raise PermitCancelled(p.name)
                limits = p.alimits if asynchronous else p.limits
                grant = waiting.get(p.name)
                if grant is None:
                    grant = grant_for(p)
                    busy = yield from self._refused_traced(
                        p, self._admit(p, grant, waiting, asynchronous=asynchronous)
                    )
                    if busy is not None:  # its room is held by calls in flight: not yet
                        refused[p.name] = BUDGET_IN_FLIGHT
                        hint_ms = min(hint_ms, busy_wait_ms(busy))
                        continue
                    waiting[p.name] = grant
                decided: Decision = yield Call(
                    limits.acquire, p.keys, p.spec, grant.permit_id, grant.workspace_id,
                    grant.estimate_tokens, p.epoch_seen,
                )  # fmt: skip
                p.epoch_seen = decided.epoch
                if not decided.granted:
                    refused[p.name] = decided.reason
                    hint_ms = min(hint_ms, decided.wait_ms)
                    continue
                del waiting[p.name]
                yield from self._give_back(waiting, asynchronous=asynchronous)
                permit = permit_class(p, grant, decided.at_ms)
                span = spans.start(p)
                if span is not None:
                    span.attach()
                    if slept:  # this provider's last refusal is why it waited
                        span.waiting(refused.get(p.name, "?"), since=first_ask)
                    span.granted()
                try:
                    value = yield Call(fn, permit)
                except ProviderError as exc:
                    failed[p.name] = f"{p.name}: {exc}"
                    try:
                        if exc.status == 429 and not permit.settled:
                            yield from permit.rate_limited_steps(exc.retry_after, limits)
                        yield from permit.leave_steps(True, limits)
                    finally:  # the span ends (and leaves the context) even if Redis fails
                        self._fell_back(span, exc, permit)
                    continue
                except TimeoutError as exc:
                    failed[p.name] = f"{p.name}: timed out ({exc})"
                    try:
                        yield from permit.leave_steps(True, limits)
                    finally:
                        self._fell_back(span, exc, permit)
                    continue
                except BaseException as exc:
                    try:
                        yield from permit.leave_steps(True, limits)
                    finally:
                        if span is not None:
                            span.end(exc, permit)
                    raise
                try:
                    yield from permit.leave_steps(False, limits)
                finally:
                    if span is not None:
                        span.end(None, permit)
                return value
            names = [p.name for p in self.providers]
            if len(failed) == len(self.providers):
                raise CascadeExhausted(names, list(failed.values()))
            left = deadline - clock()
            if left <= 0:
                reasons = [failed.get(n) or f"{n}: no room ({refused.get(n, '?')})" for n in names]
                raise CascadeExhausted(names, reasons)
            if wait.heartbeat is not None and beat_due():
                yield Call(wait.heartbeat)
            slept = True
            yield Sleep(min(hint_ms / 1000 * random.uniform(0.5, 1.0), left))

    @staticmethod
    def _fell_back(span: spans.CallSpan | None, error: BaseException, permit: Permit) -> None:
        """The call span of a provider the cascade moves on from: the reason, then its end."""
        if span is not None:
            span.fell_back(spans.fallback_reason(error))
            span.end(error, permit)

    @staticmethod
    def _refused_traced(
        p: Provider, admit: Generator[Any, Any, BudgetBusy | None]
    ) -> Generator[Any, Any, BudgetBusy | None]:
        """``admit``; a budget's refusal of ``p`` (``BudgetExceeded``, ending the cascade)
        is a call span of its own while tracing, as a permit's refusal is."""
        try:
            return (yield from admit)
        except BudgetExceeded as exc:
            span = spans.start(p)
            if span is not None:
                span.refused(exc)
            raise

    def _admit(
        self, p: Provider, grant: Grant, waiting: dict[str, Grant], *, asynchronous: bool
    ) -> Generator[Any, Any, BudgetBusy | None]:
        """Admit ``grant`` (a budget may refuse: :class:`BudgetExceeded` leaves); None when
        admitted, the :class:`BudgetBusy` when the budget's room is held by calls in flight.
        Held while this call's other providers wait, those are given back and it is asked
        once more: their admits must not keep the cascade from its fallbacks."""
        try:
            yield Call.in_thread(p.hooks.admit, grant)
            return None
        except BudgetBusy as busy:
            if not waiting:
                return busy
        yield from self._give_back(waiting, asynchronous=asynchronous)
        try:
            yield Call.in_thread(p.hooks.admit, grant)
        except BudgetBusy as busy:
            return busy
        return None
