"""One trace across real processes: an HTTP enqueue, a Celery worker killed mid-run, the
sweeper's rescue, the compute lock, the provider call and the op — exported over OTLP by
each process to a receiver in this test that decodes the protobuf wire format.

The API, the Celery workers and beat (the sweeper) are real ``onceflow`` processes with the
OpenTelemetry SDK set up from the standard ``OTEL_*`` variables; nothing in this process
records a span. The client is plain HTTP with a ``traceparent`` header of its own.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_lib

from onceflow.demo import procs
from onceflow.demo.traces import Span, TraceReceiver
from onceflow.integrations.fastapi import hash_key
from onceflow.keys import queue_name
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, api_server, wait_for
from tests.acceptance.traced_stages import TRACED
from tests.integration.standin import StandIn

pytestmark = pytest.mark.slow

APP = "tests.acceptance.traced_stages:flow"
API_KEY = "of_test_api_key_trace_0123456789abcdef"


def otel(receiver: TraceReceiver, service: str) -> dict[str, str]:
    """What a process needs to export its spans to ``receiver`` as ``service``."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": service,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture()
def receiver() -> Iterator[TraceReceiver]:
    with TraceReceiver() as running:
        yield running


@pytest.fixture()
def provider() -> Iterator[StandIn]:
    standin = StandIn().start()
    yield standin
    standin.stop()


