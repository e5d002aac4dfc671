"""Credentials for pull workers: ``mint-worker-token``."""

from __future__ import annotations

import click

from onceflow.cli.base import _errors_to_exit, main


@main.command(name="mint-worker-token")
@click.option(
    "--workspace",
    "workspaces",
    multiple=True,
    required=True,
    help="A workspace the token may claim in: an id, or a prefix ending in * (acme-*). "
    "Repeat for several.",
)
@click.option(
    "--worker-class",
    "worker_classes",
    multiple=True,
    required=True,
    help="A worker class the token may claim. Repeat for several.",
)
@click.option(
    "--ttl",
    type=float,
    default=900,
    show_default=True,
    help="Seconds the token is valid (at most ONCEFLOW_WORKER_TOKEN_MAX_LIFETIME_SECONDS).",
)
@click.option("--subject", default=None, help="Who the token is for (the JWT's sub), for logs.")
@_errors_to_exit
def mint_worker_token(
    workspaces: tuple[str, ...],
    worker_classes: tuple[str, ...],
    ttl: float,
    subject: str | None,
) -> None:
    """Print a short-lived worker token (a JWT signed with the first of
    ONCEFLOW_WORKER_TOKEN_SECRETS): claim rights for those worker classes in those
    workspaces only, until it expires. An app's back end mints them with
    onceflow.mint_worker_token (or any JWT library); this command is for scripts and trials.
    """
    from onceflow.worker_tokens import mint_worker_token as mint

    token = mint(
        workspaces=list(workspaces),
        worker_classes=list(worker_classes),
        ttl_seconds=ttl,
        subject=subject,
    )
    click.echo(token)
