"""Development commands: ``demo`` (the main job end to end) and ``dev-services``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from onceflow.cli.base import (
    EXIT_ERROR,
    EXIT_USAGE,
    _check_database_url,
    _echo_json,
    _errors_to_exit,
    main,
)


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
@click.option(
    "--trace",
    is_flag=True,
    help="Every process exports its OpenTelemetry spans to a local OTLP receiver; the report "
    "ends with the slowest request's trace as a tree. Needs onceflow[otel].",
)
@_errors_to_exit
def demo(
    jobs: int, columns: int, clients: int, workers: int, no_faults: bool, flower: bool,
    keep_open: bool, plot: str | None, timeout: float | None, as_json: bool, browser: bool,
    trace: bool,
) -> None:  # fmt: skip
    """Run the demo application end to end and check its invariants (exit 1 if broken).

    The application is a job hunter's table: each row a job posting, each custom column a
    cell that an LLM fills (one call per cell, under a compute lock), plus a commute from a
    Maps service, a cover letter and a scrape of the company's page per job. Several clients
    ask for overlapping work at once through real Celery workers, against local stand-in
    LLM and Maps servers that count every call; with faults on, a worker is killed mid-stage
    and some write responses are dropped. The report gives the calls per cell, the requests
    collapsed and the ops applied, and checks that each layer held. With --trace it ends
    with one request's trace, from the enqueue to the last op, across every process.
    """
    from onceflow.demo.plan import Options
    from onceflow.demo.report import plot as draw
    from onceflow.demo.report import print_report
    from onceflow.demo.scenario import run_scenario

    def announce(message: str) -> None:
        click.echo(f"onceflow demo: {message}", err=True)

    if trace:  # before anything starts
        from onceflow.demo.trace_view import missing_sdk

        problem = missing_sdk()
        if problem is not None:
            raise click.UsageError(problem)
    if browser:
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
            if "trace" in report:
                from onceflow.demo.trace_view import describe

                click.echo("\n" + describe(report["trace"]))
        sys.stdout.flush()

    if timeout is None:
        timeout = 120.0 + jobs  # a long run (--jobs 500) drains for minutes
    opts = Options(jobs=jobs, columns=columns, clients=clients, workers=workers,
                   faults=not no_faults, flower=flower, timeout=timeout, keep_open=keep_open,
                   progress=sys.stderr.isatty() and not as_json, browser=browser,
                   trace=trace)  # fmt: skip
    report, _ = run_scenario(opts, announce, present)
    sys.exit(0 if report["invariants_ok"] else EXIT_ERROR)


@main.command(name="dev-services")
@click.option("--env", "env_only", is_flag=True, help="Print `export ONCEFLOW_…=` lines.")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def dev_services(env_only: bool, data_dir: Path | None) -> None:
    """Start a private Postgres 18 and Valkey 8 (the `embedded` extra) until Ctrl-C."""
    from onceflow.embedded import run_dev_services

    sys.exit(run_dev_services(env_only=env_only, data_dir=data_dir))