@pytest.fixture()
def stack(runtime: Any, redis_url: str, tmp_path: Path, receiver: TraceReceiver) -> Iterator[str]:
    """The API, two single-process Celery workers of the traced class and beat, each
    exporting its spans to ``receiver``: the API's base URL."""
    redis_lib.Redis.from_url(redis_url).delete(queue_name(TRACED))
    keys = {"ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): ["w-trace"]})}
    started: list[procs.Proc] = []
    with api_server(tmp_path, {**TEST_ENV, **keys, **otel(receiver, "api")}, app=APP) as (
        url,
        _,
    ):
        try:
            for name in ("a", "b"):
                env = {**TEST_ENV, **otel(receiver, f"worker-{name}")}
                started.append(
                    procs.start_worker(tmp_path, APP, TRACED, name=name, env=env, cwd=ROOT)
                )
            beat_env = {**TEST_ENV, **otel(receiver, "beat")}
            started.append(procs.start_beat(tmp_path, APP, env=beat_env, cwd=ROOT))
            yield url
        finally:
            for proc in started:
                proc.stop()


def enqueue(url: str, traceparent: str, **fields: Any) -> str:
    body = {"stage": "traced_cell", **fields}
    headers = {"Authorization": f"Bearer {API_KEY}", "traceparent": traceparent}
    response = httpx.post(f"{url}/v1/workspaces/w-trace/requests", json=body, headers=headers)
    assert response.status_code in (200, 201), response.text
    return str(response.json()["request_id"])


def status(url: str, rid: str) -> str:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.get(f"{url}/v1/workspaces/w-trace/requests/{rid}", headers=headers)
    return str(response.json()["status"])


def of_request(spans: list[Span], rid: str, name: str) -> list[Span]:
    return [
        s
        for s in spans
        if s.name.startswith(name) and s.attributes.get("onceflow.request_id") == rid
    ]


def test_one_trace_from_the_http_enqueue_to_the_op_broadcast_across_a_kill(
    stack: str, receiver: TraceReceiver, provider: StandIn
) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    rid = enqueue(
        stack,
        f"00-{trace_id}-{client_span}-01",
        job_id="j-kill",
        input={"column": "a", "provider_url": provider.url, "kill_first": True},
    )
    wait_for(lambda: status(stack, rid) == "succeeded", timeout=90, what="the rescued run")
    wanted = (
        "onceflow.enqueue", "onceflow.run", "onceflow.compute", "onceflow.op.apply",
        "onceflow.op.broadcast", "onceflow.complete",
    )  # fmt: skip

    def complete() -> list[Span] | None:
        spans = receiver.trace(trace_id)
        names = {s.name.split(" ")[0] for s in spans}
        return spans if all(n in names for n in wanted) else None

    spans = receiver.wait_for(lambda _: complete(), timeout=30)
    tree = receiver.tree(trace_id)
    by_id = {s.span_id: s for s in spans}
    # The API continued the client's trace: its server span is the client span's child.
    (server,) = [s for s in spans if s.kind == "SERVER" and s.service == "api"]
    assert server.parent_span_id == client_span, tree
    (enqueue_span,) = [s for s in spans if s.name == "onceflow.enqueue"]
    assert enqueue_span.parent_span_id == server.span_id, tree
    # The first attempt's worker was killed: the sweeper (sent by beat, run by a worker)
    # rescued the row in its trace — unless the kill came after the lease had run out (a
    # slow start on a loaded machine), when the redelivered wake-up's claim took it over.
    rescues = of_request(spans, rid, "onceflow.rescue")
    assert len(rescues) <= 1, tree
    for rescue in rescues:
        assert rescue.service in ("worker-a", "worker-b")
        assert rescue.attributes["onceflow.rescue.outcome"] == "requeued", tree
    # The second attempt ran in the same trace, under the enqueue, linked to it.
    runs = of_request(spans, rid, "onceflow.run")
    assert [r.attributes["onceflow.attempt"] for r in runs] == [2], tree
    run = runs[0]
    assert run.service in ("worker-a", "worker-b")
    assert run.attributes["onceflow.outcome"] == "succeeded"
    assert enqueue_span.span_id in {link.span_id for link in run.links}, tree

    def descends_from_run(span: Span) -> bool:
        parent = span.parent_span_id
        while parent is not None and parent in by_id:
            if parent == run.span_id:
                return True
            parent = by_id[parent].parent_span_id
        return False

    compute = [s for s in spans if s.name.startswith("onceflow.compute")]
    assert [c.attributes["onceflow.lock.result"] for c in compute] == ["computed"], tree
    for name in ("onceflow.compute", "onceflow.op.apply", "onceflow.op.broadcast"):
        assert any(s.name.startswith(name) and descends_from_run(s) for s in spans), (name, tree)
    generative = [s for s in spans if "gen_ai.operation.name" in s.attributes]
    assert len(generative) == 1 and descends_from_run(generative[0]), tree
    assert generative[0].attributes["gen_ai.usage.input_tokens"] == 90
    assert provider.calls["a"] == 1  # paid once, though the first attempt was killed
    # Nothing of the input, the result, the provider's URL or the key in any attribute.
    for span in receiver.spans():
        for value in span.attributes.values():
            text = str(value)
            assert provider.url not in text and API_KEY not in text
            assert "answer-a" not in text


def test_a_waiter_is_linked_to_the_holder_in_another_process(
    stack: str, receiver: TraceReceiver, provider: StandIn
) -> None:
    provider.block_next("b")
    first_trace, second_trace = secrets.token_hex(16), secrets.token_hex(16)
    cell = {"column": "b", "provider_url": provider.url}
    holder_or_waiter = [
        enqueue(stack, f"00-{tid}-{secrets.token_hex(8)}-01", job_id="j-race",
                branch_path=branch, input=cell)
        for tid, branch in ((first_trace, "x"), (second_trace, "y"))
    ]  # fmt: skip
    # Both run at once, one per worker process: one holds the lock, the other waits.
    wait_for(lambda: provider.marks["b"] >= 1, timeout=60, what="a caller waiting")
    provider.unblock("b")
    for rid in holder_or_waiter:
        wait_for(lambda rid=rid: status(stack, rid) == "succeeded", timeout=60, what="both done")

    def computes() -> list[Span] | None:
        found = [s for s in receiver.spans() if s.name.startswith("onceflow.compute")]
        mine = [s for s in found if s.trace_id in (first_trace, second_trace)]
        return mine if len(mine) == 2 else None

    spans = receiver.wait_for(lambda _: computes(), timeout=30)
    (holder,) = [s for s in spans if s.attributes["onceflow.lock.result"] == "computed"]
    (waiter,) = [s for s in spans if s.attributes["onceflow.lock.result"] == "waited"]
    assert holder.service != waiter.service  # two processes
    assert holder.trace_id != waiter.trace_id  # two requests, two traces …
    assert (holder.trace_id, holder.span_id) in {(k.trace_id, k.span_id) for k in waiter.links}
    assert provider.calls["b"] == 1  # … and one paid call
