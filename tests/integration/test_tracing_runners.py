"""The spans of a stage's life under each Python runner, in the trace its request was enqueued in.

OpenTelemetry's SDK runs in this process with an in-memory exporter: a request enqueued
under a span is run by the Celery stage runtime (called as a stage task calls it, and by a
real Celery worker consuming a real Redis broker, with Celery's own instrumentation), and by
the standalone :class:`~onceflow.worker.Worker`; the sweeper rescues a lapsed lease. Each
time the spans land in the enqueue's trace, under the parents the lifecycle promises, and
the log lines of a body carry the request's fields and the run's span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import tracing
from onceflow.errors import RetryLater
from onceflow.keys import queue_name
from onceflow.models.status import Status
from onceflow.queue import Queue
from onceflow.settings import Settings, get_settings
from onceflow.tasks import Flow, StageContext
from onceflow.tasks.runtime import run_request
from onceflow.worker import Worker

WC = "wc-trace"
WS = "w-trace"


class Empty(BaseModel):
    pass


#: What the bodies do besides their work (set per test; read in the body).
ENGINE: list[Engine] = []
BODY_LOG = logging.getLogger("tests.tracing.body")


def _lapse(request_id: str) -> None:
    """End the running row's lease now (as if this worker had stalled past it)."""
    with ENGINE[0].begin() as conn:
        conn.execute(
            text(
                "UPDATE workspace_process_requests SET lease_expires_at = now() "
                "- interval '1 second' WHERE request_id = :rid"
            ),
            {"rid": request_id},
        )


def make_flow(settings: Settings | None = None) -> Flow:
    flow = Flow(name="trace-runners", settings=settings)

    @flow.stage("echo", input=Empty, worker_class=WC)
    def echo(ctx: StageContext, data: Empty) -> dict[str, Any]:
        BODY_LOG.info("echo body ran")
        return {"ok": True}

    @flow.stage("flaky", input=Empty, worker_class=WC)
    def flaky(ctx: StageContext, data: Empty) -> dict[str, Any]:
        if ctx.attempt == 1:
            raise RetryLater(0, "once more")
        return {"ok": ctx.attempt}

    @flow.stage("hand", input=Empty, worker_class=WC)
    def hand(ctx: StageContext, data: Empty) -> dict[str, Any]:
        ctx.then("echo", {})
        return {"handed": True}

    @flow.stage("stalls", input=Empty, worker_class=WC)
    def stalls(ctx: StageContext, data: Empty) -> dict[str, Any]:
        _lapse(ctx.request.request_id)  # the completion finds the lease gone
        return {"late": True}

    @flow.stage("loses_lease", input=Empty, worker_class=WC, lease_seconds=0.6)
    def loses_lease(ctx: StageContext, data: Empty) -> dict[str, Any]:
        _lapse(ctx.request.request_id)
        deadline = time.monotonic() + 30
        while not ctx.lease_lost and time.monotonic() < deadline:  # a heartbeat learns it
            time.sleep(0.02)
        ctx.check()
        return {}

    return flow


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture()
def spans(trace_spans: InMemorySpanExporter, clean_db: Engine) -> InMemorySpanExporter:
    """The in-memory SDK of ``trace_spans`` (tests/conftest.py), on the test's database."""
    ENGINE[:] = [clean_db]
    return trace_spans


@pytest.fixture()
def flow(clean_db: Engine, redis_url: str) -> Iterator[Flow]:
    made = make_flow()
    yield made
    made.queue.close()


