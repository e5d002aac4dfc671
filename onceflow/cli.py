"""The ``onceflow`` command line: what scripts and operators rely on.

Every command reads the database from ``ONCEFLOW_DATABASE_URL``; results go to
stdout (one JSON object with ``--json`` or where scripts parse it), errors to
stderr with a non-zero exit status.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
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


@main.command()
@_errors_to_exit
def migrate() -> None:
    """Apply the database migrations (idempotent)."""
    from onceflow.migrate import migrate as run

    run()
    click.echo("onceflow: database is at the latest migration", err=True)


@main.command()
@click.option("--stage", required=True, help="Stage name, e.g. evaluate.")
@click.option("--workspace", "workspace_id", required=True, help="Workspace id.")
@click.option("--job", "job_id", required=True, help="Job id.")
@click.option("--branch-path", default="", show_default=True, help="Branch path.")
@click.option(
    "--worker-class",
    default=None,
    help="Worker class; default: as the app declares the stage (for a declared stage only "
    "a class it declares). Naming it also enqueues a stage the app does not declare, as "
    "is: input not validated, no wake-up sent.",
)
@click.option("--input", "input_json", default="{}", show_default=True, help="Input as JSON.")
@click.option("--priority", type=int, default=None, help="Priority; default: as declared, or 0.")
@click.option("--no-dedupe", is_flag=True, help="Give this request a random id.")
@click.option("--strict", is_flag=True, help="Fail if the request exists with another input.")
@_APP_OPTION
@_errors_to_exit
def enqueue(
    stage: str,
    workspace_id: str,
    job_id: str,
    branch_path: str,
    worker_class: str | None,
    input_json: str,
    priority: int,
    no_dedupe: bool,
    strict: bool,
    app_spec: str | None,
) -> None:
    """Enqueue a stage request; prints {request_id, created, status, input_mismatch}.

    The app (--app / ONCEFLOW_APP) must declare the stage: its input is validated
    against the stage's model and the wake-up sent to its worker class. A stage the
    app does not declare is refused, unless --worker-class names where it goes.
    """
    from onceflow.ids import check_id

    try:
        payload = json.loads(input_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--input") from None
    except RecursionError:  # far deeper than ONCEFLOW_MAX_PAYLOAD_DEPTH: the parser gave up
        raise click.BadParameter("nested too deeply to parse", param_hint="--input") from None
    for name, value in (("workspace_id", workspace_id), ("job_id", job_id), ("stage", stage)):
        check_id(name, value)
    flow = _enqueue_flow(app_spec, stage, worker_class)
    if flow is not None:
        # The configured Flow declares this stage: its declaration, validated input, wake-up.
        result = flow.enqueue(
            stage,
            workspace_id,
            job_id,
            branch_path,
            payload,
            priority=priority,
            strict=strict,
            worker_class=worker_class,
            dedupe=False if no_dedupe else None,
        )
    else:
        result = _queue().enqueue(
            stage,
            workspace_id,
            job_id,
            branch_path,
            payload,
            worker_class=worker_class,
            priority=priority,
            dedupe=not no_dedupe,
            strict=strict,
        )
    _echo_json(
        {
            "request_id": result.request_id,
            "created": result.created,
            "status": result.status.value,
            "input_mismatch": result.input_mismatch,
        }
    )


@main.command()
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_errors_to_exit
def show(request_id: str, as_json: bool) -> None:
    """Show one request."""
    request = _queue().get(request_id).as_json()
    if as_json:
        _echo_json(request)
        return
    width = max(len(k) for k in request)
    for key, value in request.items():
        shown = json.dumps(value) if isinstance(value, dict | list) else value
        click.echo(f"{key:<{width}}  {shown}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_errors_to_exit
def status(as_json: bool) -> None:
    """Request counts by worker class and status."""
    from onceflow.models.status import Status

    counts = _queue().counts()
    if as_json:
        _echo_json({"counts": counts})
        return
    names = [s.value for s in Status]
    click.echo(f"{'worker_class':<20}" + "".join(f"{n:>11}" for n in names))
    for worker_class, per_status in counts.items():
        click.echo(f"{worker_class:<20}" + "".join(f"{per_status[n]:>11}" for n in names))
    if not counts:
        click.echo("(no requests)")


@main.command(name="list")
@click.option("--workspace", "workspace_id")
@click.option("--status", "statuses", multiple=True, help="Repeat for several.")
@click.option("--worker-class")
@click.option("--stage")
@click.option("--limit", type=int, default=50, show_default=True)
@_errors_to_exit
def list_(
    workspace_id: str | None,
    statuses: tuple[str, ...],
    worker_class: str | None,
    stage: str | None,
    limit: int,
) -> None:
    """List requests (newest first) as JSON lines."""
    rows = _queue().list(
        workspace_id=workspace_id,
        status=list(statuses) or None,
        worker_class=worker_class,
        stage=stage,
        limit=limit,
    )
    for request in rows:
        _echo_json(request.as_json())


@main.command()
@click.argument("request_id")
@_errors_to_exit
def cancel(request_id: str) -> None:
    """Cancel a queued request, or ask a running one to stop."""
    _echo_json(_queue().cancel(request_id).as_json())


@main.command()
@click.argument("request_id")
@_errors_to_exit
def requeue(request_id: str) -> None:
    """Run a finished or dead request again (refused while it runs)."""
    _echo_json(_queue().requeue(request_id).as_json())


@main.command()
@click.option("--jobs", type=click.IntRange(1, 1000), default=6, show_default=True)
@click.option("--columns", type=click.IntRange(1, 8), default=4, show_default=True)
@click.option("--clients", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--workers", type=click.IntRange(2, 8), default=2, show_default=True)
@click.option("--no-faults", is_flag=True, help="Skip the kill -9 and the dropped responses.")
@click.option("--flower", is_flag=True, help="Also run Flower (prints its URL and login).")
@click.option(
    "--keep-open", is_flag=True, help="After the report, keep Flower and workers up until Ctrl-C."
)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a PNG.")
@click.option(
    "--timeout", type=float, default=None, help="Seconds for the drain [default: 120 + 1 per job]."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option(
    "--browser",
    is_flag=True,
    help="Also run a real headless browser tab (Debian's Chromium via Playwright; "
    "$ONCEFLOW_CHROMIUM) with the JavaScript SDK, against a real `onceflow api`.",
)
@_errors_to_exit
def demo(
    jobs: int, columns: int, clients: int, workers: int, no_faults: bool, flower: bool,
    keep_open: bool, plot: str | None, timeout: float | None, as_json: bool, browser: bool,
) -> None:  # fmt: skip
    """Run the seed's whole flow for real and check its invariants (exit 1 if broken)."""
    from onceflow.demo.report import plot as draw
    from onceflow.demo.report import print_report
    from onceflow.demo.scenario import Options, run_scenario

    def announce(message: str) -> None:
        click.echo(f"onceflow demo: {message}", err=True)

    if browser:  # before anything starts
        from onceflow.demo.browser import browser_problem

        problem = browser_problem()
        if problem is not None:
            click.echo(f"onceflow demo: {problem}", err=True)
            sys.exit(EXIT_USAGE)
    _check_database_url()

    def present(report: dict[str, Any]) -> None:  # while Flower and the workers still run
        if plot:
            draw(report, plot)
            announce(f"plot written to {plot}")
        if as_json:
            _echo_json(report)
        else:
            print_report(report)
        sys.stdout.flush()

    if timeout is None:
        timeout = 120.0 + jobs  # a long run (--jobs 500) drains for minutes
    opts = Options(jobs=jobs, columns=columns, clients=clients, workers=workers,
                   faults=not no_faults, flower=flower, timeout=timeout, keep_open=keep_open,
                   progress=sys.stderr.isatty() and not as_json, browser=browser)  # fmt: skip
    report, _ = run_scenario(opts, announce, present)
    sys.exit(0 if report["invariants_ok"] else EXIT_ERROR)


