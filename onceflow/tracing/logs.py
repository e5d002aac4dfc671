"""Log lines that join the trace: the request a line is about, and the current span.

Every runner sets :func:`log_fields` around a stage run (request id, workspace, stage,
attempt). :class:`LogContextFilter` copies them onto each record, with the current span's
trace and span ids, as attributes (``record.request_id``, ``record.trace_id``, …) that any
formatter can use; :class:`TextFormatter` appends them to the line, :class:`JsonFormatter`
writes one JSON object per line. :func:`configure_logging` is what ``onceflow worker``,
``work``, ``api`` and ``beat`` use (``ONCEFLOW_LOG_FORMAT``). An application that configures
its own logging adds :class:`LogContextFilter` to its handlers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, ClassVar

from opentelemetry import trace

#: The fields a record gets (None when not known): the request's, then the span's.
LOG_FIELDS = ("request_id", "workspace_id", "stage", "attempt", "trace_id", "span_id")

_REQUEST_FIELDS = LOG_FIELDS[:4]

_NONE: Mapping[str, Any] = MappingProxyType({})
_current: ContextVar[Mapping[str, Any]] = ContextVar("onceflow_log_fields", default=_NONE)


@contextmanager
def log_fields(**fields: Any) -> Iterator[None]:
    """Put ``fields`` (of :data:`LOG_FIELDS`) on every log record made inside the block."""
    token = _current.set({**_current.get(), **fields})
    try:
        yield
    finally:
        _current.reset(token)


class LogContextFilter(logging.Filter):
    """Copies the current request's fields and span ids onto each record (never drops one).
    Add it to a handler: a logger's own filters do not see its children's records."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _current.get()
        for name in _REQUEST_FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, fields.get(name))
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            record.trace_id = format(span_context.trace_id, "032x")
            record.span_id = format(span_context.span_id, "016x")
        else:
            record.trace_id = record.span_id = None
        return True


class TextFormatter(logging.Formatter):
    """The usual line, then ``[request=… stage=… attempt=… trace=… span=…]`` for the fields
    a record has (nothing when it has none)."""

    _SHORT: ClassVar[dict[str, str]] = {
        "request_id": "request", "workspace_id": "workspace",
        "trace_id": "trace", "span_id": "span",
    }  # fmt: skip

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        parts = [
            f"{self._SHORT.get(name, name)}={value}"
            for name in LOG_FIELDS
            if (value := getattr(record, name, None)) is not None
        ]
        return f"{line} [{' '.join(parts)}]" if parts else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    the fields a record has, ``process``, and ``exception`` (its traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in LOG_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        out["process"] = record.process
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(
    level: str | int = "INFO",
    fmt: str = "text",
    *,
    logger: str | None = None,
    text_format: str = "%(asctime)s %(levelname)s %(name)s: %(message)s",
) -> logging.Handler:
    """One stderr handler on ``logger`` (the root logger by default) at ``level``, with the
    context filter and the ``fmt`` formatter (``text`` or ``json``). Replaces the handlers
    this function added before (calling it twice does not double the lines)."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    target = logging.getLogger(logger)
    for old in [h for h in target.handlers if getattr(h, "onceflow_configured", False)]:
        target.removeHandler(old)
    handler = logging.StreamHandler()
    handler.onceflow_configured = True  # type: ignore[attr-defined]
    handler.addFilter(LogContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(text_format))
    target.addHandler(handler)
    if isinstance(level, str):
        level = level.upper()
        if level not in logging.getLevelNamesMapping():
            level = "INFO"
    target.setLevel(level)
    return handler
