"""Spans of the compute lock, provider calls through permits, and op applies, on real Redis,
Postgres and processes, recorded by the OpenTelemetry SDK's in-memory exporter (the
``trace_spans`` fixture).

The race of one cell runs in two spawned processes (one on ``compute_once``, one on
``acompute_once``), each with its own SDK: the holder reports its compute span's id, and
the waiter's link must point at it. Every test also checks that no attribute, event or
link of any span carries a key, an id of the cell, an input or a value.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import secrets
import threading
from collections.abc import Sequence
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.synchronize import Event
from typing import Any

import pytest
import redis as redis_lib
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Engine

from onceflow import tracing
from onceflow.errors import BudgetExceeded, ProviderError
from onceflow.keys import lock_key
from onceflow.locks import RedisLockBackend, compute_once
from onceflow.locks.redis_lock import holder_key
from onceflow.oplog import OpLog, new_op_id
from onceflow.queue import Queue
from onceflow.settings import get_settings
from onceflow.spend import Cascade, LedgerHooks, Price, Provider, Usage, set_budget
from tests.acceptance.procs import wait_for


def everything_said(spans: Sequence[ReadableSpan]) -> list[str]:
    """Every name and value a span, its events and links carry, as text."""
    said: list[str] = []

    def add(attributes: Any) -> None:
        for name, value in dict(attributes or {}).items():
            said.extend([str(name), str(value)])

    for span in spans:
        said.append(span.name)
        add(span.attributes)
        for event in span.events:
            said.append(event.name)
            add(event.attributes)
        for link in span.links:
            add(link.attributes)
    return said


def assert_says_none_of(said: Sequence[str], *words: str) -> None:
    for word in words:
        leaked = [text for text in said if word in text]
        assert not leaked, f"{word!r} is in span attributes: {leaked}"


# ------------------------------------------------------------------ the compute lock


def _racer(
    api: str,
    redis_url: str,
    cell: tuple[str, str, str],
    value: str,
    computing: Event,
    waiting: Event,
    out: Any,
) -> None:
    """One caller of the race, in a process with its own SDK: compute_once (``sync``) or
    acompute_once (``async``) on ``cell``; reports its outcome and spans on ``out``."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    ws, job, task = cell
    store_key = f"tracing-test:{ws}:{job}:{task}"
    r = redis_lib.Redis.from_url(redis_url)
    held_ttl: list[int] = []

    def check() -> str | None:
        found = r.get(store_key)
        return None if found is None else found.decode()

    def compute() -> str:
        computing.set()
        held_ttl.append(int(r.pttl(holder_key(lock_key(*cell)))))
        waiting.wait(60)  # the other caller is waiting on this holder
        return value

    def store(v: str) -> None:
        r.set(store_key, v, nx=True)

    def on_wait() -> None:
        waiting.set()

    try:
        kw: dict[str, Any] = {"check": check, "compute": compute, "store": store,
                              "on_wait": on_wait}  # fmt: skip
        if api == "sync":
            outcome = compute_once(*cell, backend=RedisLockBackend(redis_url), **kw)
        else:
            from onceflow.locks import AsyncRedisLockBackend, acompute_once

            async def main() -> Any:
                async with AsyncRedisLockBackend(redis_url) as be:
                    return await acompute_once(*cell, backend=be, **kw)

            outcome = asyncio.run(main())
        finished = exporter.get_finished_spans()
        (span,) = [s for s in finished if s.name == "onceflow.compute"]
        out.put(
            {
                "api": api,
                "path": str(outcome.path),
                "value": outcome.value,
                "span_id": format(span.context.span_id, "016x"),
                "trace_id": format(span.context.trace_id, "032x"),
                "kind": span.kind.name,
                "attributes": dict(span.attributes or {}),
                "links": [
                    (format(link.context.span_id, "016x"), dict(link.attributes or {}))
                    for link in span.links
                ],
                "events": [e.name for e in span.events],
                "said": everything_said(finished),
                "held_ttl": held_ttl,
            }
        )
    except BaseException as exc:  # the test reads the failure, not a hang
        out.put({"api": api, "error": repr(exc)})
        raise