@pytest.fixture()
def logged() -> Iterator[list[logging.LogRecord]]:
    """The records of the bodies' logger, through the filter every onceflow handler has."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    handler.addFilter(tracing.LogContextFilter())
    BODY_LOG.addHandler(handler)
    BODY_LOG.setLevel(logging.INFO)
    yield records
    BODY_LOG.removeHandler(handler)


# ------------------------------------------------------------------------------- helpers


def enqueued(
    flow: Flow, spans: InMemorySpanExporter, stage: str, job: str, **options: Any
) -> tuple[str, ReadableSpan, ReadableSpan]:
    """Enqueue ``stage`` under a client span: (request id, client span, enqueue span)."""
    with tracing.TRACER.start_as_current_span("client") as span:
        rid = flow.queue.enqueue(stage, WS, job, "", {}, worker_class=WC, **options).request_id
    [client] = [s for s in named(spans, "client") if s.context == span.get_span_context()]
    [enqueue] = [
        s for s in named(spans, "onceflow.enqueue") if attr(s, "onceflow.request_id") == rid
    ]
    return rid, client, enqueue


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def one(spans: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, (name, [s.name for s in spans.get_finished_spans()])
    return found[0]


def attr(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(key)


def runs_of(spans: InMemorySpanExporter, rid: str) -> list[ReadableSpan]:
    return sorted(
        (s for s in spans.get_finished_spans()
         if s.name.startswith("onceflow.run ") and attr(s, "onceflow.request_id") == rid),
        key=lambda s: attr(s, "onceflow.attempt"),
    )  # fmt: skip


def children(spans: InMemorySpanExporter, parent: ReadableSpan, name: str) -> list[ReadableSpan]:
    return [
        s for s in named(spans, name)
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    ]  # fmt: skip


def wait_for(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def run(flow: Flow, stage: str, rid: str) -> dict[str, Any]:
    """Run ``rid`` as a stage task does (claim by id, run, record)."""
    return run_request(
        flow.queue, flow.spec(stage), rid, "host:1", lambda _: True, flow.dispatch,
        workspace_id=WS,
    )  # fmt: skip


def assert_continues(run_span: ReadableSpan, client: ReadableSpan, enqueue: ReadableSpan) -> None:
    """``run_span`` is in the client's trace, under the enqueue, linked to it."""
    assert run_span.context.trace_id == client.context.trace_id
    assert run_span.parent is not None and run_span.parent.span_id == enqueue.context.span_id
    assert [link.context.span_id for link in run_span.links] == [enqueue.context.span_id]
    assert run_span.links[0].attributes == {"onceflow.link": "enqueue"}


# ------------------------------------------------------------------ the Celery runtime


def test_a_stage_task_runs_in_the_trace_of_its_enqueue(
    flow: Flow, spans: InMemorySpanExporter, logged: list[logging.LogRecord]
) -> None:
    rid, client, enqueue = enqueued(flow, spans, "echo", "j1")
    outcome = run(flow, "echo", rid)
    assert outcome["outcome"] == "succeeded"

    [run_span] = runs_of(spans, rid)
    assert run_span.name == "onceflow.run echo"
    assert run_span.kind is SpanKind.CONSUMER
    assert_continues(run_span, client, enqueue)
    assert attr(run_span, "onceflow.stage") == "echo"
    assert attr(run_span, "onceflow.worker_class") == WC
    assert attr(run_span, "onceflow.attempt") == 1
    assert attr(run_span, "messaging.operation.type") == "process"
    assert attr(run_span, "onceflow.lease_seconds") == flow.queue.lease_for(None)
    assert attr(run_span, "onceflow.outcome") == "succeeded"
    assert attr(run_span, "onceflow.workspace_id") is None  # only when opted in
    assert run_span.status.status_code is StatusCode.UNSET

    claim = one(spans, "onceflow.claim")
    assert claim.context.trace_id == client.context.trace_id
    assert attr(claim, "onceflow.claimed") is True and attr(claim, "onceflow.attempt") == 1
    assert claim.start_time <= run_span.start_time

    [complete] = children(spans, run_span, "onceflow.complete")
    assert attr(complete, "onceflow.fenced") is True
    assert not named(spans, "onceflow.hand_off")

    # The body's log line: the request's fields and the run's span.
    [line] = [r for r in logged if r.getMessage() == "echo body ran"]
    assert (line.request_id, line.workspace_id, line.stage, line.attempt) == (rid, WS, "echo", 1)
    assert line.trace_id == format(client.context.trace_id, "032x")
    assert line.span_id == format(run_span.context.span_id, "016x")


def test_a_claim_that_finds_nothing_says_so(flow: Flow, spans: InMemorySpanExporter) -> None:
    rid, _, _ = enqueued(flow, spans, "echo", "j-twice")
    assert run(flow, "echo", rid)["outcome"] == "succeeded"
    spans.clear()
    assert run(flow, "echo", rid)["outcome"] == "not_claimed"  # a duplicate wake-up
    claim = one(spans, "onceflow.claim")
    assert attr(claim, "onceflow.claimed") is False
    assert attr(claim, "onceflow.attempt") is None
    assert not runs_of(spans, rid)


