"""Commands that run a process: ``worker``, ``work``, ``metrics``, ``beat``, ``sweep``,
``flower``, ``api``, ``mcp``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from onceflow.cli.base import (
    _APP_OPTION,
    EXIT_ERROR,
    _check_database_url,
    _echo_json,
    _errors_to_exit,
    _load,
    _require_migrated,
    main,
)
from onceflow.cli.process_logs import (
    celery_logs,
    chosen_format,
    log_format_option,
    start,
    uvicorn_log_config,
)
from onceflow.errors import InvalidRequest


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
@click.option(
    "--events/--no-events",
    default=True,
    show_default=True,
    help="Send task events (Flower shows them; --no-events saves their broker messages).",
)
@click.option("--without-gossip", is_flag=True, help="Celery's: no gossip with other workers.")
@click.option("--without-mingle", is_flag=True, help="Celery's: no synchronisation at start.")
@click.option("--without-heartbeat", is_flag=True, help="Celery's: no worker heartbeat events.")
@log_format_option
@_APP_OPTION
@_errors_to_exit
def worker(
    worker_classes: tuple[str, ...],
    concurrency: int | None,
    loglevel: str,
    pool: str,
    hostname: str | None,
    events: bool,
    without_gossip: bool,
    without_mingle: bool,
    without_heartbeat: bool,
    log_format: str | None,
    app_spec: str | None,
) -> None:
    """Run a Celery worker for some worker classes (a thin wrapper over `celery worker`).

    Traced when the OTEL_* variables ask for it (service onceflow-worker unless
    OTEL_SERVICE_NAME names one)."""
    import os

    from onceflow.ids import check_worker_class
    from onceflow.keys import queue_name
    from onceflow.tasks.config import MAINTENANCE_QUEUE, user_sets

    _check_database_url()
    app, flow = _load(app_spec)
    if flow is not None and not flow.queues():
        raise click.UsageError(
            "the Flow declares no stage a Celery worker runs (none, or only pull-worker "
            "stages): this worker would have nothing to do"
        )
    if flow is not None:
        try:
            flow.check_declarations()
        except InvalidRequest as exc:
            raise click.UsageError(str(exc)) from None
    _require_migrated()
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
    argv = ["worker", "-Q", queues, "--loglevel", loglevel, "--pool", pool, "-n", name]
    if events:
        argv.append("-E")
    else:  # Celery's CLI can only turn them on: a Flow's own app has them on in its config
        app.conf.worker_send_task_events = False
        app.conf.task_send_sent_event = False
    flags = {"--without-gossip": without_gossip, "--without-mingle": without_mingle,
             "--without-heartbeat": without_heartbeat}  # fmt: skip
    argv += [flag for flag, on in flags.items() if on]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    if not user_sets(app.conf, "worker_prefetch_multiplier"):
        # One wake-up reserved per process (a stage may run for long), as a Flow's own app
        # is configured: a worker-level option here, your app's setting if it has one.
        argv += ["--prefetch-multiplier", "1"]
    # Before the pool forks: each pool process inherits the SDK and the log handlers.
    start("onceflow-worker")
    celery_logs(chosen_format(log_format))
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
@click.option(
    "--max-held",
    type=click.IntRange(1, 10_000),
    default=None,
    help="Claims held at most: waiting, running, or finished and not yet recorded "
    "(claiming pauses there while the database is slow). Default: twice "
    "concurrency + prefetch.",
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
@log_format_option
@_errors_to_exit
def work(
    handler_spec: str,
    worker_classes: tuple[str, ...],
    concurrency: int,
    prefetch: int,
    max_held: int | None,
    lease_seconds: float | None,
    max_runtime: float | None,
    no_sweep: bool,
    metrics_port: int | None,
    metrics_bind: str,
    loglevel: str,
    log_format: str | None,
) -> None:
    """Run a standalone worker (no Celery): MODULE:FUNCTION(ctx) for each claimed request.

    The function gets a StageContext, as a Celery stage body does. SIGTERM or SIGINT
    stops it gracefully (claims not started are handed back, running bodies finish); a
    second signal abandons running bodies (their leases lapse). Traced when the OTEL_*
    variables ask for it (service onceflow-work unless OTEL_SERVICE_NAME names one).
    """
    import importlib
    import os

    from onceflow import tracing
    from onceflow.worker import Worker

    _check_database_url()
    tracing.configure_logging(loglevel, chosen_format(log_format))
    start("onceflow-work")
    module_name, _, attr = handler_spec.partition(":")
    if not module_name or not attr:
        raise click.UsageError(f"expected MODULE:FUNCTION, got {handler_spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        handler = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise click.UsageError(f"cannot load {handler_spec!r}: {exc}") from None
    _require_migrated()
    worker = Worker(
        None, list(worker_classes), handler, concurrency=concurrency, prefetch=prefetch,
        max_held=max_held, lease_seconds=lease_seconds, max_runtime=max_runtime,
        sweep=not no_sweep,
    )  # fmt: skip
    if metrics_port is not None:
        from onceflow.metrics import multiproc_dir_problem, serve

        problem = multiproc_dir_problem()
        if problem is None:
            serve(metrics_port, metrics_bind)
        else:  # a metrics setting must not stop the worker
            click.echo(f"onceflow: not serving metrics on port {metrics_port}: {problem}", err=True)
    try:
        worker.run()
    finally:
        tracing.flush()


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
@log_format_option
@_APP_OPTION
@_errors_to_exit
def beat(loglevel: str, log_format: str | None, app_spec: str | None) -> None:
    """Run Celery beat, which sends the sweeper task every ONCEFLOW_SWEEP_INTERVAL_SECONDS.

    Traced when the OTEL_* variables ask for it (service onceflow-beat unless
    OTEL_SERVICE_NAME names one)."""
    app, flow = _load(app_spec)
    if flow is not None and not flow.stages:
        raise click.UsageError("the Flow declares no stages: beat would have nothing to sweep")
    _require_migrated()
    start("onceflow-beat")
    celery_logs(chosen_format(log_format))
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
            "overran": result.overran,
            "dispatched": [d.request_id for d in result.to_dispatch],
            "pruned": result.pruned,
        }
    )


def flower_conf_path(conf: str | None, cwd: Path | None = None) -> Path:
    """The settings file Flower runs with: ``conf`` if given, else the working directory's
    flower.cfg, else the one inside the package (a wheel install has no repository)."""
    if conf is not None:
        return Path(conf)
    local = (cwd or Path.cwd()) / "flower.cfg"
    if local.is_file():
        return local
    import importlib.util

    spec = importlib.util.find_spec("onceflow.flower_conf")  # found, not run
    if spec is None or spec.origin is None:  # a broken install
        raise click.UsageError("onceflow's own Flower settings are missing; pass --conf")
    return Path(spec.origin)


@main.command()
@click.option(
    "--conf",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Flower's settings file. Default: ./flower.cfg if there is one, else onceflow's own "
    "(onceflow/flower_conf.py: loopback, basic auth from ONCEFLOW_FLOWER_BASIC_AUTH).",
)
@click.option("--port", type=int, default=None)
@click.option("--address", default=None)
@click.option("--insecure-no-auth", is_flag=True, help="Start without basic auth (never in prod).")
@_APP_OPTION
@_errors_to_exit
def flower(
    conf: str | None,
    port: int | None,
    address: str | None,
    insecure_no_auth: bool,
    app_spec: str | None,
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
    argv = ["flower", f"--conf={flower_conf_path(conf)}"]
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
    envvar="FORWARDED_ALLOW_IPS",
    help="The reverse proxies (comma-separated IPs or networks, or *) whose X-Forwarded-For "
    "and X-Forwarded-Proto are trusted (uvicorn's option; also $FORWARDED_ALLOW_IPS). "
    "Default: none — the client address is the connection's, from loopback too. Behind a "
    "proxy, name it: the per-address limit on failed authentication otherwise counts every "
    "client as the proxy.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="API processes on the one port (uvicorn's workers). Each holds its own pools, "
    "work listener, event hub and in-memory rate limits (share them with "
    "ONCEFLOW_API_RATE_LIMIT_STORAGE=redis://…); Postgres and Redis are shared.",
)
@log_format_option
@_APP_OPTION
@_errors_to_exit
def api(
    host: str,
    port: int,
    log_level: str,
    forwarded_allow_ips: str | None,
    workers: int,
    log_format: str | None,
    app_spec: str | None,
) -> None:
    """Serve the HTTP API (FastAPI on uvicorn): enqueue, pull-worker claims, ops, events.

    Traced when the OTEL_* variables ask for it (service onceflow-api unless
    OTEL_SERVICE_NAME names one): each request's span continues the caller's W3C
    ``traceparent``. With ``--workers N``, N processes (see docs/integration-fastapi.md)."""
    try:
        import uvicorn

        from onceflow.integrations.fastapi import create_app
    except ImportError as exc:
        _missing_extra("fastapi", exc)
    import logging

    from onceflow import tracing
    from onceflow.settings import get_settings

    # onceflow's own lines (these warnings, the dashboard's audit lines) in the format asked
    # for; uvicorn's are configured by uvicorn from log_config, and keep to its loggers.
    tracing.configure_logging(log_level, chosen_format(log_format))
    log = logging.getLogger("onceflow.api")
    flow = _served_flow("api", app_spec)
    settings = get_settings()
    if not settings.api_keys and not settings.worker_keys:
        log.warning(
            "no API or worker keys configured (ONCEFLOW_API_KEYS / ONCEFLOW_WORKER_KEYS): "
            "every /v1 request will get 401"
        )
    if not settings.operator_keys:
        log.warning(
            "no operator keys configured (ONCEFLOW_OPERATOR_KEYS): the dashboard's data and "
            "/metrics will get 401"
        )
    from onceflow.metrics import multiproc_dir_problem

    problem = multiproc_dir_problem()
    if problem is not None:
        log.warning("%s: no metrics recorded by this process", problem)
    served: Any
    if workers > 1:
        import os

        from onceflow.cli import api_workers

        # Each spawned process loads the Flow itself (api_workers.app): checked above.
        if app_spec is not None:
            os.environ["ONCEFLOW_APP"] = app_spec
        os.environ[api_workers.LOG_FORMAT_ENV] = chosen_format(log_format)
        os.environ[api_workers.LOG_LEVEL_ENV] = log_level
        served = "onceflow.cli.api_workers:app"
    else:
        start("onceflow-api")
        served = create_app(flow=flow)
    uvicorn.run(
        served,
        factory=workers > 1,
        workers=workers if workers > 1 else None,
        host=host,
        port=port,
        log_level=log_level,
        log_config=uvicorn_log_config(chosen_format(log_format)),
        # Forwarded headers only from the proxies the operator named: uvicorn's own default
        # trusts them from 127.0.0.1, where any local client could name any address.
        proxy_headers=bool(forwarded_allow_ips),
        forwarded_allow_ips=forwarded_allow_ips or None,
    )


@main.command(name="mcp")
@click.option("--name", default="onceflow", show_default=True, help="Server name for clients.")
@_APP_OPTION
@_errors_to_exit
def mcp_(name: str, app_spec: str | None) -> None:
    """Serve the MCP tools (enqueue a stage, get and list requests) over stdio."""
    try:
        from onceflow.integrations.mcp import serve
    except ImportError as exc:
        _missing_extra("mcp", exc)
    serve(_served_flow("mcp", app_spec), name=name)


def _missing_extra(extra: str, exc: ImportError) -> NoReturn:
    """Exit with the install command of the extra a serving command needs."""
    click.echo(f"onceflow: pip install 'onceflow[{extra}]' first ({exc})", err=True)
    sys.exit(EXIT_ERROR)


def _served_flow(command: str, app_spec: str | None) -> Any:
    """The Flow ``command`` serves (``api``, ``mcp``): a bare Celery app is a usage error."""
    _check_database_url()
    _, flow = _load(app_spec)
    if flow is None:
        raise click.UsageError(f"{command} needs an onceflow Flow, not a bare Celery app")
    return flow
