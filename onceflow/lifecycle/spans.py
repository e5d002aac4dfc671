"""The spans of a stage run, alike under every runner (the Celery stage task, the standalone
worker, the Python pull worker).

- ``onceflow.run {stage}`` (consumer): one attempt's body and what it came to
  (``onceflow.outcome``), in the trace its row was enqueued under
  (:func:`onceflow.tracing.run_parent`). Current while the body runs: what the body does
  (compute locks, ops, provider calls) nests under it, and the rows its hand-offs create
  keep its trace.
- ``onceflow.claim``: a claim of one request by id (attempt, lease, claimed or not).
- ``onceflow.complete`` / ``onceflow.fail``: the outcome's fenced write, under the run;
  ``onceflow.fenced`` says whether the lease still held (False: refused, the lease lost).
- ``onceflow.hand_off`` (producer): a completion's follow-ups (``onceflow.hand_offs``),
  current while they are written, so their rows keep its context.
- ``onceflow.heartbeat.failed``: an event on the run span (``error.type``); a heartbeat
  that succeeds records nothing.

Every function here does nothing but return when no SDK is installed: a run then has no
span (None), and what takes the run's span does nothing for None — no further check.
Attributes are ids, counts and outcomes only (see :mod:`onceflow.tracing.spans`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from onceflow import tracing
from onceflow.models.requests import Claim

#: The run span's name, then a space and the stage.
RUN = "onceflow.run"
CLAIM = "onceflow.claim"
COMPLETE = "onceflow.complete"
FAIL = "onceflow.fail"
HAND_OFF = "onceflow.hand_off"
HEARTBEAT_FAILED = "onceflow.heartbeat.failed"


def start_run(
    stored: str | None,
    *,
    request_id: str,
    stage: str,
    worker_class: str | None,
    attempt: int,
    workspace_id: str | None,
    lease_seconds: float,
) -> Span | None:
    """The (not yet current) span of one attempt's body, in the trace of ``stored`` (the
    row's trace context); None when tracing is off. End it with :func:`end_run`."""
    if not tracing.active():
        return None
    parent, links = tracing.run_parent(stored)
    attributes = tracing.attributes(
        request_id=request_id, stage=stage, worker_class=worker_class, attempt=attempt,
        workspace_id=workspace_id, operation="process",
    )  # fmt: skip
    attributes["onceflow.lease_seconds"] = float(lease_seconds)
    return tracing.TRACER.start_span(
        f"{RUN} {stage}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes,
        links=links,
    )  # fmt: skip


def start_claimed(claim: Claim) -> Span | None:
    """:func:`start_run` of a queue's :class:`Claim`."""
    if not tracing.active():
        return None
    request = claim.request
    return start_run(
        claim.trace_context, request_id=request.request_id, stage=request.stage,
        worker_class=request.worker_class, attempt=claim.attempt,
        workspace_id=request.workspace_id, lease_seconds=claim.lease_seconds,
    )  # fmt: skip


@tracing.guarded
def end_run(span: Span | None, outcome: str, error: BaseException | None = None) -> None:
    """End a run span with what the run came to (``onceflow.outcome``: ``succeeded``,
    ``retry``, ``dead``, ``cancelled``, ``lease_lost``, …) and, when the body raised,
    the error's type."""
    if span is None:
        return
    span.set_attribute("onceflow.outcome", outcome)
    if error is not None:
        tracing.ended_with(span, error)
    span.end()


@contextmanager
def running(
    span: Span | None, *, request_id: str, workspace_id: str | None, stage: str, attempt: int
) -> Iterator[None]:
    """The run's log fields (:func:`onceflow.tracing.log_fields`) and, when traced, its span
    current, around the body; the span is not ended here."""
    with (
        tracing.log_fields(
            request_id=request_id, workspace_id=workspace_id, stage=stage, attempt=attempt
        ),
        current(span),
    ):
        yield


def current(span: Span | None) -> AbstractContextManager[Any]:
    """``span`` current in the block (not ended, nothing recorded of an exception: the
    runner records what it decides); no-op for None."""
    if span is None:
        return nullcontext()
    return trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    )


def write_span(
    name: str,
    parent: Span | None,
    attributes: dict[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    start_time: int | None = None,
) -> Span | None:
    """A (not current) span under ``parent`` (the run span), or None when there is none: a
    run without a span is not traced (the runner found tracing off), and its writes cost
    nothing more."""
    if parent is None:
        return None
    return tracing.TRACER.start_span(
        name, context=trace.set_span_in_context(parent), kind=kind, attributes=attributes,
        start_time=start_time,
    )  # fmt: skip


@tracing.guarded
def end_write(
    span: Span | None,
    *,
    fenced: bool | None,
    error: BaseException | None = None,
    **attributes: AttributeValue,
) -> None:
    """End a write's span: ``onceflow.fenced`` (True: written under the live lease; False:
    refused, the lease lost; None: not known — the database stayed away), more attributes,
    and the error's type when it raised."""
    if span is None:
        return
    if fenced is not None:
        span.set_attribute("onceflow.fenced", fenced)
    for key, value in attributes.items():
        span.set_attribute(f"onceflow.{key}", value)
    if error is not None:
        tracing.ended_with(span, error)
    span.end()


@tracing.guarded
def claim_span(
    claim: Claim | None,
    started_ns: int,
    *,
    request_id: str,
    stage: str,
    worker_class: str | None,
    workspace_id: str | None,
    lease_seconds: float | None,
) -> None:
    """Record the ``onceflow.claim`` span of a claim by id that began at ``started_ns``
    (``time.time_ns()``), once its answer is known: a claim that took the row goes into the
    row's trace (where its run goes), one that did not under the current span."""
    if not tracing.active():
        return
    parent = None
    links: list[Any] = []
    if claim is not None:
        parent, links = tracing.run_parent(claim.trace_context)
    attributes = tracing.attributes(
        request_id=request_id, stage=stage, worker_class=worker_class,
        attempt=None if claim is None else claim.attempt, workspace_id=workspace_id,
        operation="receive",
    )  # fmt: skip
    if claim is not None:
        lease_seconds = claim.lease_seconds
    if lease_seconds is not None:
        attributes["onceflow.lease_seconds"] = float(lease_seconds)
    attributes["onceflow.claimed"] = claim is not None
    span = tracing.TRACER.start_span(
        CLAIM, context=parent, kind=SpanKind.CONSUMER, attributes=attributes, links=links,
        start_time=started_ns,
    )  # fmt: skip
    span.end()


@tracing.guarded
def heartbeat_failed(span: Span | None, error: BaseException) -> None:
    """Note a failed heartbeat on the run span (``error.type`` only)."""
    if span is not None and span.is_recording():
        span.add_event(HEARTBEAT_FAILED, {"error.type": type(error).__qualname__})


def now_ns() -> int:
    """When a span about to be recorded began (0 when tracing is off: not read)."""
    return time.time_ns() if tracing.active() else 0


__all__ = [
    "CLAIM",
    "COMPLETE",
    "FAIL",
    "HAND_OFF",
    "HEARTBEAT_FAILED",
    "RUN",
    "claim_span",
    "current",
    "end_run",
    "end_write",
    "heartbeat_failed",
    "now_ns",
    "running",
    "start_claimed",
    "start_run",
    "write_span",
]
