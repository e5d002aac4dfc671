"""Commands on requests: ``migrate``, ``enqueue``, ``show``, ``wait``, ``status``, ``list``,
``cancel``, ``requeue``.
"""

from __future__ import annotations

import json
import sys

import click

from onceflow.cli.base import (
    _APP_OPTION,
    EXIT_ERROR,
    _echo_json,
    _enqueue_flow,
    _errors_to_exit,
    _queue,
    main,
)


@main.command()
@click.option(
    "--to",
    "revision",
    default="head",
    show_default=True,
    help="Stop at this revision, e.g. 0007 during a rolling upgrade "
    "(docs/how-to/operate.md, 'Upgrading').",
)
@_errors_to_exit
def migrate(revision: str) -> None:
    """Apply the database migrations (idempotent); every shard's database, in order, when
    ONCEFLOW_DATABASE_URLS or ONCEFLOW_SHARD_MAP name several."""
    from onceflow.migrate import migrate_all
    from onceflow.shards import configured_map

    several = len(configured_map()) > 1

    def report(index: int, url: str) -> None:
        if several:
            click.echo(f"onceflow: shard {index} ({url}) migrated", err=True)

    migrate_all(revision, report)
    where = "every shard is" if several else "database is"
    target = "the latest migration" if revision == "head" else f"revision {revision}"
    click.echo(f"onceflow: {where} at {target}", err=True)


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


_WORKSPACE_OF_ID = click.option(
    "--workspace",
    "workspace_id",
    default=None,
    help="The request's workspace: the request is found by its key (workspace, id) instead "
    "of by its id alone; not found if the id is another workspace's.",
)


@main.command()
@click.argument("request_id")
@_WORKSPACE_OF_ID
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_errors_to_exit
def show(request_id: str, workspace_id: str | None, as_json: bool) -> None:
    """Show one request."""
    request = _queue().get(request_id, workspace_id=workspace_id).as_json()
    if as_json:
        _echo_json(request)
        return
    width = max(len(k) for k in request)
    for key, value in request.items():
        shown = json.dumps(value) if isinstance(value, dict | list) else value
        click.echo(f"{key:<{width}}  {shown}")


#: ``onceflow wait``'s exit status when its timeout passes first (as timeout(1)'s).
EXIT_WAIT_TIMEOUT = 124


@main.command()
@click.argument("request_id")
@_WORKSPACE_OF_ID
@click.option(
    "--timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds to wait at most (up to 3600).",
)
@_errors_to_exit
def wait(request_id: str, workspace_id: str | None, timeout: float) -> None:
    """Wait for a request to end; print it as one JSON object.

    Woken by the database when the request ends, not by polling. Exit status: 0 if it
    succeeded, 1 if it is dead or cancelled, 124 if the timeout passed first (the request
    is printed as it is then), 3 if there is no such request. Any other error exits 1 too,
    with one line on stderr and nothing on stdout.
    """
    from onceflow.errors import InvalidRequest, WaitTimeout
    from onceflow.models.status import Status
    from onceflow.queue.done import check_wait_timeout

    try:
        check_wait_timeout(timeout)
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc), param_hint="--timeout") from None
    try:
        request = _queue().wait(request_id, timeout=timeout, workspace_id=workspace_id)
    except WaitTimeout as exc:
        if exc.request is not None:
            _echo_json(exc.request.as_json())
        click.echo(f"onceflow: {exc}", err=True)
        sys.exit(EXIT_WAIT_TIMEOUT)
    _echo_json(request.as_json())
    if request.status is not Status.SUCCEEDED:
        sys.exit(EXIT_ERROR)


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


def _row_action(name: str, doc: str) -> click.Command:
    """The command ``name``: :class:`~onceflow.Queue`'s method of that name on one request,
    then the row it left, as JSON."""

    @main.command(name=name, help=doc)
    @click.argument("request_id")
    @_WORKSPACE_OF_ID
    @_errors_to_exit
    def command(request_id: str, workspace_id: str | None) -> None:
        act = getattr(_queue(), name)
        _echo_json(act(request_id, workspace_id=workspace_id).as_json())

    return command


cancel = _row_action("cancel", "Cancel a queued request, or ask a running one to stop.")
requeue = _row_action("requeue", "Run a finished or dead request again (refused while it runs).")
