"""The trace context at onceflow's doors: the HTTP API's server spans, the claim's stored
context handed to pull workers, the Python pull worker's ``traceparent``, and an MCP tool
call's ``_meta``.

The real app (``create_app``) on the test Postgres, called in process (Starlette's test
client, an ``httpx.Client``), with the OpenTelemetry SDK exporting to memory.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import tracing
from onceflow.integrations.fastapi import KeyAuth, create_app, hash_key
from onceflow.integrations.pull import PullWorker
from onceflow.settings import get_settings
from onceflow.tasks import Flow, StageContext
from tests.acceptance.procs import free_port

API_KEY = "of_test_tracing_http_api_0123456789ab"
WORKER_KEY = "of_test_tracing_http_wkr_0123456789ab"
PULL = "t-trace-pull"  # a pull-worker class: no Celery wake-up to send
WS = "w-trace-http"
STAGE = "trace-noop"
ENQUEUE_ROUTE = "/v1/workspaces/{ws}/requests"
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


class In(BaseModel):
    value: int = 0


def _flow() -> Flow:
    flow = Flow(settings=get_settings(), pull_worker_classes=(PULL,))

    @flow.stage(STAGE, input=In, worker_class=PULL)
    def noop(ctx: StageContext, data: In) -> dict[str, int]:
        return {"value": data.value}

    return flow


def _app(flow: Flow, **settings: Any) -> Any:
    auth = KeyAuth({hash_key(API_KEY): [WS]}, {hash_key(WORKER_KEY): [PULL]})
    return create_app(flow, auth=auth, settings=flow.settings.model_copy(update=settings))


def _user_instrumented(app: Any) -> Any:
    """The app behind an application's own HTTP instrumentation (as OpenTelemetry's ASGI
    middleware does it): a server span of the application's tracer, current around the app."""
    tracer = trace.get_tracer("the-application")

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        with tracer.start_as_current_span("app server", kind=SpanKind.SERVER):
            await app(scope, receive, send)

    return wrapped


@pytest.fixture()
def flow(clean_db: Engine) -> Flow:
    return _flow()


@pytest.fixture()
def http(flow: Flow) -> Iterator[TestClient]:
    with TestClient(_app(flow)) as client:
        yield client


