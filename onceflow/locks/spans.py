"""The compute lock's span: one ``onceflow.compute`` (INTERNAL) per ``compute_once`` call.

:func:`traced` runs a protocol (:mod:`onceflow.locks.protocol`, or the cache path of
:mod:`onceflow.locks.once`) inside the span, current while it runs: the provider calls
``compute()`` makes are its children. The protocol notes its steps on it as events
(``onceflow.lock.acquired``, ``onceflow.lock.waiting``, ``onceflow.lock.compute``,
``onceflow.cache.hit``, …) rather than child spans: each step is one round trip, and a
span per step would cost more than the step; the events' times still show where a call
spent its time. The span ends with:

- ``onceflow.lock.result``: ``preflight_hit`` (the value was stored already),
  ``double_check_hit`` (the lock was taken, and the double-check found the value),
  ``computed`` (this caller held the lock and paid for the call), ``waited`` (another
  holder computed; this caller was served its value), ``lock_lost`` (computed, but the
  lock was lost before the store), ``cache_hit`` (served by the result cache), ``locked``
  (``wait=False`` found the lock taken), or ``error`` (with ``error.type``);
- ``onceflow.lock.backend`` (``redis``, ``sql``), ``onceflow.lock.waited_ms`` (a waiter's
  wait), ``onceflow.lock.rounds`` (more than 1 after a holder failed or a wait timed out),
  ``onceflow.lock.duplicate`` (true when this caller paid for a value someone else had
  stored first), ``onceflow.lock.with_lock`` (false when the lock's backend was down and
  the call was made without it).

A holder keeps its span's context beside the lock (the Redis backend's holder key, in the
acquire's own round trip); a waiter reads it once when it starts waiting and links to it
(``onceflow.link``: ``lock_holder``). Nothing here names the lock's key, the cell, or a
value. With tracing off (:func:`onceflow.tracing.active`) none of this runs: the protocol
makes the same round trips as without tracing.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

from opentelemetry import context, trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from onceflow import tracing

R = TypeVar("R")

#: The span's name.
COMPUTE_SPAN = "onceflow.compute"
#: Its outcome attribute, and the values the protocol's outcomes map to.
RESULT = "onceflow.lock.result"
RESULTS = {
    "preflight": "preflight_hit",
    "double_check": "double_check_hit",
    "computed": "computed",
    "waited": "waited",
    "lock_lost": "lock_lost",
    "cache_hit": "cache_hit",
}
#: The attributes of a waiter's link to its holder's compute span.
HOLDER_LINK: dict[str, AttributeValue] = {"onceflow.link": "lock_holder"}

_span: ContextVar[Span | None] = ContextVar("onceflow_compute_span", default=None)


def traced(steps: Generator[Any, Any, R]) -> Generator[Any, Any, R]:
    """``steps`` inside an ``onceflow.compute`` span, current while they run (call it only
    when :func:`onceflow.tracing.active`: otherwise run ``steps`` as they are)."""
    span = tracing.TRACER.start_span(COMPUTE_SPAN, kind=SpanKind.INTERNAL)
    attached = context.attach(trace.set_span_in_context(span))
    mine = _span.set(span)
    try:
        result = yield from steps
    except BaseException as exc:
        span.set_attribute(RESULT, "error")
        tracing.ended_with(span, exc)
        raise
    else:
        _ended(span, result)
        return result
    finally:
        _span.reset(mine)
        context.detach(attached)
        span.end()


def _ended(span: Span, result: Any) -> None:
    path = getattr(result, "path", None)
    if path is None:  # Locked: wait=False found the lock taken
        span.set_attribute(RESULT, "locked")
        return
    out: dict[str, AttributeValue] = {RESULT: RESULTS.get(str(path), str(path))}
    if result.waited_seconds:
        out["onceflow.lock.waited_ms"] = round(result.waited_seconds * 1000, 3)
    if result.rounds != 1:
        out["onceflow.lock.rounds"] = result.rounds
    if result.duplicate:
        out["onceflow.lock.duplicate"] = True
    if not result.with_lock:
        out["onceflow.lock.with_lock"] = False
    span.set_attributes(out)


def current() -> Span | None:
    """The ``onceflow.compute`` span the running protocol is in (None with tracing off)."""
    return _span.get()


def backend(name: str) -> None:
    """Name the lock's backend on the current compute span."""
    span = _span.get()
    if span is not None:
        span.set_attribute("onceflow.lock.backend", name)


def event(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """An event on the current compute span (nothing when there is none)."""
    span = _span.get()
    if span is not None:
        span.add_event(name, attributes)


def holder() -> str | None:
    """What a caller taking the lock keeps beside it: its compute span's context (None when
    there is no compute span)."""
    span = _span.get()
    return None if span is None else tracing.carrier_of(span)


def link_holder(stored: str | None, seen: set[str]) -> None:
    """Link the current compute span to the holder whose context ``stored`` is (once per
    holder: ``seen`` keeps the ones linked already)."""
    span = _span.get()
    if span is None or stored is None or stored in seen:
        return
    holder_context = tracing.span_context_from(stored)
    if holder_context is not None:
        seen.add(stored)
        span.add_link(holder_context, HOLDER_LINK)