def _load(app_spec: str | None) -> tuple[Any, Any]:
    from onceflow.settings import get_settings
    from onceflow.tasks.loader import load_app

    return load_app(app_spec or get_settings().app)


@main.command()
@click.option(
    "--worker-class",
    "worker_classes",
    multiple=True,
    help="Worker class(es) to serve (queue onceflow.wc.<class> each); repeat. "
    "Default: every class the flow declares.",
)
@click.option("--concurrency", "-c", type=click.IntRange(1, 512), default=None)
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@click.option("--pool", default="prefork", show_default=True)
@click.option("--hostname", "-n", default=None, help="Celery node name (default: unique).")
@_APP_OPTION
@_errors_to_exit
def worker(
    worker_classes: tuple[str, ...],
    concurrency: int | None,
    loglevel: str,
    pool: str,
    hostname: str | None,
    app_spec: str | None,
) -> None:
    """Run a Celery worker for some worker classes (a thin wrapper over `celery worker`)."""
    import os

    from onceflow.ids import check_worker_class
    from onceflow.keys import queue_name
    from onceflow.tasks.config import MAINTENANCE_QUEUE

    _check_database_url()
    app, flow = _load(app_spec)
    # The pool's processes fork from this one (sys.path and all); a process that starts
    # afresh finds the app's directory through PYTHONPATH.
    path = os.environ.get("PYTHONPATH", "")
    if os.getcwd() not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), path) if p)
    classes = list(worker_classes) or (flow.queues() if flow is not None else ["default"])
    for wc in classes:
        check_worker_class(wc)
    # Each class's onceflow.wc.<class> queue, and its Flow's maintenance queue (beat's
    # sweeps): another Flow's sweeps are not its own.
    if flow is not None:
        queues = ",".join(flow.broker_queues(classes))
    else:
        queues = ",".join([*(queue_name(wc) for wc in classes), MAINTENANCE_QUEUE])
    name = hostname or f"onceflow-{'-'.join(classes)[:40]}-{os.getpid()}@%h"
    argv = ["worker", "-Q", queues, "-E", "--loglevel", loglevel, "--pool", pool, "-n", name]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    app.worker_main(argv=argv)


