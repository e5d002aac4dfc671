"""onceflow's tracer and the attributes every runner puts on its spans.

Span names and attributes are listed in docs/tracing.md. What goes on a span is ids, names,
counts and outcomes — never an input, a result, an error's message, a key or a secret; the
workspace id only with ``ONCEFLOW_TRACE_WORKSPACE_IDS``. Messaging attributes follow
OpenTelemetry's messaging conventions (``messaging.system`` is ``onceflow``, the destination
a worker class, the message id a request id), so a trace backend groups them as a queue's.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ParamSpec

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NoOpTracerProvider, ProxyTracerProvider, Span, StatusCode
from opentelemetry.util.types import AttributeValue

from onceflow.settings import get_settings
from onceflow.tracing.carrier import span_context_from

log = logging.getLogger("onceflow.tracing")
P = ParamSpec("P")


def _version() -> str:
    try:
        return version("onceflow")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "0"


class _Tracer:
    """onceflow's tracer, taken from whichever tracer provider is global when a span starts
    (kept per provider): a provider installed after import is used at once."""

    def __init__(self, version: str) -> None:
        self._version = version
        self._provider: object = None
        self._tracer: trace.Tracer = trace.NoOpTracer()

    def _current(self) -> trace.Tracer:
        provider = trace.get_tracer_provider()
        if provider is not self._provider:
            self._tracer = provider.get_tracer("onceflow", self._version)
            self._provider = provider
        return self._tracer

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> Span:
        """As :meth:`opentelemetry.trace.Tracer.start_span`; a span that cannot be started
        (a span processor raised) is a non-recording one, never an error in the caller."""
        try:
            return self._current().start_span(name, *args, **kwargs)
        except Exception as exc:
            log.warning("tracing: starting %s failed (%s); not traced", name,
                        type(exc).__qualname__)  # fmt: skip
            return trace.INVALID_SPAN

    def start_as_current_span(
        self, name: str, *args: Any, **kwargs: Any
    ) -> AbstractContextManager[Span]:
        """As :meth:`opentelemetry.trace.Tracer.start_as_current_span`."""
        return self._current().start_as_current_span(name, *args, **kwargs)


#: onceflow's tracer. Without an SDK (or before one is set) it hands out no-op spans.
TRACER = _Tracer(_version())


_NO_SDK = (ProxyTracerProvider, NoOpTracerProvider)
_UNKNOWN = object()
#: The environment names a provider for the API to load on first use.
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def active() -> bool:
    """True when a tracer provider of an SDK is installed: spans may record. Callers skip
    building attributes and links when it is False (the no-op path costs a call).

    Reads the API's global provider where the API keeps it: while none is set,
    ``trace.get_tracer_provider()`` looks the environment up on every call (about a
    microsecond, as much as a compute lock's whole pre-flight hit). The public call is the
    fallback: when an API release keeps it elsewhere, or the environment names a provider.
    """
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is None and not _PROVIDER_FROM_ENV:
        return False
    if provider is None or provider is _UNKNOWN:
        provider = trace.get_tracer_provider()
    return not isinstance(provider, _NO_SDK)


def guarded(fn: Callable[P, None]) -> Callable[P, None]:
    """``fn`` (span code that runs after a durable effect: a commit, a publish) made unable
    to fail its caller: an error in it — a span processor's, or onceflow's — is logged and
    dropped, and the write it records stands."""

    @functools.wraps(fn)
    def safe(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            log.warning("tracing: %s failed (%s); what it records is unaffected",
                        fn.__qualname__, type(exc).__qualname__)  # fmt: skip

    return safe


def attributes(
    *,
    request_id: str | None = None,
    stage: str | None = None,
    worker_class: str | None = None,
    attempt: int | None = None,
    workspace_id: str | None = None,
    operation: str | None = None,
) -> dict[str, AttributeValue]:
    """A request's span attributes (``None`` values left out): onceflow's own and the
    messaging conventions' (``operation``: ``create``, ``receive``, ``process``, ``settle``).
    The workspace id only when ``ONCEFLOW_TRACE_WORKSPACE_IDS`` is set."""
    out: dict[str, AttributeValue] = {"messaging.system": "onceflow"}
    if operation is not None:
        out["messaging.operation.type"] = operation
    if request_id is not None:
        out["onceflow.request_id"] = request_id
        out["messaging.message.id"] = request_id
    if stage is not None:
        out["onceflow.stage"] = stage
    if worker_class is not None:
        out["onceflow.worker_class"] = worker_class
        out["messaging.destination.name"] = worker_class
    if attempt is not None:
        out["onceflow.attempt"] = attempt
    if workspace_id is not None and get_settings().trace_workspace_ids:
        out["onceflow.workspace_id"] = workspace_id
    return out


def ended_with(span: Span, error: BaseException) -> None:
    """Mark ``span`` as failed by ``error``: its type only (``error.type``), never its message,
    which may quote an input."""
    name = type(error).__qualname__
    span.set_attribute("error.type", name)
    span.set_status(StatusCode.ERROR, name)


def run_parent(stored: str | None) -> tuple[Context | None, list[Link]]:
    """Where a stage run's span goes: its parent context and its links.

    The run continues the trace its row was enqueued under (``stored``), however late and
    wherever it runs, and links to that enqueue. When a span is already current in the same
    trace (Celery's own instrumentation, whose task span the wake-up's headers placed under
    the enqueue), the run nests inside it. A current span of another trace (a wake-up sent
    without the row's context) is linked instead, and the run goes under the enqueue.
    A row without a stored context runs under whatever is current (a new trace if nothing).
    """
    enqueue = span_context_from(stored)
    current = trace.get_current_span().get_span_context()
    if enqueue is None:
        return None, []
    links = [Link(enqueue, {"onceflow.link": "enqueue"})]
    if current.is_valid and current.trace_id == enqueue.trace_id:
        return None, links  # nest inside the current span
    if current.is_valid:
        links.append(Link(current, {"onceflow.link": "delivery"}))
    return trace.set_span_in_context(trace.NonRecordingSpan(enqueue)), links
