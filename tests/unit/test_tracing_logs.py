"""Log lines that join the trace (text and JSON), the processes' log set-up, and the SDK set-up
from the ``OTEL_*`` variables."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace

from onceflow import tracing
from onceflow.cli.process_logs import uvicorn_log_config
from onceflow.tracing.setup import wanted


@pytest.fixture()
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own with :func:`configure_logging`'s handler writing to a buffer."""
    name = "onceflow.test-logs"
    logger = logging.getLogger(name)
    handler = tracing.configure_logging("DEBUG", "json", logger=name)
    buffer = io.StringIO()
    handler.setStream(buffer)  # type: ignore[attr-defined]
    logger.propagate = False
    try:
        yield logger, buffer
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def _lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_json_line_carries_the_runs_fields_and_the_current_span(
    captured: tuple[logging.Logger, io.StringIO], trace_spans: Any
) -> None:
    logger, buffer = captured
    with (
        tracing.log_fields(request_id="r1", workspace_id="w1", stage="evaluate", attempt=2),
        tracing.TRACER.start_as_current_span("run") as span,
    ):
        logger.info("stage %s ran", "evaluate")
    (line,) = _lines(buffer)
    context = span.get_span_context()
    assert line["message"] == "stage evaluate ran"
    assert line["level"] == "INFO" and line["logger"] == "onceflow.test-logs"
    assert (line["request_id"], line["workspace_id"], line["stage"], line["attempt"]) == (
        "r1", "w1", "evaluate", 2,
    )  # fmt: skip
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")
    assert line["time"].endswith("+00:00") and isinstance(line["process"], int)


def test_a_line_outside_a_run_and_a_span_has_none_of_the_fields(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = captured
    logger.warning("plain")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    plain, failed = _lines(buffer)
    assert set(plain) == {"time", "level", "logger", "message", "process"}
    assert "Traceback" in failed["exception"] and "ValueError: boom" in failed["exception"]
    assert not set(tracing.LOG_FIELDS) & set(failed)


def test_fields_are_restored_when_the_block_ends(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = captured
    with tracing.log_fields(request_id="outer", stage="s"):
        with tracing.log_fields(request_id="inner", attempt=1):
            logger.info("inner")
        logger.info("outer")
    logger.info("none")
    inner, outer, none = _lines(buffer)
    assert (inner["request_id"], inner["stage"], inner["attempt"]) == ("inner", "s", 1)
    assert outer["request_id"] == "outer" and "attempt" not in outer
    assert "request_id" not in none


def test_the_text_line_appends_the_fields_it_has_and_nothing_without() -> None:
    formatter = tracing.TextFormatter("%(levelname)s %(name)s: %(message)s")
    context_filter = tracing.LogContextFilter()

    def line(message: str) -> str:
        record = logging.LogRecord("onceflow.x", logging.INFO, __file__, 1, message, None, None)
        context_filter.filter(record)
        return formatter.format(record)

    assert line("bare") == "INFO onceflow.x: bare"
    with tracing.log_fields(request_id="r9", stage="fit", attempt=3):
        assert line("in a run") == "INFO onceflow.x: in a run [request=r9 stage=fit attempt=3]"


def test_configuring_twice_keeps_one_handler_and_a_bad_format_is_refused() -> None:
    name = "onceflow.test-twice"
    logger = logging.getLogger(name)
    first = tracing.configure_logging("info", "text", logger=name)
    second = tracing.configure_logging("nonsense-level", "json", logger=name)
    try:
        assert logger.handlers == [second] and first is not second
        assert isinstance(second.formatter, tracing.JsonFormatter)
        assert logger.level == logging.INFO  # an unknown level name is INFO
        with pytest.raises(ValueError, match="text' or 'json"):
            tracing.configure_logging("INFO", "xml", logger=name)
    finally:
        logger.removeHandler(second)


def test_uvicorns_lines_are_json_with_the_fields_when_json_is_asked() -> None:
    text = uvicorn_log_config("text")
    assert text["formatters"]["access"]["()"] == "uvicorn.logging.AccessFormatter"
    config = uvicorn_log_config("json")
    assert config["loggers"]["uvicorn.access"]["handlers"] == ["access"]  # the access log kept
    for handler in config["handlers"].values():
        assert handler["filters"] == ["context"]
        assert config["formatters"][handler["formatter"]]["()"].endswith("JsonFormatter")
    logging.config.dictConfig({**config, "loggers": {}})  # it loads (no logger changed)


# ------------------------------------------------------------------ SDK set-up


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": " Console , otlp"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "otlp"),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
    ],
)
def test_the_exporter_the_environment_asks_for(
    environ: dict[str, str], expected: str | None
) -> None:
    assert wanted(environ) == expected


def test_configure_keeps_the_applications_provider(
    trace_spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    installed = trace.get_tracer_provider()
    assert tracing.configure("onceflow-test") is True
    assert trace.get_tracer_provider() is installed
    with tracing.TRACER.start_as_current_span("after configure"):
        pass
    assert [s.name for s in trace_spans.get_finished_spans()] == ["after configure"]


def test_without_otel_variables_configure_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert tracing.configure("onceflow-test") is False
    assert not tracing.active()


def test_onceflow_otel_setup_false_leaves_the_set_up_to_the_application(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from onceflow.settings import get_settings

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("ONCEFLOW_OTEL_SETUP", "false")
    get_settings.cache_clear()
    try:
        assert tracing.configure("onceflow-test") is False
        assert not tracing.active()
    finally:
        monkeypatch.delenv("ONCEFLOW_OTEL_SETUP")
        get_settings.cache_clear()


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, "onceflow-test"),
        ({"OTEL_SERVICE_NAME": "my-api"}, "my-api"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes,team=x"}, "from-attributes"),
    ],
)
def test_configure_names_the_service_unless_the_environment_does(
    variables: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.util._once import Once

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    try:
        assert tracing.configure("onceflow-test") is True
        provider: Any = trace.get_tracer_provider()
        assert provider.resource.attributes["service.name"] == expected
        provider.shutdown()
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