@main.command()
@click.argument("handler_spec", metavar="MODULE:FUNCTION")
@click.option(
    "--worker-class",
    "-w",
    "worker_classes",
    multiple=True,
    required=True,
    help="Worker class to serve; repeat for several (claimed in the order given).",
)
@click.option("--concurrency", "-c", type=click.IntRange(1, 1000), default=4, show_default=True)
@click.option(
    "--prefetch",
    type=click.IntRange(0, 1000),
    default=0,
    show_default=True,
    help="Claims held ready beyond the free threads (handed back at shutdown).",
)
@click.option("--lease-seconds", type=float, default=None, help="Default: ONCEFLOW_LEASE_SECONDS.")
@click.option("--max-runtime", type=float, default=None, help="Seconds a body may run at most.")
@click.option("--no-sweep", is_flag=True, help="Leave rescuing lapsed leases to someone else.")
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics (this worker's and the database's) on this port, "
    "unauthenticated, on --metrics-bind.",
)
@click.option("--metrics-bind", default="127.0.0.1", show_default=True)
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@_errors_to_exit
def work(
    handler_spec: str,
    worker_classes: tuple[str, ...],
    concurrency: int,
    prefetch: int,
    lease_seconds: float | None,
    max_runtime: float | None,
    no_sweep: bool,
    metrics_port: int | None,
    metrics_bind: str,
    loglevel: str,
) -> None:
    """Run a standalone worker (no Celery): MODULE:FUNCTION(ctx) for each claimed request.

    The function gets a StageContext, as a Celery stage body does. SIGTERM or SIGINT
    stops it gracefully (claims not started are handed back, running bodies finish); a
    second signal abandons running bodies (their leases lapse).
    """
    import importlib
    import logging
    import os

    from onceflow.worker import Worker

    _check_database_url()
    logging.basicConfig(
        level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    module_name, _, attr = handler_spec.partition(":")
    if not module_name or not attr:
        raise click.UsageError(f"expected MODULE:FUNCTION, got {handler_spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise click.UsageError(f"cannot load {handler_spec!r}: {exc}") from None
    worker = Worker(
        None, list(worker_classes), handler, concurrency=concurrency, prefetch=prefetch,
        lease_seconds=lease_seconds, max_runtime=max_runtime, sweep=not no_sweep,
    )  # fmt: skip
    if metrics_port is not None:
        from onceflow.metrics import multiproc_dir_problem, serve

        problem = multiproc_dir_problem()
        if problem is None:
            serve(metrics_port, metrics_bind)
        else:  # a metrics setting must not stop the worker
            click.echo(f"onceflow: not serving metrics on port {metrics_port}: {problem}", err=True)
    worker.run()


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=9808, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--keep-dead-pids",
    is_flag=True,
    help="Do not drop the live gauges of pids not running on this host (use when the "
    "writers run in another pid namespace, e.g. another container sharing the directory).",
)
@click.option(
    "--no-database",
    is_flag=True,
    help="Serve the processes' metrics only: no database collector (live counts, "
    "onceflow_database_up). Use on all but one scrape target so one place runs the counts.",
)
@_errors_to_exit
def metrics(port: int, bind: str, keep_dead_pids: bool, no_database: bool) -> None:
    """Serve Prometheus metrics: every process of PROMETHEUS_MULTIPROC_DIR, and the database.

    UNAUTHENTICATED: bind it to an internal network only (the default is loopback). The
    workers' files are merged from PROMETHEUS_MULTIPROC_DIR, which the start script sets
    before any onceflow process starts and wipes at each start; the database's live
    counts (queued, scheduled, running, dead; oldest due age) are read at each scrape
    (onceflow_database_up 0 when it does not answer). See docs/metrics.md.
    """
    import threading

    from onceflow.metrics import multiproc_dir, multiproc_dir_problem, registry, serve

    problem = multiproc_dir_problem()
    if problem is not None:
        click.echo(f"onceflow: {problem}", err=True)
        sys.exit(EXIT_ERROR)
    if multiproc_dir() is None:
        click.echo(
            "onceflow: PROMETHEUS_MULTIPROC_DIR is not set: serving the database's counts "
            "only (no worker's metrics)",
            err=True,
        )
    serve(port, bind, reg=registry(database=not no_database, prune_dead=not keep_dead_pids))
    click.echo(f"onceflow: metrics on http://{bind}:{port}/metrics", err=True)
    threading.Event().wait()


@main.command()
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@_APP_OPTION
@_errors_to_exit
def beat(loglevel: str, app_spec: str | None) -> None:
    """Run Celery beat, which sends the sweeper task every ONCEFLOW_SWEEP_INTERVAL_SECONDS."""
    app, _ = _load(app_spec)
    # The in-memory scheduler: an interval schedule needs no state file (and shelve is pickle).
    app.start(argv=["beat", "--loglevel", loglevel, "--scheduler", "celery.beat:Scheduler"])


@main.command()
@click.option(
    "--redispatch-after",
    type=float,
    default=None,
    help="Seconds before an unclaimed wake-up is sent again.",
)
@_APP_OPTION
@_errors_to_exit
def sweep(redispatch_after: float | None, app_spec: str | None) -> None:
    """Run one sweeper pass of the configured Flow now; prints what it did as JSON.

    Only the stages that Flow declares are swept: it sends their wake-ups, and leaves
    every other stage's rows to the Flow that declares them.
    """
    from onceflow.settings import get_settings

    spec = app_spec or get_settings().app
    _, flow = _load(spec)
    if flow is None:
        raise click.UsageError(
            f"sweep needs an onceflow Flow, and {spec!r} is a bare Celery app: "
            "pass --app module:flow or set ONCEFLOW_APP"
        )
    if not flow.stages:
        raise click.UsageError(
            f"the Flow {spec!r} declares no stages, so it has nothing to sweep: "
            "pass --app module:flow or set ONCEFLOW_APP to the Flow that declares them"
        )
    result = flow.sweep_once(redispatch_after=redispatch_after)
    _echo_json(
        {
            "rescued": result.rescued,
            "quarantined": result.quarantined,
            "dispatched": [d.request_id for d in result.to_dispatch],
            "pruned": result.pruned,
        }
    )


@main.command()
@click.option(
    "--conf", type=click.Path(exists=True, dir_okay=False), default="flower.cfg", show_default=True
)
@click.option("--port", type=int, default=None)
@click.option("--address", default=None)
@click.option("--insecure-no-auth", is_flag=True, help="Start without basic auth (never in prod).")
@_APP_OPTION
@_errors_to_exit
def flower(
    conf: str, port: int | None, address: str | None, insecure_no_auth: bool, app_spec: str | None
) -> None:
    """Run Flower with flower.cfg; refuses to start without ONCEFLOW_FLOWER_BASIC_AUTH."""
    from onceflow.flower_auth import InvalidBasicAuth, basic_auth_from_env

    try:
        credentials = basic_auth_from_env()
    except InvalidBasicAuth as exc:  # the message names the entry, never the value
        click.echo(f"onceflow: refusing to start Flower: {exc}", err=True)
        sys.exit(EXIT_ERROR)
    if credentials is None and not insecure_no_auth:
        click.echo(
            "onceflow: refusing to start Flower without credentials: set "
            "ONCEFLOW_FLOWER_BASIC_AUTH=user:password (or pass --insecure-no-auth)",
            err=True,
        )
        sys.exit(EXIT_ERROR)
    app, _ = _load(app_spec)
    argv = ["flower", f"--conf={conf}"]
    if port is not None:
        argv.append(f"--port={port}")
    if address is not None:
        argv.append(f"--address={address}")
    app.start(argv=argv)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--forwarded-allow-ips",
    default=None,
    help="Proxies (comma-separated IPs, or *) whose X-Forwarded-For is trusted as the client "
    "address (uvicorn's option; default: 127.0.0.1,::1, or $FORWARDED_ALLOW_IPS). Behind another "
    "proxy, set it: the per-address limit on failed authentication would otherwise count "
    "every client as the proxy.",
)
@_APP_OPTION
@_errors_to_exit
def api(
    host: str,
    port: int,
    log_level: str,
    forwarded_allow_ips: str | None,
    app_spec: str | None,
) -> None:
    """Serve the HTTP API (FastAPI on uvicorn): enqueue, pull-worker claims, ops, events."""
    try:
        import uvicorn

        from onceflow.integrations.fastapi import create_app
    except ImportError as exc:
        click.echo(f"onceflow: pip install 'onceflow[fastapi]' first ({exc})", err=True)
        sys.exit(EXIT_ERROR)
    from onceflow.settings import get_settings

    _check_database_url()
    _, flow = _load(app_spec)
    if flow is None:
        raise click.UsageError("api needs an onceflow Flow, not a bare Celery app")
    settings = get_settings()
    if not settings.api_keys and not settings.worker_keys:
        click.echo(
            "onceflow: no API or worker keys configured (ONCEFLOW_API_KEYS / "
            "ONCEFLOW_WORKER_KEYS): every /v1 request will get 401",
            err=True,
        )
    if not settings.operator_keys:
        click.echo(
            "onceflow: no operator keys configured (ONCEFLOW_OPERATOR_KEYS): the dashboard's "
            "data and /metrics will get 401",
            err=True,
        )
    from onceflow.metrics import multiproc_dir_problem

    problem = multiproc_dir_problem()
    if problem is not None:
        click.echo(f"onceflow: {problem}: no metrics recorded by this process", err=True)
    _log_onceflow(log_level)  # the dashboard's audit lines (onceflow.dashboard) among them
    uvicorn.run(
        create_app(flow=flow),
        host=host,
        port=port,
        log_level=log_level,
        proxy_headers=True,
        forwarded_allow_ips=forwarded_allow_ips,
    )


