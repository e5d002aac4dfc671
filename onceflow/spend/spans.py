"""A provider call's span: one CLIENT span per permit, after OpenTelemetry's GenAI conventions.

``with provider.permit(…)`` (and ``apermit``) opens the span before the permit waits and
keeps it current for the block, so the user's own HTTP call (an instrumented client)
nests inside it; a :class:`~onceflow.spend.cascade.Cascade` opens one per provider it
calls, siblings of each other, the ones it fell back from carrying the reason. Named
``{gen_ai.operation.name} {gen_ai.request.model}`` (``chat gpt-4o``; the operation alone
when the provider declares no model), with:

- ``gen_ai.operation.name`` (the provider's ``operation``, ``chat`` by default),
  ``gen_ai.provider.name`` and the older ``gen_ai.system`` (the provider's name),
  ``gen_ai.request.model`` (its declared model), ``gen_ai.response.model`` (a model named
  at settle that differs), ``gen_ai.usage.input_tokens`` / ``gen_ai.usage.output_tokens``
  (once the usage is settled);
- ``onceflow.spend.cost`` (the settled usage at the provider's price, when both are
  known), ``onceflow.permit.outcome`` (``granted``: at once; ``waited``: after the limits
  or the budget made it wait, ``onceflow.permit.wait_ms`` long, the last reason in
  ``onceflow.permit.wait_reason``; ``budget_refused``, ``timeout``, ``cancelled``: no
  call was made; ``fallback``: a cascade moved on from this provider, the reason in
  ``onceflow.cascade.reason``: ``rate_limited``, ``provider_error``, ``timeout``),
  ``onceflow.permit.settle`` (``ok``, ``rate_limited``, ``error``, ``unsettled``);
- ``error.type`` (``BudgetExceeded``, ``PermitTimeout``, ``ProviderError``, …) when the
  permit or the call failed.

No prompt, answer, key or workspace id goes on it. With tracing off
(:func:`onceflow.tracing.active`) a permit makes no span and no attribute is built.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any, Protocol

from opentelemetry import context, trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from onceflow import tracing
from onceflow.errors import BudgetExceeded, PermitCancelled, PermitTimeout
from onceflow.spend.usage import Usage

OUTCOME = "onceflow.permit.outcome"


class Provider(Protocol):
    """What a span reads of a :class:`~onceflow.spend.provider.Provider`."""

    name: str
    model: str | None
    operation: str


class Permit(Protocol):
    """What a span reads of a settled :class:`~onceflow.spend.provider.Permit`."""

    outcome: str | None
    usage: Usage | None
    cost: Decimal | None
    model: str | None

    @property
    def provider(self) -> Provider: ...


class CallSpan:
    """The span of one provider call through a permit (see the module); made by
    :func:`start` only while tracing is on."""

    def __init__(self, provider: Provider) -> None:
        model = provider.model
        operation = provider.operation
        out: dict[str, AttributeValue] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider.name,
            "gen_ai.system": provider.name,
        }
        if model is not None:
            out["gen_ai.request.model"] = model
        name = operation if model is None else f"{operation} {model}"
        self.span: Span = tracing.TRACER.start_span(name, kind=SpanKind.CLIENT, attributes=out)
        self._attached: object | None = None
        self._started = time.monotonic()
        self._reasons: list[str] = []

    def attach(self) -> None:
        """Make the span current (until :meth:`end`): the block's calls nest inside it."""
        self._attached = context.attach(trace.set_span_in_context(self.span))

    def waiting(self, reason: str, *, since: float | None = None) -> None:
        """The permit waits (the limits refused for ``reason``, or the budget is busy);
        ``since``: when the wait began (``time.monotonic``), if before the span did."""
        self._reasons.append(reason)
        if since is not None:
            self._started = min(self._started, since)

    def granted(self) -> None:
        """The permit was granted: ``granted``, or ``waited`` with how long and why."""
        if not self._reasons:
            self.span.set_attribute(OUTCOME, "granted")
            return
        waited_ms = round((time.monotonic() - self._started) * 1000, 3)
        self.span.set_attributes(
            {
                OUTCOME: "waited",
                "onceflow.permit.wait_ms": waited_ms,
                "onceflow.permit.wait_reason": self._reasons[-1],
            }
        )

    def refused(self, error: BaseException) -> None:
        """No permit: the budget refused, the wait timed out or was cancelled; ends it."""
        if isinstance(error, BudgetExceeded):
            self.span.set_attribute(OUTCOME, "budget_refused")
        elif isinstance(error, PermitTimeout):
            self.span.set_attribute(OUTCOME, "timeout")
        elif isinstance(error, PermitCancelled):
            self.span.set_attribute(OUTCOME, "cancelled")
        self.end(error)

    def fell_back(self, reason: str) -> None:
        """A cascade moves on from this provider, for ``reason``."""
        self.span.set_attributes({OUTCOME: "fallback", "onceflow.cascade.reason": reason})

    def end(self, error: BaseException | None = None, permit: Permit | None = None) -> None:
        """What the permit settled (tokens, cost, model), the error if one left the block;
        the span ends and stops being current."""
        span = self.span
        if permit is not None:
            settled(span, permit)
        if error is not None:
            tracing.ended_with(span, error)
        if self._attached is not None:
            context.detach(self._attached)  # type: ignore[arg-type]
            self._attached = None
        span.end()


def settled(span: Span, permit: Permit) -> None:
    """A settled permit's outcome, usage, cost and (a different) model on ``span``."""
    out: dict[str, AttributeValue] = {}
    if permit.outcome is not None:
        out["onceflow.permit.settle"] = permit.outcome
    usage = permit.usage
    if usage is not None:
        out["gen_ai.usage.input_tokens"] = usage.input_tokens
        out["gen_ai.usage.output_tokens"] = usage.output_tokens
    if permit.cost is not None:
        out["onceflow.spend.cost"] = float(permit.cost)
    model = permit.model
    if model is not None and model != permit.provider.model:
        out["gen_ai.response.model"] = model
    span.set_attributes(out)


def start(provider: Provider) -> CallSpan | None:
    """The call span of a permit on ``provider``; None while tracing is off."""
    return CallSpan(provider) if tracing.active() else None


def fallback_reason(error: BaseException) -> str:
    """Why a cascade moved on from a provider: ``rate_limited`` (429), ``timeout``, or
    ``provider_error`` (a 5xx, another failure the cascade falls back on)."""
    status: Any = getattr(error, "status", None)
    if status == 429:
        return "rate_limited"
    if isinstance(error, TimeoutError) or (status is None and hasattr(error, "status")):
        return "timeout"
    return "provider_error"
