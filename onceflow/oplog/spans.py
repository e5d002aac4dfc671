"""The op log's spans: ``onceflow.op.apply`` for each op applied, and the commit broadcast.

``apply_op`` (every API's: :class:`~onceflow.oplog.OpLog`, :class:`~onceflow.oplog.AsyncOpLog`,
and through them the HTTP routes, the in-process transports and the outbox's replays) runs
inside one ``onceflow.op.apply`` span (INTERNAL) with:

- ``onceflow.op.outcome``: ``applied``, ``duplicate`` (the op id was applied already: the
  original clock and result are returned), ``rejected`` (the op did not apply to the
  sub-doc's state; recorded), ``conflict`` (the op id was used for another op),
  ``refused`` (a replay older than the retention horizon), or ``error`` (with
  ``error.type``, e.g. ``LeaseLost`` for a fenced write whose claim is over);
- ``onceflow.op.clock`` (the commit clock assigned, or the original one of a duplicate),
  ``onceflow.op.duplicate``, ``onceflow.op.type`` (the op's kind, e.g. ``cell.set``),
  ``onceflow.op.fenced`` (written under a stage's claim).

A new commit's broadcast is a child ``onceflow.op.broadcast`` (PRODUCER) with the channel's
kind (``onceflow.channel.kind``: ``workspace``) and the message's (``commit``), an
``error.type`` when the publish failed (the write stays committed). Neither names the
sub-doc (its name may carry user data), the op id, the payload or the workspace. With
tracing off (:func:`onceflow.tracing.active`) none of this runs.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from onceflow import tracing
from onceflow.errors import OpIdConflict, ReplayTooOld
from onceflow.oplog.records import ApplyResult

APPLY_SPAN = "onceflow.op.apply"
BROADCAST_SPAN = "onceflow.op.broadcast"
OUTCOME = "onceflow.op.outcome"


def start(*, fenced: bool) -> Span | None:
    """The span of one apply; None while tracing is off."""
    if not tracing.active():
        return None
    return tracing.TRACER.start_span(
        APPLY_SPAN, kind=SpanKind.INTERNAL, attributes={"onceflow.op.fenced": fenced}
    )


@tracing.guarded
def applied(span: Span, result: ApplyResult, op_type: str) -> None:
    """What the apply answered: its outcome, clock and kind."""
    if result.duplicate:
        outcome = "duplicate"
    elif result.error is not None:
        outcome = "rejected"
    else:
        outcome = "applied"
    out: dict[str, AttributeValue] = {
        OUTCOME: outcome,
        "onceflow.op.duplicate": result.duplicate,
        "onceflow.op.type": op_type,
    }
    if result.clock is not None:
        out["onceflow.op.clock"] = result.clock
    span.set_attributes(out)


def failed(span: Span, error: BaseException) -> None:
    """The apply raised: its outcome and ``error.type``; ends the span."""
    if isinstance(error, OpIdConflict):
        outcome = "conflict"
    elif isinstance(error, ReplayTooOld):
        outcome = "refused"
    else:
        outcome = "error"
    span.set_attribute(OUTCOME, outcome)
    tracing.ended_with(span, error)
    span.end()


def broadcast(parent: Span) -> Span | None:
    """The span of a commit's broadcast, under its apply's span (None if it could not be
    started: the publish goes ahead untraced)."""
    try:
        return _broadcast(parent)
    except Exception:
        return None


def _broadcast(parent: Span) -> Span:
    return tracing.TRACER.start_span(
        BROADCAST_SPAN,
        context=trace.set_span_in_context(parent),
        kind=SpanKind.PRODUCER,
        attributes={
            "messaging.system": "redis",
            "messaging.operation.type": "send",
            "onceflow.channel.kind": "workspace",
            "onceflow.message.kind": "commit",
        },
    )


@tracing.guarded
def sent(span: Span | None, error: BaseException | None) -> None:
    """The broadcast is over (``error``: why the publish failed); ends its span."""
    if span is None:
        return
    if error is not None:
        tracing.ended_with(span, error)
    span.end()


@tracing.guarded
def ended(span: Span) -> None:
    """End an apply's span (after its commit: an error here never reaches the caller)."""
    span.end()
