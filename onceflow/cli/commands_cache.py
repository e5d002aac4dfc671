"""The result cache from the command line: ``onceflow cache invalidate`` and ``purge``."""

from __future__ import annotations

from typing import TextIO

import click

from onceflow.cli.base import _echo_json, _errors_to_exit, main


@main.group(name="cache")
def cache() -> None:
    """Invalidate and purge entries of the result cache (compute_once(..., cache=...))."""


@cache.command(name="invalidate")
@click.option(
    "--scope", type=click.Choice(["workspace", "global"]), required=True, help="The key's scope."
)
@click.option(
    "--workspace", "workspace_id", default=None, help="A workspace-scope key's workspace."
)
@click.option("--key", default=None, help="The key's text, as the code gives it to CacheKey.")
@click.option(
    "--key-file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="Read the key's text from a file ('-': standard input), for a long prompt.",
)
@click.option(
    "--digest", default=None, help="The key's sha256 (64 hex digits) instead of its text."
)
@_errors_to_exit
def cache_invalidate(
    scope: str,
    workspace_id: str | None,
    key: str | None,
    key_file: TextIO | None,
    digest: str | None,
) -> None:
    """Delete one entry, so the next identical call pays again; print whether it existed."""
    from onceflow.cache import invalidate
    from onceflow.errors import InvalidRequest

    if key_file is not None:
        if key is not None:
            raise InvalidRequest("give the key as --key or --key-file, not both")
        key = key_file.read()
    deleted = invalidate(scope, key=key, digest=digest, workspace_id=workspace_id)
    _echo_json({"scope": scope, "workspace_id": workspace_id, "invalidated": deleted})


@cache.command(name="purge")
@_errors_to_exit
def cache_purge() -> None:
    """Delete every expired entry (expired ones are never served; this frees their rows)."""
    from onceflow.cache import purge

    _echo_json({"purged": purge()})
