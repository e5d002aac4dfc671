"""A handler for ``onceflow work tests.integration.tracing_handlers:logged``: one log line
inside a span of its own (the CLI's ``--log-format json`` test reads it)."""

from __future__ import annotations

import logging

from onceflow import tracing
from onceflow.context import StageContext

log = logging.getLogger("onceflow.test.handler")


def logged(ctx: StageContext) -> dict[str, bool]:
    """Log one line under a span (recorded when the process's SDK is set up)."""
    with tracing.TRACER.start_as_current_span("handler step"):
        log.warning("handler ran")
    return {"logged": True}
