"""Tracing and log lines of the processes the CLI runs (``worker``, ``work``, ``api``, ``beat``).

Each starts with :func:`start`: OpenTelemetry's SDK set up from the ``OTEL_*`` variables
(:func:`onceflow.tracing.configure`, under the process's service name unless
``OTEL_SERVICE_NAME`` names one), and its log lines in the ``--log-format`` asked for
(``ONCEFLOW_LOG_FORMAT``): text, or one JSON object per line, each with the request id,
workspace, stage and attempt of the run it is about and the current trace and span ids.

Celery and uvicorn configure logging themselves: :func:`celery_logs` hooks Celery's
``after_setup_logger`` / ``after_setup_task_logger`` signals (its documented way to change
what it set up) and :func:`uvicorn_log_config` is the configuration handed to uvicorn, its
access log kept (as JSON when JSON is asked for).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import click

from onceflow import tracing

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("text", "json")


def log_format_option(func: F) -> F:
    """``--log-format [text|json]``, by default ``ONCEFLOW_LOG_FORMAT`` (text)."""
    return click.option(
        "--log-format",
        "log_format",
        type=click.Choice(FORMATS),
        default=None,
        help="Log lines as text, or one JSON object per line with the request id, workspace, "
        "stage, attempt and trace ids. Default: ONCEFLOW_LOG_FORMAT (text).",
    )(func)


def chosen_format(log_format: str | None) -> str:
    """The format given, else the settings' (``ONCEFLOW_LOG_FORMAT``)."""
    if log_format is not None:
        return log_format
    from onceflow.settings import get_settings

    return get_settings().log_format


def start(service_name: str) -> bool:
    """Set up tracing for this process (see :func:`onceflow.tracing.configure`); True when
    spans are recorded."""
    return tracing.configure(service_name)


def celery_logs(fmt: str) -> None:
    """Make the handlers Celery sets up (worker, beat, and each pool process) write ``fmt``
    lines that carry the request's fields and the trace ids. (A pool process exports the
    spans it still holds as it exits: :mod:`onceflow.tasks.worker_process`.)"""
    from celery import signals

    signals.after_setup_logger.connect(_root_logger_set_up(fmt), weak=False)
    signals.after_setup_task_logger.connect(_task_logger_set_up(fmt), weak=False)


def _root_logger_set_up(fmt: str) -> Callable[..., None]:
    def hook(logger: logging.Logger, format: str | None = None, **_: Any) -> None:
        text = tracing.TextFormatter(format) if format else tracing.TextFormatter()
        _reformat(logger, tracing.JsonFormatter() if fmt == "json" else text)

    return hook


def _task_logger_set_up(fmt: str) -> Callable[..., None]:
    def hook(logger: logging.Logger, **_: Any) -> None:
        # Text keeps Celery's task format (the task's name and id); the fields are on the
        # records for a format that names them.
        _reformat(logger, tracing.JsonFormatter() if fmt == "json" else None)

    return hook


def _reformat(logger: logging.Logger, formatter: logging.Formatter | None) -> None:
    for handler in logger.handlers:
        if not any(isinstance(f, tracing.LogContextFilter) for f in handler.filters):
            handler.addFilter(tracing.LogContextFilter())
        if formatter is not None:
            handler.setFormatter(formatter)


def uvicorn_log_config(fmt: str) -> dict[str, Any]:
    """uvicorn's own logging configuration, its lines (access log included) as JSON with the
    request's trace ids when ``fmt`` is ``json``, else unchanged."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    if fmt != "json":
        return config
    json_formatter = {"()": "onceflow.tracing.logs.JsonFormatter"}
    config["formatters"] = {"default": json_formatter, "access": dict(json_formatter)}
    config["filters"] = {"context": {"()": "onceflow.tracing.logs.LogContextFilter"}}
    for handler in config["handlers"].values():
        handler["filters"] = ["context"]
    return config


__all__ = [
    "FORMATS",
    "celery_logs",
    "chosen_format",
    "log_format_option",
    "start",
    "uvicorn_log_config",
]