def test_a_retry_runs_again_in_the_same_trace(flow: Flow, spans: InMemorySpanExporter) -> None:
    rid, client, enqueue = enqueued(flow, spans, "flaky", "j2")
    assert run(flow, "flaky", rid)["outcome"] == "retry"
    assert run(flow, "flaky", rid)["outcome"] == "succeeded"

    first, second = runs_of(spans, rid)
    for run_span in (first, second):
        assert_continues(run_span, client, enqueue)
    assert (attr(first, "onceflow.attempt"), attr(second, "onceflow.attempt")) == (1, 2)
    assert attr(first, "onceflow.outcome") == "retry"
    assert attr(first, "error.type") == "RetryLater"
    assert first.status.status_code is StatusCode.ERROR
    assert attr(second, "onceflow.outcome") == "succeeded"
    [fail] = children(spans, first, "onceflow.fail")
    assert attr(fail, "onceflow.fenced") is True
    assert attr(fail, "onceflow.outcome") == "retry"
    assert attr(fail, "onceflow.retryable") is True


def test_a_hand_off_follow_up_runs_in_the_same_trace(
    flow: Flow, spans: InMemorySpanExporter, clean_db: Engine
) -> None:
    rid, client, _ = enqueued(flow, spans, "hand", "j3")
    assert run(flow, "hand", rid)["outcome"] == "succeeded"
    [hand_run] = runs_of(spans, rid)
    [complete] = children(spans, hand_run, "onceflow.complete")
    [hand_off] = children(spans, complete, "onceflow.hand_off")
    assert hand_off.kind is SpanKind.PRODUCER
    assert attr(hand_off, "onceflow.hand_offs") == 1
    assert attr(hand_off, "onceflow.created") == 1
    assert attr(hand_off, "onceflow.fenced") is True

    [follow] = flow.queue.list(stage="echo")
    with clean_db.connect() as conn:
        stored = conn.execute(
            text("SELECT trace_context FROM workspace_process_requests WHERE request_id = :r"),
            {"r": follow.request_id},
        ).scalar_one()
    stored_context = tracing.span_context_from(stored)
    assert stored_context is not None
    assert stored_context.trace_id == client.context.trace_id
    assert stored_context.span_id == hand_off.context.span_id

    assert run(flow, "echo", follow.request_id)["outcome"] == "succeeded"
    [follow_run] = runs_of(spans, follow.request_id)
    assert follow_run.context.trace_id == client.context.trace_id
    assert follow_run.parent is not None and follow_run.parent.span_id == hand_off.context.span_id


def test_a_completion_refused_after_the_lease_lapsed_is_not_fenced(
    flow: Flow, spans: InMemorySpanExporter
) -> None:
    rid, client, _ = enqueued(flow, spans, "stalls", "j4")
    assert run(flow, "stalls", rid)["outcome"] == "lease_lost"
    [run_span] = runs_of(spans, rid)
    assert run_span.context.trace_id == client.context.trace_id
    assert attr(run_span, "onceflow.outcome") == "lease_lost"
    [complete] = children(spans, run_span, "onceflow.complete")
    assert attr(complete, "onceflow.fenced") is False


def test_a_heartbeat_that_finds_the_lease_gone_is_noted_on_the_run(
    flow: Flow, spans: InMemorySpanExporter
) -> None:
    rid, _, _ = enqueued(flow, spans, "loses_lease", "j5")
    assert run(flow, "loses_lease", rid)["outcome"] == "lease_lost"
    [run_span] = runs_of(spans, rid)
    [event] = [e for e in run_span.events if e.name == "onceflow.heartbeat.failed"]
    assert event.attributes == {"error.type": "LeaseLost"}
    assert attr(run_span, "onceflow.outcome") == "lease_lost"
    assert attr(run_span, "error.type") == "LeaseLost"


# ------------------------------------------------------- a real Celery worker, instrumented


