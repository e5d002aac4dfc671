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

A call goes to the first provider that has room now (its requests, tokens and concurrency
allow it, and it is not cooling after a 429). When the function raises
:class:`~onceflow.errors.ProviderError` — a 429 (the provider then cools for every client,
for its ``retry_after``), a 5xx, a timeout (``status=None``) — or a builtin ``TimeoutError``,
the cascade moves on to the next provider and does not come back to the failed one within
this call. Any other exception is the caller's and leaves at once. When no provider has
room, the cascade waits for the first one that has: at most ``timeout`` seconds, calling
``heartbeat`` every ``heartbeat_every`` seconds, ending once ``cancel`` is set. Each permit
is settled on its own provider, so the spend ledger records which provider served (and
which failed); :class:`~onceflow.errors.CascadeExhausted` when none served.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from onceflow.connector.trampoline import do_step, drive
from onceflow.errors import (
    CascadeExhausted,
    InvalidRequest,
    PermitCancelled,
    ProviderError,
)
from onceflow.ids import check_id
from onceflow.spend import checks
from onceflow.spend.hooks import Grant
from onceflow.spend.limits import POLL_MS, Decision
from onceflow.spend.provider import DEFAULT_TIMEOUT, Permit, Provider

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
        cancel: threading.Event | None = None,
    ) -> T:
        """``fn(permit)`` on the first provider with room; its answer (see the module)."""
        if not callable(fn):
            raise InvalidRequest(f"call takes a function of the permit, got {fn!r}")
        check_id("workspace_id", workspace_id)
        wait = checks.Wait.checked(timeout, heartbeat, heartbeat_every, cancel)
        context = {"stage": stage, "request_id": request_id, "cell_key": cell_key,
                   "claim_token": claim_token}  # fmt: skip
        # Every estimate is checked against every provider before anything is asked.
        for p in self.providers:
            p.grant_for(workspace_id, tokens, **context)
        deadline = time.monotonic() + wait.timeout
        beat_due = wait.beats(time.monotonic)
        failed: dict[str, str] = {}
        refused: dict[str, str] = {}
        while True:
            hint_ms = POLL_MS
            for p in self.providers:
                if p.name in failed:
                    continue
                if cancel is not None and cancel.is_set():
                    raise PermitCancelled(p.name)
                grant = p.grant_for(workspace_id, tokens, **context)
                decided = self._try(p, grant)
                if not decided.granted:
                    refused[p.name] = decided.reason
                    hint_ms = min(hint_ms, decided.wait_ms)
                    continue
                served, value, error = self._run(p, grant, decided, fn)
                if served:
                    return value  # type: ignore[return-value]
                failed[p.name] = error
            if len(failed) == len(self.providers):
                raise CascadeExhausted([p.name for p in self.providers], list(failed.values()))
            left = deadline - time.monotonic()
            if left <= 0:
                reasons = [failed.get(p.name) or f"{p.name}: no room ({refused.get(p.name, '?')})"
                           for p in self.providers]  # fmt: skip
                raise CascadeExhausted([p.name for p in self.providers], reasons)
            if heartbeat is not None and beat_due():
                heartbeat()
            pause = min(hint_ms / 1000 * random.uniform(0.5, 1.0), left)
            if cancel is not None:
                cancel.wait(pause)
            else:
                time.sleep(pause)

    @staticmethod
    def _try(provider: Provider, grant: Grant) -> Decision:
        """Admit (the hooks may refuse: that leaves), then one attempt at the limits."""
        provider.hooks.admit(grant)
        decided: Decision = drive(provider.try_acquire_steps(grant, provider.limits), do_step)
        if not decided.granted:
            provider.hooks.release(grant)
        return decided

    @staticmethod
    def _run(
        provider: Provider, grant: Grant, decided: Decision, fn: Callable[[Permit], T]
    ) -> tuple[bool, T | None, str]:
        """``fn`` under the permit: (served, its answer, the error that moves the cascade on)."""
        permit = Permit(provider, grant, decided.at_ms)
        try:
            value = fn(permit)
        except ProviderError as exc:
            if exc.status == 429 and not permit.settled:
                permit.rate_limited(exc.retry_after)
            _leave(permit, failed=True)
            return False, None, f"{provider.name}: {exc}"
        except TimeoutError as exc:
            _leave(permit, failed=True)
            return False, None, f"{provider.name}: timed out ({exc})"
        except BaseException:
            _leave(permit, failed=True)
            raise
        _leave(permit, failed=False)
        return True, value, ""


def _leave(permit: Permit, *, failed: bool) -> None:
    drive(permit.leave_steps(failed, permit.provider.limits), do_step)
