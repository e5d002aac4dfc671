"""``PullContext.permit``: a provider permit of a Python pull worker, over HTTP.

The same block as ``provider.permit`` in a Celery stage, with the server holding the permit
(``POST /v1/claims/{id}/permits``, ``…/permits/{permit_id}/settle``, ``/rate-limited``,
``/release``): the provider's limits in Redis and the workspace's budgets are the ones every
other client shares::

    with ctx.permit("openai", tokens=1_500, cell_key="eval:fit") as permit:
        reply = call_the_api()
        if reply.status == 429:
            permit.rate_limited(reply.retry_after)   # every client waits it out
            raise RetryLater(reply.retry_after)
        permit.settle(Usage(reply.input_tokens, reply.output_tokens))

Entering the block asks the server for a permit — a long poll of at most 20 s, asked again
(with the same permit id, so a lost answer is never a second permit) at most a second after
each refusal (so the workspace keeps counting as waiting for its fair share) until ``timeout``
(:class:`~onceflow.errors.PermitTimeout`, retryable); the claim's ``check()`` runs between
asks (a lost lease or a cancel stops the wait). A budget's refusal is raised as
:class:`~onceflow.errors.BudgetExceeded` (the outcome table then fails the stage, or retries
it when the next period starts). Leaving the block without a settle gives the permit back:
``failed`` after an exception, ``unsettled`` otherwise (its estimate stays counted: the call
may have been made); :meth:`RemotePermit.release` gives back one that was not used. A
settle that got no answer (the server failing past the worker's retries) is sent again as
it was on leaving the block, so the call's usage is recorded rather than given back.
"""

from __future__ import annotations

import time
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol

from onceflow.errors import InvalidRequest, OnceflowError, PermitTimeout
from onceflow.oplog import TransportError
from onceflow.spend import Provider, Usage

if TYPE_CHECKING:
    from onceflow.integrations.pull_claim import ClaimClient, PullClaim

#: The longest one ask waits on the server (its long poll); asked again until the timeout.
ASK_SECONDS: Final = 20.0
#: The default bound of a permit's wait, as ``provider.permit``'s.
DEFAULT_TIMEOUT: Final = 60.0
#: How long to pause after an ask that got no answer (the server or network failing).
TRANSPORT_PAUSE: Final = 0.5
#: The longest pause between two asks, whatever the server's hint (which for a request or
#: token limit can be most of a window): a workspace counts as waiting for its fair share
#: only while its callers keep asking, and the server's long poll does the waiting.
ASK_PAUSE: Final = 1.0


class PermitHolder(Protocol):
    """What a permit needs of its context: the claim, its calls and its ``check()``."""

    @property
    def worker(self) -> ClaimClient: ...

    @property
    def claim(self) -> PullClaim: ...

    def check(self) -> None: ...


class RemotePermit:
    """A permit the server holds for this claim: settle it, report a 429, or release it."""

    def __init__(self, ctx: PermitHolder, provider: str, permit_id: str, answer: dict[str, Any]):
        self.ctx = ctx
        self.provider = provider
        self.permit_id = permit_id
        #: When it was granted, on the Redis clock (ms since the epoch).
        self.granted_at_ms = int(answer["granted_at_ms"])
        #: Its TTL: not settled by then, its slot is freed for others.
        self.expires_in_ms = int(answer["expires_in_ms"])
        self.outcome: str | None = None
        self.usage: Usage | None = None
        #: A settle, report or release sent without an answer: the server may have applied
        #: it, so only the same one may finish the permit (sent again on leaving).
        self._pending: tuple[str, dict[str, Any], str, Usage | None] | None = None

    def __repr__(self) -> str:
        return f"RemotePermit({self.provider!r}, {self.permit_id!r}, outcome={self.outcome!r})"

    @property
    def settled(self) -> bool:
        return self.outcome is not None

    def _send(
        self, action: str, body: dict[str, Any], outcome: str, usage: Usage | None = None
    ) -> None:
        if self.outcome is not None:
            raise InvalidRequest(f"permit {self.permit_id} is already settled ({self.outcome})")
        sent = (action, body, outcome, usage)
        if self._pending is not None and self._pending != sent:
            raise InvalidRequest(
                f"permit {self.permit_id} was sent {self._pending[0]} {self._pending[1]} "
                "without an answer; only the same may be sent again"
            )
        try:
            self.ctx.worker.permit_call(self.ctx.claim, self.permit_id, action, body)
        except TransportError:  # it may have landed: the same is sent again on leaving
            self._pending = sent
            raise
        self._pending = None
        self.outcome = outcome
        self.usage = usage

    def settle(self, usage: Usage, *, model: str | None = None) -> None:
        """The call's usage: the server corrects the estimate, frees the slot, records it."""
        if not isinstance(usage, Usage):
            raise InvalidRequest(
                f"settle takes a Usage(input_tokens, output_tokens), got {usage!r}"
            )
        body: dict[str, Any] = {
            "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
        }
        if model is not None:
            body["model"] = model
        self._send("settle", body, "ok", usage)

    def rate_limited(self, retry_after: float | None = None) -> None:
        """The provider answered 429: it cools for every client ``retry_after`` seconds (else
        the provider's cooldown); the permit is settled ``rate_limited``."""
        self._send("rate-limited", {"retry_after": retry_after}, "rate_limited")

    def release(self) -> None:
        """No call was made: the slot and the estimate's tokens come back, nothing recorded."""
        self._send("release", {"outcome": "unused"}, "unused")

    def leave(self, failed: bool) -> None:
        """The block was left without a settle: ``failed`` (an exception; no usage known) or
        ``unsettled`` (its estimate stays counted: the call may have been made). A settle
        (or report, or release) that got no answer is sent again as it was instead: the
        call's usage is recorded, not lost to a release."""
        if self._pending is not None:
            self._send(*self._pending)
            return
        outcome = "failed" if failed else "unsettled"
        self._send("release", {"outcome": outcome}, outcome)


