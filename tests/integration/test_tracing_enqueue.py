"""An enqueue's span and the trace context its rows keep (real Postgres)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import SpanProcessor
from sqlalchemy import Engine, text

from onceflow import NewRequest, Queue, tracing


def _stored(engine: Engine) -> dict[str, str | None]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT request_id, trace_context FROM workspace_process_requests")
        ).all()
    return {r[0]: r[1] for r in rows}


def test_the_row_keeps_the_enqueue_span_under_the_callers_span(
    queue: Queue, clean_db: Engine, trace_spans: Any
) -> None:
    with tracing.TRACER.start_as_current_span("POST /requests") as caller:
        made = queue.enqueue("evaluate", "w1", "j1", "main", {"cols": ["a"]})
    (enqueue,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"]
    assert enqueue.parent is not None
    assert enqueue.parent.span_id == caller.get_span_context().span_id
    assert enqueue.attributes["onceflow.request_id"] == made.request_id
    assert enqueue.attributes["onceflow.stage"] == "evaluate"
    assert enqueue.attributes["onceflow.created"] == 1
    assert enqueue.attributes["messaging.system"] == "onceflow"
    assert "onceflow.workspace_id" not in enqueue.attributes  # opt-in only
    stored = tracing.span_context_from(_stored(clean_db)[made.request_id])
    assert stored is not None
    assert (stored.trace_id, stored.span_id) == (
        enqueue.context.trace_id,
        enqueue.context.span_id,
    )


def test_a_duplicate_enqueue_links_to_the_request_it_joined(
    api_queue: Queue, clean_db: Engine, trace_spans: Any
) -> None:
    first = api_queue.enqueue("evaluate", "w1", "j1", "main", {"cols": ["a"]})
    again = api_queue.enqueue("evaluate", "w1", "j1", "main", {"cols": ["a"]})
    assert first.created and not again.created
    spans = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"]
    assert len(spans) == 2
    original, duplicate = spans
    assert duplicate.attributes["onceflow.joined"] == 1
    assert [link.context.span_id for link in duplicate.links] == [original.context.span_id]
    assert duplicate.context.trace_id != original.context.trace_id  # its own trace, linked
    # The row keeps the first enqueue's context: the duplicate changed nothing.
    stored = tracing.span_context_from(_stored(clean_db)[first.request_id])
    assert stored is not None and stored.span_id == original.context.span_id


def test_a_batch_is_one_span_and_each_row_keeps_its_context(
    queue: Queue, clean_db: Engine, trace_spans: Any
) -> None:
    queue.enqueue("evaluate", "w1", "j0")
    items = [NewRequest(workspace_id="w1", job_id=f"j{i}", stage="evaluate") for i in range(3)]
    results = queue.enqueue_many(items)
    batch = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"][-1]
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert (batch.attributes["onceflow.created"], batch.attributes["onceflow.joined"]) == (2, 1)
    assert len(batch.links) == 1
    stored = _stored(clean_db)
    for result in results:
        if result.created:
            parsed = tracing.span_context_from(stored[result.request_id])
            assert parsed is not None and parsed.span_id == batch.context.span_id


def test_without_an_sdk_rows_keep_no_context(queue: Queue, clean_db: Engine) -> None:
    made = queue.enqueue("evaluate", "w1", "j1")
    assert _stored(clean_db)[made.request_id] is None


class _Broken(SpanProcessor):
    """A span processor that fails at each span's start, or at its end."""

    def __init__(self, at: str) -> None:
        self.at = at

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.at == "start":
            raise RuntimeError("processor failed at start")

    def on_end(self, span: Any) -> None:
        if self.at == "end":
            raise RuntimeError("processor failed at end")


@pytest.mark.parametrize("at", ["start", "end"])
def test_a_failing_span_processor_never_fails_an_enqueue_or_an_op(
    at: str, queue: Queue, clean_db: Engine, trace_spans: Any
) -> None:
    from opentelemetry import trace

    from onceflow import OpLog
    from onceflow.settings import get_settings

    trace.get_tracer_provider().add_span_processor(_Broken(at))  # type: ignore[attr-defined]
    made = queue.enqueue("evaluate", "w1", "j1")
    assert made.created
    assert made.request_id in _stored(clean_db)
    oplog = OpLog(clean_db, get_settings())
    op = {"type": "cell.set", "column": "a", "value": 1}
    applied = oplog.apply_op("w1", "doc", op, op_id="op-failing-processor")
    again = oplog.apply_op("w1", "doc", op, op_id="op-failing-processor")
    assert again.duplicate and again.clock == applied.clock