def test_two_processes_race_one_cell_the_waiter_links_to_the_holders_compute_span(
    trace_spans: InMemorySpanExporter, redis_url: str
) -> None:
    ctx = mp.get_context("spawn")
    secret = secrets.token_hex(6)
    cell = (f"ws-{secret}", f"job-{secret}", f"task-{secret}")
    value = f"value-{secret}"
    computing, waiting, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(api, redis_url, cell, value, computing, waiting, out))
        for api in ("sync", "async")
    ]
    for p in procs:
        p.start()
    try:
        reports = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all("error" not in r for r in reports), reports
    by_path = {r["path"]: r for r in reports}
    assert sorted(by_path) == ["computed", "waited"]
    holder, waiter = by_path["computed"], by_path["waited"]
    assert holder["attributes"]["onceflow.lock.result"] == "computed"
    assert holder["attributes"]["onceflow.lock.backend"] == "redis"
    assert holder["kind"] == "INTERNAL"
    assert "onceflow.lock.acquired" in holder["events"]
    assert "onceflow.lock.compute" in holder["events"]
    assert holder["links"] == []
    assert holder["held_ttl"] and holder["held_ttl"][0] > 0  # kept beside the lock, with a TTL
    assert waiter["attributes"]["onceflow.lock.result"] == "waited"
    assert waiter["attributes"]["onceflow.lock.waited_ms"] > 0
    assert "onceflow.lock.waiting" in waiter["events"]
    # The waiter, in another process, links to the holder's compute span.
    assert waiter["links"] == [(holder["span_id"], {"onceflow.link": "lock_holder"})]
    assert waiter["value"] == value
    # Released: the lock and the holder's trace context are gone.
    r = redis_lib.Redis.from_url(redis_url)
    assert r.exists(lock_key(*cell)) == 0
    assert r.exists(holder_key(lock_key(*cell))) == 0
    # A second call finds the value stored: a pre-flight hit, no lock round trip.
    store_key = f"tracing-test:{cell[0]}:{cell[1]}:{cell[2]}"

    def check() -> str | None:
        found = r.get(store_key)
        return None if found is None else found.decode()

    again = compute_once(
        *cell, check=check, compute=lambda: "never", store=lambda v: None,
        backend=RedisLockBackend(redis_url),
    )  # fmt: skip
    assert str(again.path) == "preflight"
    (span,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.compute"]
    assert span.attributes is not None
    assert span.attributes["onceflow.lock.result"] == "preflight_hit"
    said = [*holder["said"], *waiter["said"], *everything_said(trace_spans.get_finished_spans())]
    assert_says_none_of(said, secret, value, lock_key(*cell), store_key)


def test_a_failing_compute_ends_its_span_with_the_error_type_and_frees_the_holder_key(
    trace_spans: InMemorySpanExporter, redis_url: str
) -> None:
    secret = secrets.token_hex(6)
    cell = (f"ws-{secret}", f"job-{secret}", "task")
    r = redis_lib.Redis.from_url(redis_url)

    def compute() -> str:
        assert r.pttl(holder_key(lock_key(*cell))) > 0
        raise ValueError(f"bad input {secret}")

    with pytest.raises(ValueError, match="bad input"):
        compute_once(
            *cell, check=lambda: None, compute=compute, store=lambda v: None,
            backend=RedisLockBackend(redis_url),
        )  # fmt: skip
    (span,) = [s for s in trace_spans.get_finished_spans() if s.name == "onceflow.compute"]
    assert span.attributes is not None
    assert span.attributes["onceflow.lock.result"] == "error"
    assert span.attributes["error.type"] == "ValueError"
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ValueError"  # the type, never the message
    assert r.exists(holder_key(lock_key(*cell))) == 0
    assert_says_none_of(everything_said(trace_spans.get_finished_spans()), secret)


def test_a_provider_call_nests_in_its_compute_span_and_a_cache_hit_says_what_it_saved(
    trace_spans: InMemorySpanExporter, redis_url: str, clean_db: Engine
) -> None:
    from tests.integration.cache_callers import CountingProvider, summarise

    server = CountingProvider()
    ws, secret = f"ws-{secrets.token_hex(4)}", secrets.token_hex(6)
    prompt = f"Summarise {secret}"
    try:
        first = summarise(server.url, redis_url, ws, "job-1", "workspace", prompt, 60.0)
        hit = summarise(server.url, redis_url, ws, "job-2", "workspace", prompt, 60.0)
    finally:
        server.stop()
    assert (first[0], hit[0], server.calls) == ("computed", "cache_hit", 1)
    finished = trace_spans.get_finished_spans()
    computed, served = [s for s in finished if s.name == "onceflow.compute"]
    assert (computed.attributes or {})["onceflow.lock.result"] == "computed"
    # The provider's call is a child of the compute span that paid for it.
    (call,) = [s for s in finished if s.name == "chat stand-in"]
    assert call.parent is not None and call.parent.span_id == computed.context.span_id
    assert (call.attributes or {})["gen_ai.usage.input_tokens"] == 1000
    assert (served.attributes or {})["onceflow.lock.result"] == "cache_hit"
    (event,) = [e for e in served.events if e.name == "onceflow.cache.hit"]
    assert (event.attributes or {})["onceflow.spend.saved_cost"] == float(Decimal("0.0045"))
    assert_says_none_of(everything_said(finished), ws, secret, first[1])


# ------------------------------------------------------------------ provider calls


def _provider(redis_url: str, **kw: Any) -> Provider:
    name = f"tr-{secrets.token_hex(4)}"
    return Provider(name, price=Price("2.50", "10.00"), model="gpt-4o", redis_url=redis_url, **kw)


def test_a_permits_call_is_a_genai_client_span_with_its_tokens_and_cost(
    trace_spans: InMemorySpanExporter, redis_url: str
) -> None:
    openai = _provider(redis_url, concurrency=1)
    ws = f"ws-{secrets.token_hex(4)}"
    try:
        # A second permit waits for the first one's slot: its span says so, and why.
        first = openai.permit(ws, tokens=100)
        first.__enter__()
        waited: list[BaseException] = []

        def second() -> None:
            try:
                with openai.permit(ws, tokens=100) as permit:
                    permit.settle(Usage(5, 6))
            except BaseException as exc:
                waited.append(exc)
                raise

        thread = threading.Thread(target=second)
        thread.start()
        wait_for(lambda: any(k.startswith("denied_") and v for k, v in openai.stats().items()))
        assert first.permit is not None
        first.permit.settle(Usage(1200, 340))
        first.__exit__(None, None, None)
        thread.join(30)
        assert not waited
    finally:
        openai.reset()
    calls = [s for s in trace_spans.get_finished_spans() if s.name == "chat gpt-4o"]
    assert len(calls) == 2
    by_outcome = {(s.attributes or {})["onceflow.permit.outcome"]: s for s in calls}
    granted, queued = by_outcome["granted"], by_outcome["waited"]
    assert granted.kind is SpanKind.CLIENT
    assert dict(granted.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": openai.name,
        "gen_ai.system": openai.name,
        "gen_ai.request.model": "gpt-4o",
        "onceflow.permit.outcome": "granted",
        "onceflow.permit.settle": "ok",
        "gen_ai.usage.input_tokens": 1200,
        "gen_ai.usage.output_tokens": 340,
        "onceflow.spend.cost": float(Decimal("0.0064")),
    }
    attrs = dict(queued.attributes or {})
    assert attrs["onceflow.permit.wait_reason"] == "concurrency"
    assert attrs["onceflow.permit.wait_ms"] > 0
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (5, 6)
    assert_says_none_of(everything_said(calls), ws)


def test_an_async_permits_span_is_current_in_its_block(
    trace_spans: InMemorySpanExporter, redis_url: str
) -> None:
    openai = _provider(redis_url)
    ws = f"ws-{secrets.token_hex(4)}"
    inside: list[int] = []

    async def main() -> None:
        async with openai.apermit(ws, tokens=10) as permit:
            inside.append(trace.get_current_span().get_span_context().span_id)
            await permit.settle(Usage(3, 4), model="gpt-4o-mini")

    try:
        asyncio.run(main())
    finally:
        openai.reset()
    (span,) = [s for s in trace_spans.get_finished_spans() if s.name == "chat gpt-4o"]
    assert inside == [span.context.span_id]  # the user's call nests in the permit's span
    attrs = dict(span.attributes or {})
    assert attrs["onceflow.permit.outcome"] == "granted"
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (3, 4)
    assert attrs["gen_ai.response.model"] == "gpt-4o-mini"
    assert trace.get_current_span().get_span_context().is_valid is False  # detached after


def test_a_budget_refusal_is_a_failed_call_span(
    trace_spans: InMemorySpanExporter, redis_url: str, clean_db: Engine
) -> None:
    ws = f"ws-{secrets.token_hex(4)}"
    Queue(clean_db, settings=get_settings()).enqueue("summarize", ws, "job-1")
    set_budget(ws, "day", limit_tokens=10, database=clean_db)
    openai = _provider(redis_url, hooks=LedgerHooks(clean_db))
    try:
        with pytest.raises(BudgetExceeded), openai.permit(ws, tokens=100):
            pytest.fail("a refused permit runs no block")
    finally:
        openai.reset()
    (span,) = [s for s in trace_spans.get_finished_spans() if s.name == "chat gpt-4o"]
    attrs = dict(span.attributes or {})
    assert attrs["error.type"] == "BudgetExceeded"
    assert attrs["onceflow.permit.outcome"] == "budget_refused"
    assert "gen_ai.usage.input_tokens" not in attrs
    assert span.status.status_code is StatusCode.ERROR
    assert_says_none_of(everything_said([span]), ws)


def test_a_cascades_fallback_is_a_sibling_span_with_its_reason(
    trace_spans: InMemorySpanExporter, redis_url: str
) -> None:
    down, up = _provider(redis_url), _provider(redis_url)
    ws = f"ws-{secrets.token_hex(4)}"

    def ask(permit: Any) -> str:
        if permit.provider is down:
            raise ProviderError(down.name, 503, f"prompt {ws}")
        permit.settle(Usage(7, 8))
        return "answer"

    tracer = trace.get_tracer("tests")
    try:
        with tracer.start_as_current_span("caller") as caller:
            assert Cascade([down, up]).call(ws, ask, tokens=50) == "answer"
    finally:
        down.reset()
        up.reset()
    calls = [s for s in trace_spans.get_finished_spans() if s.name == "chat gpt-4o"]
    by_provider = {(s.attributes or {})["gen_ai.provider.name"]: s for s in calls}
    failed, served = by_provider[down.name], by_provider[up.name]
    caller_id = caller.get_span_context().span_id
    assert failed.parent is not None and served.parent is not None
    assert failed.parent.span_id == served.parent.span_id == caller_id  # siblings
    fa = dict(failed.attributes or {})
    assert (fa["onceflow.permit.outcome"], fa["onceflow.cascade.reason"]) == (
        "fallback", "provider_error",
    )  # fmt: skip
    assert fa["error.type"] == "ProviderError"
    sa = dict(served.attributes or {})
    assert sa["onceflow.permit.outcome"] == "granted"
    assert (sa["gen_ai.usage.input_tokens"], sa["gen_ai.usage.output_tokens"]) == (7, 8)
    assert served.status.status_code is not StatusCode.ERROR
    assert_says_none_of(everything_said(calls), ws, "prompt")


def test_a_cascade_that_waited_for_room_says_so_on_the_call_that_served(
    trace_spans: InMemorySpanExporter, redis_url: str
) -> None:
    only = _provider(redis_url, concurrency=1)
    ws = f"ws-{secrets.token_hex(4)}"
    answers: list[str] = []

    def ask(permit: Any) -> str:
        permit.settle(Usage(1, 1))
        return "answer"

    try:
        held = only.permit(ws, tokens=10)
        held.__enter__()
        thread = threading.Thread(target=lambda: answers.append(Cascade([only]).call(ws, ask)))
        thread.start()
        wait_for(lambda: only.stats().get("denied_concurrency", 0) > 0)
        held.__exit__(None, None, None)
        thread.join(30)
    finally:
        only.reset()
    assert answers == ["answer"]
    calls = [s for s in trace_spans.get_finished_spans() if s.name == "chat gpt-4o"]
    (served,) = [s for s in calls if (s.attributes or {})["onceflow.permit.outcome"] == "waited"]
    attrs = dict(served.attributes or {})
    assert attrs["onceflow.permit.wait_reason"] == "concurrency"
    assert attrs["onceflow.permit.wait_ms"] > 0


# ------------------------------------------------------------------ the op log


def test_a_duplicate_op_apply_returns_the_original_clock_and_its_span_says_duplicate(
    trace_spans: InMemorySpanExporter, redis_url: str, clean_db: Engine
) -> None:
    oplog = OpLog(clean_db, get_settings())
    ws, secret = f"ws-{secrets.token_hex(4)}", secrets.token_hex(6)
    sub_doc, op_id = f"doc-{secret}", new_op_id()
    op = {"type": "cell.set", "column": f"col-{secret}", "value": f"value-{secret}"}
    first = oplog.apply_op(ws, sub_doc, op, op_id)
    again = oplog.apply_op(ws, sub_doc, op, op_id)
    assert again.duplicate and again.clock == first.clock
    finished = trace_spans.get_finished_spans()
    applies = [s for s in finished if s.name == "onceflow.op.apply"]
    assert len(applies) == 2
    new, dup = (dict(s.attributes or {}) for s in applies)
    assert new == {
        "onceflow.op.fenced": False,
        "onceflow.op.outcome": "applied",
        "onceflow.op.duplicate": False,
        "onceflow.op.type": "cell.set",
        "onceflow.op.clock": first.clock,
    }
    assert dup["onceflow.op.duplicate"] is True
    assert dup["onceflow.op.outcome"] == "duplicate"
    assert dup["onceflow.op.clock"] == first.clock
    # The new commit was broadcast (a child PRODUCER span); the duplicate was not.
    (sent,) = [s for s in finished if s.name == "onceflow.op.broadcast"]
    assert sent.kind is SpanKind.PRODUCER
    assert sent.parent is not None and sent.parent.span_id == applies[0].context.span_id
    assert dict(sent.attributes or {})["onceflow.channel.kind"] == "workspace"
    assert_says_none_of(everything_said(finished), ws, secret, op_id)


def test_the_http_op_log_client_sends_the_current_trace_with_each_op(
    trace_spans: InMemorySpanExporter,
) -> None:
    from onceflow.oplog.http import HttpTransport

    seen: list[str | None] = []

    class Api(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.headers.get("traceparent"))
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({
                "workspace_id": "w1", "sub_doc": "cells", "op_id": "op-1", "clock": 3,
                "duplicate": False, "result": None, "error": None,
                "committed_at": "2026-01-01T00:00:00+00:00",
            }).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    transport = HttpTransport(f"http://127.0.0.1:{server.server_address[1]}", "key")
    try:
        with trace.get_tracer("tests").start_as_current_span("caller") as caller:
            done = transport.apply("w1", "cells", {"type": "cell.set"}, "op-1", None)
    finally:
        transport.close()
        server.shutdown()
        server.server_close()
    assert done.clock == 3
    (parent,) = seen
    assert parent == tracing.carrier_of(caller)
