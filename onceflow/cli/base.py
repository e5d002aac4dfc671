"""What every command shares: the ``main`` group, exit codes, error printing, ``--app``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from onceflow.errors import InvalidRequest, NotFound, OnceflowError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1
EXIT_USAGE = 2  # as click's usage errors: this machine cannot run what was asked
EXIT_NOT_FOUND = 3


def _errors_to_exit(func: F) -> F:
    """Print onceflow errors as one line on stderr and exit non-zero (no traceback)."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except NotFound as exc:
            click.echo(f"onceflow: {_one_line(str(exc))}", err=True)
            sys.exit(EXIT_NOT_FOUND)
        except OnceflowError as exc:
            click.echo(f"onceflow: {type(exc).__name__}: {_one_line(str(exc))}", err=True)
            sys.exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


def _one_line(message: str) -> str:
    """``message`` on one line: e.g. a model's validation errors as ``field: problem; …``."""
    parts: list[str] = []
    for line in message.splitlines():
        text = line.strip()
        if not text or text.startswith("For further information visit"):
            continue
        if line[:1].isspace() and parts:
            parts[-1] = f"{parts[-1]}: {text}"  # pydantic: the field, then its problem indented
        else:
            parts.append(text)
    return "; ".join(parts)


def _queue() -> Any:
    from onceflow.queue import Queue

    return Queue()


def _enqueue_flow(app_spec: str | None, stage: str, worker_class: str | None) -> Any:
    """The app's Flow if it declares ``stage``; None to enqueue it raw on ``worker_class``.

    An undeclared stage is refused (:class:`UnknownStage`, one line naming the app)
    unless the caller named the worker class.
    """
    from onceflow.settings import get_settings
    from onceflow.tasks.loader import load_app

    spec = app_spec or get_settings().app
    try:
        _, flow = load_app(spec)
    except InvalidRequest:
        if worker_class is None:
            raise
        # Named explicitly (a cron job run elsewhere, say): the raw request needs no app.
        click.echo(f"onceflow: the app {spec} could not be imported; enqueued raw", err=True)
        return None
    if flow is not None and stage in flow.stages:
        return flow
    if worker_class is not None:
        return None  # named explicitly: a raw request on that class
    declared = ", ".join(sorted(flow.stages)) if flow is not None and flow.stages else "none"
    click.echo(
        f"onceflow: UnknownStage: the app {spec} does not declare a stage {stage!r} "
        f"(it declares: {declared}); pass --app module:flow naming the Flow that declares it, "
        "or --worker-class to enqueue it undeclared",
        err=True,
    )
    sys.exit(EXIT_ERROR)


def _check_database_url() -> None:
    """Refuse a malformed ONCEFLOW_DATABASE_URL before a long-running command starts."""
    from onceflow.db import check_database_url
    from onceflow.settings import get_settings

    check_database_url(get_settings().database_url)


def _require_migrated() -> None:
    """Refuse to start a long-running process on a database (any shard) that answers but is
    not at the package's head: it would log a missing table every few seconds forever.

    A database that does not answer is left to the process, which waits for it as it
    waits through any outage (a container started before its database, say).
    """
    from onceflow.db import redact_url
    from onceflow.health import database_revisions, migrations_problem
    from onceflow.settings import get_settings
    from onceflow.shards import configured_map

    for url in configured_map(get_settings()).urls:
        try:
            found = database_revisions(url, timeout=5.0)
        except Exception:  # noqa: S112 - unreachable now: the process waits for it
            continue
        problem = migrations_problem(found)
        if problem is not None:
            raise click.ClickException(f"database {redact_url(url)} is {problem}")


_APP_OPTION = click.option(
    "--app",
    "app_spec",
    default=None,
    help="module:attribute of the Flow, imported from the current directory "
    "(default ONCEFLOW_APP).",
)


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, sort_keys=True, default=str))


@click.group()
@click.version_option(package_name="onceflow")
def main() -> None:
    """onceflow: run each stage once, pay for each call once, apply each write once."""


def _load(app_spec: str | None, *, broker: bool = True) -> tuple[Any, Any]:
    """The app and Flow of ``app_spec``; with ``broker``, a Redis Cluster as its broker is
    refused here, at start-up (:class:`~onceflow.errors.InvalidRedisUrl`)."""
    from onceflow.settings import get_settings
    from onceflow.tasks.config import check_broker
    from onceflow.tasks.loader import load_app

    app, flow = load_app(app_spec or get_settings().app)
    if broker:
        check_broker(app)
    return app, flow