@pytest.fixture()
def served(flow: Flow) -> Iterator[str]:
    """The app on a real uvicorn server (a thread of its own: nothing of the test's context
    reaches the app but what the HTTP calls carry); its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app(flow), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))  # fmt: skip
    thread = threading.Thread(target=server.run, name="uvicorn-under-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _enqueue(http: TestClient, job: str, **headers: str) -> str:
    body = {"stage": STAGE, "job_id": job, "input": {"value": 1}}
    answer = http.post(
        f"/v1/workspaces/{WS}/requests",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}", **headers},
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["request_id"])


def _stored(engine: Engine, request_id: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT trace_context FROM workspace_process_requests WHERE request_id = :r"),
            {"r": request_id},
        ).scalar_one()


def _trace_of(stored: str | None) -> str:
    span_context = tracing.span_context_from(stored)
    assert span_context is not None, stored
    return format(span_context.trace_id, "032x")


def _servers(exporter: Any, name: str | None = None) -> list[Any]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.SERVER and (name is None or s.name == name)
    ]


def _served_spans(exporter: Any, name: str) -> list[Any]:
    """The server spans ``name`` of the uvicorn thread, once there: a span ends just after
    its answer is sent, so the client may read the answer first."""
    deadline = time.monotonic() + 30
    while not (spans := _servers(exporter, name)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return spans


# ------------------------------------------------------------------ the HTTP API


def test_an_enqueue_with_a_traceparent_continues_the_callers_trace(
    http: TestClient, clean_db: Engine, trace_spans: Any
) -> None:
    request_id = _enqueue(http, "j1", traceparent=TRACEPARENT, tracestate="vendor=abc")
    (server,) = _servers(trace_spans)
    assert server.name == f"POST {ENQUEUE_ROUTE}"
    assert format(server.context.trace_id, "032x") == CALLER_TRACE
    assert server.parent is not None and server.parent.is_remote
    assert format(server.parent.span_id, "016x") == CALLER_SPAN
    assert server.context.trace_state.get("vendor") == "abc"
    assert dict(server.attributes) == {
        "http.request.method": "POST",
        "url.scheme": "http",
        "http.route": ENQUEUE_ROUTE,
        "http.response.status_code": 201,
    }  # no path (it names the workspace), no query string, no header, no body
    (enqueue,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"]
    assert enqueue.parent is not None and enqueue.parent.span_id == server.context.span_id
    # The row keeps the enqueue's context: its run continues the caller's trace.
    assert _trace_of(_stored(clean_db, request_id)) == CALLER_TRACE


def test_without_a_traceparent_the_request_starts_a_trace(
    http: TestClient, clean_db: Engine, trace_spans: Any
) -> None:
    request_id = _enqueue(http, "j2")
    (server,) = _servers(trace_spans)
    assert server.parent is None
    assert _trace_of(_stored(clean_db, request_id)) == format(server.context.trace_id, "032x")


def test_a_bad_traceparent_is_ignored_and_errors_keep_their_status(
    http: TestClient, trace_spans: Any
) -> None:
    _enqueue(http, "j3", traceparent="00-not-a-trace-01")
    refused = http.post(
        f"/v1/workspaces/{WS}/requests",
        json={"stage": "no-such-stage", "job_id": "j"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert refused.status_code == 422
    missing = http.get("/v1/nowhere?secret=s3cr3t", headers={"Authorization": f"Bearer {API_KEY}"})
    assert missing.status_code == 404
    first, second, third = _servers(trace_spans)
    assert first.parent is None  # a new trace, no error
    assert second.attributes["http.response.status_code"] == 422
    assert third.name == "GET"  # no route matched: the method alone
    assert "http.route" not in third.attributes
    for span in (first, second, third):
        assert not any("s3cr3t" in str(value) for value in span.attributes.values())


def test_the_path_is_recorded_only_when_workspace_ids_are(
    flow: Flow, clean_db: Engine, trace_spans: Any
) -> None:
    with TestClient(_app(flow, trace_workspace_ids=True)) as http:
        _enqueue(http, "j4")
    (server,) = _servers(trace_spans)
    assert server.attributes["url.path"] == f"/v1/workspaces/{WS}/requests"


def test_under_the_applications_own_server_span_no_second_one_is_made(
    flow: Flow, clean_db: Engine, trace_spans: Any
) -> None:
    with TestClient(_user_instrumented(_app(flow))) as http:
        request_id = _enqueue(http, "j5", traceparent=TRACEPARENT)
    (server,) = _servers(trace_spans)
    assert server.name == "app server"  # the application's, and only it
    (enqueue,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"]
    assert enqueue.parent is not None and enqueue.parent.span_id == server.context.span_id
    assert _trace_of(_stored(clean_db, request_id)) == format(server.context.trace_id, "032x")


def test_untraced_the_api_makes_no_span_and_stores_no_context(
    http: TestClient, clean_db: Engine
) -> None:
    assert not tracing.active()
    request_id = _enqueue(http, "j6", traceparent=TRACEPARENT)
    assert _stored(clean_db, request_id) is None


# ---------------------------------------------------------------- pull workers


def test_the_claim_answer_documents_its_trace_context(http: TestClient) -> None:
    schema = http.get("/openapi.json").json()["components"]["schemas"]["ClaimOut"]
    field = schema["properties"]["trace_context"]
    assert "traceparent" in field["description"]
    assert {"type": "null"} in field["anyOf"]
    assert "trace_context" not in schema.get("required", [])


def test_the_claim_route_hands_the_rows_trace_context_to_the_pull_worker(
    http: TestClient, clean_db: Engine, trace_spans: Any
) -> None:
    request_id = _enqueue(http, "j7", traceparent=TRACEPARENT)
    claimed = http.post(
        f"/v1/worker-classes/{PULL}/claims",
        json={"worker_id": "w1"},
        headers={"Authorization": f"Bearer {WORKER_KEY}"},
    )
    assert claimed.status_code == 201, claimed.text
    assert claimed.json()["request_id"] == request_id
    assert claimed.json()["trace_context"] == _stored(clean_db, request_id)
    assert _trace_of(claimed.json()["trace_context"]) == CALLER_TRACE


def test_a_claim_of_a_row_without_a_trace_context_answers_null(
    http: TestClient, clean_db: Engine
) -> None:
    _enqueue(http, "j8")  # untraced: nothing stored
    claimed = http.post(
        f"/v1/worker-classes/{PULL}/claims",
        json={"worker_id": "w1"},
        headers={"Authorization": f"Bearer {WORKER_KEY}"},
    )
    assert claimed.status_code == 201, claimed.text
    assert claimed.json()["trace_context"] is None


def test_the_python_pull_workers_calls_join_the_current_span(
    http: TestClient, served: str, clean_db: Engine, trace_spans: Any
) -> None:
    request_id = _enqueue(http, "j9", traceparent=TRACEPARENT)
    with (
        PullWorker(served, WORKER_KEY, PULL) as worker,
        tracing.TRACER.start_as_current_span("the worker's loop") as loop,
    ):
        outcome = worker.run_once(lambda ctx: {"ok": True})
    assert outcome == "succeeded"
    (claim,) = _served_spans(trace_spans, "POST /v1/worker-classes/{wc}/claims")
    (complete,) = _served_spans(trace_spans, "POST /v1/claims/{request_id}/complete")
    # The claim is sent under the span current then (the worker's own loop).
    assert claim.parent is not None and claim.parent.is_remote
    assert claim.parent.span_id == loop.get_span_context().span_id
    # The completion is sent under the run's span, in the trace the request was enqueued
    # under: the API's span of it joins that trace, under the worker's completion span.
    (run,) = [s for s in trace_spans.get_finished_spans() if s.name == f"onceflow.run {STAGE}"]
    (written,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.complete"
                  and s.attributes.get("onceflow.request_id") == request_id]  # fmt: skip
    assert format(run.context.trace_id, "032x") == CALLER_TRACE
    assert written.parent is not None and written.parent.span_id == run.context.span_id
    assert complete.parent is not None and complete.parent.is_remote
    assert complete.parent.span_id == written.context.span_id
    assert format(complete.context.trace_id, "032x") == CALLER_TRACE


def test_with_no_span_current_a_claims_calls_carry_its_stored_trace(
    http: TestClient, served: str, clean_db: Engine, trace_spans: Any
) -> None:
    _enqueue(http, "j10")
    worker = PullWorker(served, WORKER_KEY, PULL)
    claim = worker.claim()
    assert claim is not None
    # As the claim answer of a traced row gives it (set here: a claim answer that carries
    # it is the claim route's own test); the heartbeat runs on a thread with no span.
    claim = dataclasses.replace(claim, trace_context=f"{TRACEPARENT}\nvendor=abc")
    beat = threading.Thread(target=worker.heartbeat, args=(claim,))
    beat.start()
    beat.join()
    worker.complete(claim, {"ok": True})
    worker.close()
    for route in ("heartbeat", "complete"):
        (server,) = _served_spans(trace_spans, f"POST /v1/claims/{{request_id}}/{route}")
        assert format(server.context.trace_id, "032x") == CALLER_TRACE
        assert server.parent is not None and format(server.parent.span_id, "016x") == CALLER_SPAN
        assert server.context.trace_state.get("vendor") == "abc"


# ------------------------------------------------------------------------- MCP


def test_an_mcp_tool_call_continues_the_trace_of_its_meta(
    flow: Flow, clean_db: Engine, trace_spans: Any
) -> None:
    from mcp import Client

    from onceflow.integrations.mcp import build_server

    server = build_server(flow)
    agent = trace.get_tracer("the-agent")

    async def call() -> Any:
        async with Client(server) as client:
            # The client SDK puts its span's traceparent in the call's params._meta.
            with agent.start_as_current_span("agent step") as step:
                result = await client.call_tool(
                    "enqueue_stage",
                    {"workspace_id": WS, "job_id": "j11", "stage": STAGE, "input": {"value": 2}},
                )
            return result, step

    result, step = anyio.run(call)
    assert not result.is_error, result
    request_id = result.structured_content["request_id"]
    tool_spans = _servers(trace_spans, "tools/call enqueue_stage")
    assert len(tool_spans) == 1  # one server span for the call: the SDK's or onceflow's
    (tool,) = tool_spans
    assert tool.context.trace_id == step.get_span_context().trace_id
    assert tool.parent is not None
    (enqueue,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.enqueue"]
    assert enqueue.parent is not None and enqueue.parent.span_id == tool.context.span_id
    assert _trace_of(_stored(clean_db, request_id)) == format(step.get_span_context().trace_id,
                                                              "032x")  # fmt: skip


class _Meta1x(BaseModel, extra="allow"):
    """The shape of ``params._meta`` in mcp 1.x: a model keeping unknown keys as extras."""


@pytest.mark.parametrize(
    "meta",
    [
        {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"},
        _Meta1x(traceparent=TRACEPARENT, tracestate="vendor=abc"),
    ],
    ids=["mcp-2.x-mapping", "mcp-1.x-model"],
)
def test_without_the_sdks_span_the_tool_call_makes_its_own_from_meta(
    meta: Any, trace_spans: Any
) -> None:
    from onceflow.integrations.mcp import _tool_span

    ctx = type("Ctx", (), {"request_context": type("Req", (), {"meta": meta})()})()
    with _tool_span(ctx, "enqueue_stage"):
        inner = trace.get_current_span().get_span_context()
    (tool,) = _servers(trace_spans)
    assert tool.name == "tools/call enqueue_stage"
    assert tool.context.span_id == inner.span_id
    assert format(tool.context.trace_id, "032x") == CALLER_TRACE
    assert tool.parent is not None and format(tool.parent.span_id, "016x") == CALLER_SPAN
    assert tool.context.trace_state.get("vendor") == "abc"
    assert tool.attributes["gen_ai.tool.name"] == "enqueue_stage"


def test_a_failed_tool_call_records_the_errors_type_only(trace_spans: Any) -> None:
    from onceflow.integrations.mcp import _tool_span

    ctx = type("Ctx", (), {"request_context": type("Req", (), {"meta": None})()})()
    with pytest.raises(ValueError), _tool_span(ctx, "enqueue_stage"):
        raise ValueError("input quoted: s3cr3t")
    (tool,) = _servers(trace_spans)
    assert tool.parent is None
    assert tool.attributes["error.type"] == "ValueError"
    assert "s3cr3t" not in str(tool.status.description)
    assert not tool.events  # no exception event (its message may quote the input)


# ------------------------------------------------------------------------- CLI


def test_onceflow_work_logs_json_lines_that_join_the_trace(
    clean_db: Engine, database_url: str
) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys

    from onceflow import NewRequest, Queue
    from tests.acceptance.procs import ROOT, wait_for

    queue = Queue(clean_db)
    (made,) = queue.enqueue_many([NewRequest("ws-log", "j", "s", worker_class="w-log")])
    environ = {**os.environ, "ONCEFLOW_DATABASE_URL": database_url,
               "OTEL_TRACES_EXPORTER": "console"}  # fmt: skip
    environ.pop("OTEL_SERVICE_NAME", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "work", "tests.integration.tracing_handlers:logged",
         "-w", "w-log", "--log-format", "json"],
        cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: queue.get(made.request_id).status == "succeeded", what="the run", timeout=60
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        queue.close()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]  # all JSON
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    (ran,) = [line for line in lines if line["message"] == "handler ran"]
    assert len(ran["trace_id"]) == 32 and len(ran["span_id"]) == 16
    # The runner's fields name the run.
    assert (ran["request_id"], ran["workspace_id"], ran["stage"], ran["attempt"]) == (
        made.request_id, "ws-log", "s", 1,
    )  # fmt: skip
    # The console exporter's spans, flushed at shutdown, name the service and the trace.
    assert '"service.name": "onceflow-work"' in out
    assert ran["trace_id"] in out


def test_onceflow_api_logs_json_lines_and_its_access_log_joins_the_request(
    clean_db: Engine, database_url: str, tmp_path: Any
) -> None:
    import json

    import httpx

    from tests.acceptance.procs import api_server, wait_for

    environ = {
        "ONCEFLOW_DATABASE_URL": database_url,
        "ONCEFLOW_LOG_FORMAT": "json",
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),  # warned: unscoped
        # Traced, exporting to a port where nothing listens (the exporter's complaints are
        # log lines too).
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    with api_server(tmp_path, environ) as (url, proc):
        answer = httpx.get(f"{url}/healthz?probe=1", headers={"traceparent": TRACEPARENT})
        assert answer.status_code == 200

        def access_line() -> dict[str, Any] | None:
            for line in proc.log().splitlines():
                if '"uvicorn.access"' in line and "/healthz" in line:
                    parsed: dict[str, Any] = json.loads(line)
                    return parsed
            return None

        access = wait_for(access_line, what="the access log line")
        text_lines = [line for line in proc.log().splitlines() if line.strip()]
    assert access["trace_id"] == CALLER_TRACE  # the request's server span was current
    lines = [json.loads(line) for line in text_lines]  # every line is one JSON object
    loggers = {line["logger"] for line in lines}
    assert {"uvicorn.error", "uvicorn.access", "onceflow.api"} <= loggers
    assert any("Application startup complete" in line["message"] for line in lines)


def test_onceflow_worker_logs_json_lines(
    clean_db: Engine, database_url: str, redis_url: str, tmp_path: Any
) -> None:
    import json
    import re

    from onceflow.demo.procs import start_worker
    from tests.acceptance.procs import APP, ROOT

    environ = {"ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url,
               "ONCEFLOW_LOG_FORMAT": "json", "PYTHONPATH": str(ROOT)}  # fmt: skip
    proc = start_worker(tmp_path, APP, "t-default", env=environ, cwd=ROOT)
    try:
        log_text = proc.log()
    finally:
        proc.stop()
    lines = [json.loads(line) for line in log_text.splitlines() if line.strip().startswith("{")]
    ready = [line for line in lines if line["message"].endswith(" ready.")]
    assert ready and ready[0]["logger"].startswith("celery")
    assert any(line["message"].startswith("Connected to") for line in lines)
    # Celery's start-up banner is printed, not logged; no line is in Celery's text format.
    celery_text = re.compile(r"^\[\d{4}-\d{2}-\d{2} [^\]]*: (DEBUG|INFO|WARNING|ERROR)/")
    assert not [line for line in log_text.splitlines() if celery_text.match(line)], log_text