class RemotePermitContext:
    """``with ctx.permit(…) as permit``: asks on enter, gives back what is left on exit."""

    # A constructor keeping its arguments (alike by shape with others): nothing to share.
    def __init__(
        self,
        ctx: PermitHolder,
        provider: str,
        tokens: int,
        cell_key: str | None,
        timeout: float,
    ) -> None:
        self.ctx = ctx
        self.provider = provider
        self.tokens = tokens
        self.cell_key = cell_key
        self.timeout = timeout
        #: Minted once: every ask of this block is the same permit on the server.
        self.permit_id = uuid.uuid4().hex
        self.permit: RemotePermit | None = None

    def __enter__(self) -> RemotePermit:
        ctx, worker = self.ctx, self.ctx.worker
        deadline = time.monotonic() + self.timeout
        reason = ""
        while True:
            ctx.check()
            left = deadline - time.monotonic()
            try:
                answer = worker.take_permit(
                    ctx.claim, self.provider, self.tokens, self.permit_id,
                    cell_key=self.cell_key, wait=max(0.0, min(ASK_SECONDS, left)),
                )  # fmt: skip
            except TransportError:  # no answer: ask again (the same permit id)
                reason, pause = "no answer", TRANSPORT_PAUSE
            else:
                if answer.get("granted"):
                    self.permit = RemotePermit(ctx, self.provider, self.permit_id, answer)
                    return self.permit
                reason = str(answer.get("reason", ""))
                pause = min(int(answer.get("retry_after_ms") or 0) / 1000, ASK_PAUSE)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PermitTimeout(self.provider, self.timeout, reason)
            time.sleep(min(pause, left))

    # The context-manager protocol (alike by shape everywhere): Python fixes its signature.
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        permit = self.permit
        if permit is None or permit.settled:
            return
        try:
            permit.leave(exc is not None)
        except OnceflowError as error:
            # Not given back: its slot is freed at the permit's TTL all the same.
            if exc is None:
                raise
            exc.add_note(f"and giving permit {self.permit_id} back failed: {error!r}")


def permit(
    ctx: PermitHolder,
    provider: str | Provider,
    tokens: int = 0,
    *,
    cell_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> RemotePermitContext:
    """A provider permit under ``ctx``'s claim (see the module docstring); every argument
    is checked before anything is sent."""
    name = provider.name if isinstance(provider, Provider) else provider
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise InvalidRequest(f"provider must be a Provider or its name, got {provider!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidRequest(f"tokens must be a whole number, not negative; got {tokens!r}")
    if cell_key is not None and (not isinstance(cell_key, str) or not 0 < len(cell_key) <= 1000):
        raise InvalidRequest("cell_key must be a string of 1..1000 characters")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidRequest(f"timeout must be a number of seconds, got {timeout!r}")
    if timeout != timeout or timeout > 86_400:  # NaN, or past a day
        raise InvalidRequest(f"timeout must be at most a day, got {timeout!r}")
    return RemotePermitContext(ctx, name, tokens, cell_key, float(timeout))


__all__ = ["PermitHolder", "RemotePermit", "RemotePermitContext", "permit"]