def _log_onceflow(level: str) -> None:
    """Send onceflow's own log records to stderr at ``level`` (uvicorn configures only its own)."""
    import logging

    logger = logging.getLogger("onceflow")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper() if level.upper() in logging.getLevelNamesMapping() else "INFO")


@main.command(name="mcp")
@click.option("--name", default="onceflow", show_default=True, help="Server name for clients.")
@_APP_OPTION
@_errors_to_exit
def mcp_(name: str, app_spec: str | None) -> None:
    """Serve the MCP tools (enqueue a stage, get and list requests) over stdio."""
    try:
        from onceflow.integrations.mcp import serve
    except ImportError as exc:
        click.echo(f"onceflow: pip install 'onceflow[mcp]' first ({exc})", err=True)
        sys.exit(EXIT_ERROR)
    _check_database_url()
    _, flow = _load(app_spec)
    if flow is None:
        raise click.UsageError("mcp needs an onceflow Flow, not a bare Celery app")
    serve(flow, name=name)


@main.command(name="dev-services")
@click.option("--env", "env_only", is_flag=True, help="Print `export ONCEFLOW_…=` lines.")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def dev_services(env_only: bool, data_dir: Path | None) -> None:
    """Start a private Postgres 16 and Valkey 8 (the `embedded` extra) until Ctrl-C."""
    from onceflow.embedded import run_dev_services

    sys.exit(run_dev_services(env_only=env_only, data_dir=data_dir))


if __name__ == "__main__":  # pragma: no cover
    main()
