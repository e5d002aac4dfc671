"""Spend control from the command line: ``onceflow spend`` and ``onceflow budget``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from onceflow.cli.base import _echo_json, _errors_to_exit, main
from onceflow.errors import InvalidRequest

_PERIOD = click.Choice(["day", "month"])


def _when(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"--{name} must be an ISO 8601 time, got {value!r}") from None
    if when.tzinfo is None:
        raise InvalidRequest(f"--{name} needs a time zone (e.g. {value}+00:00 or {value}Z)")
    return when


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    shown = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in shown)]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in shown:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


@main.command(name="spend")
@click.option("--workspace", "workspace_id", default=None, help="One workspace only.")
@click.option("--provider", default=None, help="One provider only.")
@click.option(
    "--since", default=None, help="From this time on (ISO 8601 with a time zone; inclusive)."
)
@click.option("--until", default=None, help="Before this time (ISO 8601 with a time zone).")
@click.option(
    "--by",
    default="workspace,stage,provider",
    show_default=True,
    help="Comma-separated groups: workspace, stage, provider, model, outcome (empty: a total).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_errors_to_exit
def spend_(
    workspace_id: str | None,
    provider: str | None,
    since: str | None,
    until: str | None,
    by: str,
    as_json: bool,
) -> None:
    """Show settled provider spend from the ledger: calls, tokens and cost per group."""
    from onceflow.spend import spend

    groups = [g.strip() for g in by.split(",") if g.strip()]
    report = spend(
        workspace_id=workspace_id,
        provider=provider,
        since=_when("since", since),
        until=_when("until", until),
        by=groups,
    )
    if as_json:
        _echo_json(report)
        return
    _table(report["rows"], [*groups, "calls", "input_tokens", "output_tokens", "cost"])
    total = report["total"]
    click.echo(
        f"total: {total['calls']} calls, {total['input_tokens']} input and "
        f"{total['output_tokens']} output tokens, cost {total['cost']}"
        + (" (the costliest groups only)" if report["truncated"] else "")
    )


@main.group(name="budget")
def budget() -> None:
    """Set, show and clear workspaces' spend budgets (per UTC day or month)."""


@budget.command(name="set")
@click.argument("workspace_id")
@click.option("--period", type=_PERIOD, required=True, help="The budget's period (UTC).")
@click.option("--cost", default=None, help="The limit in money (the providers' price currency).")
@click.option("--tokens", type=int, default=None, help="The limit in tokens (input + output).")
@click.option(
    "--on-exceeded",
    type=click.Choice(["fail", "wait"]),
    default="fail",
    show_default=True,
    help="A refused call fails its stage at once, or retries it when the next period starts.",
)
@click.option(
    "--new",
    "allow_new",
    is_flag=True,
    help="Allow a workspace with no request, sub-doc or spend yet (else refused as unknown).",
)
@_errors_to_exit
def budget_set(
    workspace_id: str,
    period: str,
    cost: str | None,
    tokens: int | None,
    on_exceeded: str,
    allow_new: bool,
) -> None:
    """Set (or replace) a workspace's budget for a period; print it as JSON."""
    from onceflow.spend import set_budget

    made = set_budget(
        workspace_id,
        period,
        limit_cost=cost,
        limit_tokens=tokens,
        on_exceeded=on_exceeded,
        allow_new=allow_new,
    )
    _echo_json(made.as_dict())


@budget.command(name="show")
@click.argument("workspace_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_errors_to_exit
def budget_show(workspace_id: str | None, as_json: bool) -> None:
    """Show budgets (of one workspace, or all) with their current period's spend."""
    from onceflow.spend import budgets

    found = [b.as_dict() for b in budgets(workspace_id)]
    if as_json:
        _echo_json({"budgets": found})
        return
    columns = [
        "workspace_id", "period", "limit_cost", "limit_tokens", "on_exceeded",
        "spent_cost", "spent_tokens", "reserved_cost", "reserved_tokens", "in_flight",
        "period_ends",
    ]  # fmt: skip
    _table(found, columns)


@budget.command(name="clear")
@click.argument("workspace_id")
@click.option("--period", type=_PERIOD, default=None, help="One period only (default: both).")
@_errors_to_exit
def budget_clear(workspace_id: str, period: str | None) -> None:
    """Remove a workspace's budget (both periods unless --period); print what was removed."""
    from onceflow.spend import clear_budget

    _echo_json({"workspace_id": workspace_id, "cleared": clear_budget(workspace_id, period)})