@pytest.fixture()
def instrumented(spans: InMemorySpanExporter) -> Iterator[None]:
    """Celery's own OpenTelemetry instrumentation, on this process's provider."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=trace.get_tracer_provider())
    yield
    instrumentor.uninstrument()


@pytest.fixture()
def celery_worker(clean_db: Engine, redis_url: str, instrumented: None) -> Iterator[Flow]:
    """A Celery worker of a Flow's app in this process (solo pool), on the real broker;
    without the sweep watchdog (the tests sweep when they mean to)."""
    import redis as redis_lib

    flow = make_flow(get_settings().model_copy(update={"sweep_watchdog": False}))
    broker = redis_lib.Redis.from_url(get_settings().redis_url)
    broker.delete(queue_name(WC))
    with start_worker(
        flow.app, pool="solo", perform_ping_check=False, queues=[queue_name(WC)],
        loglevel="WARNING", shutdown_timeout=30,
    ):  # fmt: skip
        yield flow
    broker.delete(queue_name(WC))
    flow.queue.close()


def celery_task_span(spans: InMemorySpanExporter, stage: str) -> ReadableSpan:
    return wait_for(lambda: next((s for s in named(spans, f"run/onceflow.stage.{stage}")), None))


@pytest.mark.slow
def test_a_celery_worker_nests_the_run_in_its_task_span(
    celery_worker: Flow, spans: InMemorySpanExporter
) -> None:
    flow = celery_worker
    with tracing.TRACER.start_as_current_span("client") as client:
        rid = flow.enqueue("echo", WS, "j6", "main", {}).request_id
    wait_for(lambda: flow.queue.get(rid, workspace_id=WS).status is Status.SUCCEEDED)
    task = celery_task_span(spans, "echo")
    [run_span] = wait_for(lambda: runs_of(spans, rid))
    trace_id = client.get_span_context().trace_id
    assert task.context.trace_id == trace_id
    assert run_span.context.trace_id == trace_id
    # Inside Celery's task span (same trace): nested, and linked to the enqueue.
    assert run_span.parent is not None and run_span.parent.span_id == task.context.span_id
    [enqueue] = named(spans, "onceflow.enqueue")
    assert [link.context.span_id for link in run_span.links] == [enqueue.context.span_id]


@pytest.mark.slow
def test_a_sweeper_resend_carries_the_row_trace_to_the_worker(
    celery_worker: Flow, spans: InMemorySpanExporter
) -> None:
    flow = celery_worker
    # Enqueued without a wake-up (as after a failed send): the sweeper sends it, from a sweep
    # of its own trace.
    with tracing.TRACER.start_as_current_span("client") as client:
        rid = flow.queue.enqueue("echo", WS, "j7", "", {}, worker_class=WC).request_id
    flow.queue.mark_undispatched(rid, workspace_id=WS)
    trace_id = client.get_span_context().trace_id
    result = flow.sweep_once()
    assert rid in [d.request_id for d in result.to_dispatch]
    wait_for(lambda: flow.queue.get(rid, workspace_id=WS).status is Status.SUCCEEDED)
    sweep = one(spans, "onceflow.sweep")
    assert sweep.context.trace_id != trace_id  # a sweep is a trace of its own
    assert attr(sweep, "onceflow.dispatched") == 1
    publish = next(s for s in named(spans, "apply_async/onceflow.stage.echo"))
    assert publish.context.trace_id == trace_id  # sent in the row's trace
    task = celery_task_span(spans, "echo")
    [run_span] = wait_for(lambda: runs_of(spans, rid))
    assert task.context.trace_id == trace_id
    assert run_span.parent is not None and run_span.parent.span_id == task.context.span_id


# ----------------------------------------------------------------------------- the sweeper


@pytest.mark.parametrize(
    ("max_attempts", "outcome", "status"),
    [(3, "requeued", "queued"), (1, "quarantined", "dead")],
)
def test_a_rescue_lands_in_the_row_trace(
    flow: Flow, spans: InMemorySpanExporter, max_attempts: int, outcome: str, status: str
) -> None:
    rid, client, _ = enqueued(flow, spans, "echo", "j8", max_attempts=max_attempts)
    claim = flow.queue.claim(rid, "host:crashed", workspace_id=WS)
    assert claim is not None and claim.trace_context is not None
    _lapse(rid)  # the worker died: its lease lapses
    spans.clear()
    sent: list[Any] = []
    result = tracing_sweep(flow, sent)
    assert (rid in result.rescued) is (outcome == "requeued")
    rescue = one(spans, "onceflow.rescue")
    sweep = one(spans, "onceflow.sweep")
    assert rescue.context.trace_id == client.context.trace_id
    assert rescue.parent is not None
    assert rescue.parent.span_id == tracing.span_context_from(claim.trace_context).span_id  # type: ignore[union-attr]
    assert [link.context.span_id for link in rescue.links] == [sweep.context.span_id]
    assert attr(rescue, "onceflow.rescue.outcome") == outcome
    assert attr(rescue, "onceflow.status") == status
    assert attr(rescue, "onceflow.attempt") == 1
    assert attr(rescue, "onceflow.crash_attempts") == 1
    assert attr(sweep, "onceflow.rescued" if outcome == "requeued" else "onceflow.quarantined") == 1


def tracing_sweep(flow: Flow, sent: list[Any]) -> Any:
    """One sweep of the Flow, its wake-ups kept instead of published."""
    flow._send_wakeups = sent.extend  # type: ignore[method-assign]
    return flow.sweep_once()


# ------------------------------------------------------------------ the standalone worker


def _handler(ctx: StageContext) -> Any:
    BODY_LOG.info("worker body ran")
    if ctx.stage == "stalls":
        _lapse(ctx.request.request_id)
    elif ctx.stage == "flaky" and ctx.attempt == 1:
        raise RetryLater(0, "once more")
    elif ctx.stage == "hand":
        ctx.then("echo", {})
    return {"ok": True}


def _worker(queue: Queue) -> Worker:
    return Worker(queue, [WC], _handler, concurrency=1, sweep=False, max_wait=0.5)


def test_the_standalone_worker_runs_in_the_trace_of_the_enqueue(
    flow: Flow, spans: InMemorySpanExporter, logged: list[logging.LogRecord]
) -> None:
    rid, client, enqueue = enqueued(flow, spans, "echo", "j9")
    # Its lease lapses in the body; no crash budget left, so no claim takes it over.
    stalled, _, _ = enqueued(flow, spans, "stalls", "j10", max_crash_attempts=1)
    with _worker(flow.queue) as worker:
        wait_for(lambda: worker.stats.succeeded + worker.stats.lease_lost >= 2)
    [run_span] = runs_of(spans, rid)
    assert_continues(run_span, client, enqueue)
    assert attr(run_span, "onceflow.outcome") == "succeeded"
    [complete] = children(spans, run_span, "onceflow.complete")
    assert attr(complete, "onceflow.fenced") is True
    assert run_span.end_time is not None and complete.end_time is not None
    assert complete.end_time <= run_span.end_time  # ended once the outcome was recorded

    [lost] = runs_of(spans, stalled)
    assert attr(lost, "onceflow.outcome") == "lease_lost"
    [refused] = children(spans, lost, "onceflow.complete")
    assert attr(refused, "onceflow.fenced") is False

    [line] = [r for r in logged if r.getMessage() == "worker body ran" and r.request_id == rid]
    assert (line.workspace_id, line.stage, line.attempt) == (WS, "echo", 1)
    assert line.trace_id == format(client.context.trace_id, "032x")
    assert line.span_id == format(run_span.context.span_id, "016x")


def test_the_standalone_worker_keeps_retries_and_hand_offs_in_the_trace(
    flow: Flow, spans: InMemorySpanExporter
) -> None:
    flaky, flaky_client, flaky_enqueue = enqueued(flow, spans, "flaky", "j11")
    hand, hand_client, _ = enqueued(flow, spans, "hand", "j12")
    with _worker(flow.queue) as worker:
        wait_for(lambda: worker.stats.succeeded >= 3)  # flaky (its retry), hand, the follow-up
    first, second = runs_of(spans, flaky)
    for run_span in (first, second):
        assert_continues(run_span, flaky_client, flaky_enqueue)
    assert attr(first, "onceflow.outcome") == "retry"
    assert attr(second, "onceflow.outcome") == "succeeded"
    [fail] = children(spans, first, "onceflow.fail")
    assert (attr(fail, "onceflow.fenced"), attr(fail, "onceflow.outcome")) == (True, "retry")

    [hand_run] = runs_of(spans, hand)
    [complete] = children(spans, hand_run, "onceflow.complete")
    [hand_off] = children(spans, complete, "onceflow.hand_off")
    [follow] = flow.queue.list(stage="echo")
    [follow_run] = runs_of(spans, follow.request_id)
    assert follow_run.context.trace_id == hand_client.context.trace_id
    assert follow_run.parent is not None and follow_run.parent.span_id == hand_off.context.span_id


def test_a_prefork_child_exports_its_buffered_spans_as_it_exits(
    trace_spans: InMemorySpanExporter,
) -> None:
    """A child ends without ``atexit``: the shutdown hook exports what its batch holds."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from onceflow.tasks import worker_process

    batched = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    # A batch that would wait an hour before exporting on its own.
    provider.add_span_processor(BatchSpanProcessor(batched, schedule_delay_millis=3_600_000))
    with tracing.TRACER.start_as_current_span("in the child"):
        pass
    assert not batched.get_finished_spans()
    worker_process._child_exits()  # the worker_process_shutdown hook
    assert [s.name for s in batched.get_finished_spans()] == ["in the child"]
    batched.shutdown()  # exports nothing more
