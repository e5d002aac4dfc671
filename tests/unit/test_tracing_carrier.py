"""The trace context a row keeps (W3C text) and where a stage run's span goes."""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from onceflow import tracing


def test_without_an_sdk_nothing_is_recorded_or_stored() -> None:
    assert not tracing.active()
    with tracing.TRACER.start_as_current_span("x") as span:
        assert not span.is_recording()
        assert tracing.current_carrier() is None


def test_a_span_context_round_trips_through_the_stored_text(trace_spans: Any) -> None:
    assert tracing.active()
    with tracing.TRACER.start_as_current_span("enqueue") as span:
        stored = tracing.current_carrier()
    assert stored is not None and stored.startswith("00-")
    back = tracing.span_context_from(stored)
    assert back is not None
    assert (back.trace_id, back.span_id) == (
        span.get_span_context().trace_id,
        span.get_span_context().span_id,
    )
    assert back.is_remote


def test_tracestate_is_kept_after_a_newline() -> None:
    stored = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\nvendor=abc"
    back = tracing.span_context_from(stored)
    assert back is not None and back.trace_state.get("vendor") == "abc"
    assert tracing.carrier_of(back) == stored


def test_bad_stored_text_is_ignored_never_an_error() -> None:
    zero = "00-" + "0" * 32 + "-" + "0" * 16 + "-01"  # the invalid all-zero ids
    for bad in (None, "", "garbage", "00-zz-yy-01", "x" * 5000, zero):
        assert tracing.span_context_from(bad) is None
        assert tracing.context_from(bad) is None
        assert tracing.link_to(bad) == []


def test_a_run_goes_under_its_enqueue_and_links_to_it(trace_spans: Any) -> None:
    with tracing.TRACER.start_as_current_span("enqueue") as enqueue:
        stored = tracing.current_carrier()
    parent, links = tracing.run_parent(stored)
    with tracing.TRACER.start_as_current_span("run", context=parent, links=links) as run:
        pass
    assert run.get_span_context().trace_id == enqueue.get_span_context().trace_id
    assert run.parent is not None and run.parent.span_id == enqueue.get_span_context().span_id
    assert [link.context.span_id for link in run.links] == [enqueue.get_span_context().span_id]


def test_a_run_nests_inside_a_current_span_of_the_same_trace(trace_spans: Any) -> None:
    with tracing.TRACER.start_as_current_span("enqueue"):
        stored = tracing.current_carrier()
        with tracing.TRACER.start_as_current_span("celery run") as celery:
            parent, links = tracing.run_parent(stored)
            with tracing.TRACER.start_as_current_span("run", context=parent, links=links) as run:
                pass
    assert parent is None
    assert run.parent is not None and run.parent.span_id == celery.get_span_context().span_id


def test_a_current_span_of_another_trace_is_linked_not_followed(trace_spans: Any) -> None:
    with tracing.TRACER.start_as_current_span("enqueue") as enqueue:
        stored = tracing.current_carrier()
    token = otel_context.attach(otel_context.Context())  # a wake-up sent without the context
    try:
        with tracing.TRACER.start_as_current_span("delivery") as delivery:
            parent, links = tracing.run_parent(stored)
            with tracing.TRACER.start_as_current_span("run", context=parent, links=links) as run:
                pass
    finally:
        otel_context.detach(token)
    assert run.get_span_context().trace_id == enqueue.get_span_context().trace_id
    linked = {link.context.span_id for link in run.links}
    assert linked == {enqueue.get_span_context().span_id, delivery.get_span_context().span_id}


def test_a_row_without_a_context_runs_under_what_is_current() -> None:
    assert tracing.run_parent(None) == (None, [])


def test_the_tracer_follows_a_provider_installed_after_import(trace_spans: Any) -> None:
    with tracing.TRACER.start_as_current_span("late") as span:
        assert span.is_recording()
    assert [s.name for s in trace_spans.get_finished_spans()] == ["late"]
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_workspace_ids_only_when_asked(monkeypatch: Any) -> None:
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    try:
        assert "onceflow.workspace_id" not in tracing.attributes(workspace_id="acme")
        monkeypatch.setenv("ONCEFLOW_TRACE_WORKSPACE_IDS", "true")
        get_settings.cache_clear()
        assert tracing.attributes(workspace_id="acme")["onceflow.workspace_id"] == "acme"
    finally:
        monkeypatch.delenv("ONCEFLOW_TRACE_WORKSPACE_IDS", raising=False)
        get_settings.cache_clear()


def test_headers_of_a_stored_context_are_w3c_and_a_bad_one_sends_none() -> None:
    stored = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\nvendor=abc"
    assert tracing.headers_of(stored) == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=abc",
    }
    assert tracing.headers_of("00-bad\r\nInjected: header") == {}
    assert tracing.headers_of(None) == {}
    assert tracing.current_headers() == {}  # no span current
