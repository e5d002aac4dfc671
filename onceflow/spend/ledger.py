"""The cost ledger: :class:`LedgerHooks`, the :class:`~onceflow.spend.hooks.SpendHooks` that
records every settled call in Postgres and holds workspaces to their budgets.

- ``admit``: in one transaction on the workspace's database, the workspace's budget rows
  are locked (``FOR UPDATE``: two processes admitting at once take turns, so only one of
  them can take the last unit of a budget), expired reservations become ``abandoned`` ledger
  rows charged their estimate, every budget is checked against the period's spend plus
  the reservations of calls in flight plus this call's estimate, and the estimate is
  reserved until ``reservation_ttl`` seconds from now (database clock). Refused, nothing
  reserved: :class:`~onceflow.errors.BudgetExceeded` when the period's spend plus the
  estimate is over a limit; :class:`~onceflow.errors.BudgetBusy` when only the reservations
  of calls in flight make it so (a permit then waits and asks again: those calls usually
  settle below their estimates, or their reservations expire).
- ``settle``: one statement clears the reservation and writes the ledger row, keyed by the
  permit: a settle repeated after a lost reply (a Postgres blip) writes nothing twice.
  Postgres unavailable: retried for up to ``settle_retry_seconds``, so a restart does not
  lose the row. With a claim token the row is written in the statement that checks the
  claim's fence (the request's row locked ``FOR SHARE``, token and live lease on the
  database clock): ``fenced`` true. A lost lease does not drop the row — the call was paid
  for — it is kept with ``fenced`` false.
- ``release``: the reservation is removed; no ledger row (no call was made).

Outcomes: the hooks' ``ok``, ``rate_limited``, ``error`` and ``unsettled`` are recorded as
``ok``, ``rate_limited``, ``failed`` and ``abandoned`` (the ledger's names, and
``cache_hit``, are taken as they are). A settle without usage (``failed``, ``rate_limited``)
records no tokens and the cost given (None: unknown); an ``abandoned`` one without usage is
charged the permit's estimate: the call may have been made and paid for.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime
from decimal import Decimal
from typing import Any

from onceflow.db import execute, fetch_all, fetch_one, raw_connection, retry_disconnect
from onceflow.errors import BudgetBusy, BudgetExceeded, DatabaseUnavailable, InvalidRequest
from onceflow.ids import check_id
from onceflow.metrics import record as metrics
from onceflow.spend import sql
from onceflow.spend.budget import BUDGETS_LIMIT, budget_of_row, check_amount, check_tokens, refusal
from onceflow.spend.databases import Database, Databases, as_databases
from onceflow.spend.hooks import Grant
from onceflow.spend.usage import Usage

log = logging.getLogger("onceflow.spend")

#: How long an admitted call's reservation holds its estimate without a settle (seconds).
RESERVATION_TTL = 600.0
#: How long a settle keeps trying while Postgres does not answer (seconds).
SETTLE_RETRY_SECONDS = 30.0


#: A settle's outcome (:mod:`onceflow.spend.hooks`) as the ledger records it; the ledger's
#: own names are taken as they are.
LEDGER_OUTCOME_OF = {
    "ok": "ok",
    "rate_limited": "rate_limited",
    "error": "failed",
    "failed": "failed",
    "unsettled": "abandoned",
    "abandoned": "abandoned",
    "cache_hit": "cache_hit",
}


def _optional_id(name: str, value: object) -> str | None:
    return None if value is None else check_id(name, value)


def check_grant(grant: Grant) -> dict[str, Any]:
    """The grant as statement parameters; InvalidRequest for a field that cannot be stored."""
    if not isinstance(grant, Grant):
        raise InvalidRequest(f"grant must be a Grant, got {type(grant).__name__}")
    return {
        "ws": check_id("workspace_id", grant.workspace_id),
        "permit_id": check_id("permit_id", grant.permit_id),
        "provider": check_id("provider", grant.provider),
        "stage": _optional_id("stage", grant.stage),
        "request_id": _optional_id("request_id", grant.request_id),
        "cell_key": None
        if grant.cell_key is None
        else check_id("cell_key", grant.cell_key, max_len=1000),
        "claim_token": _optional_id("claim_token", grant.claim_token),
        "tokens": check_tokens("estimate_tokens", grant.estimate_tokens),
        "cost": (
            None
            if grant.estimate_cost is None
            else check_amount("estimate_cost", grant.estimate_cost)
        ),
    }


class LedgerHooks:
    """Budgets enforced at admit, every settled call a ledger row (see the module).

    ``database``: a URL, an engine, a shard map, or None (the settings); on a database
    split by workspace each workspace's rows go to its shard.
    """

    def __init__(
        self,
        database: Database | Databases = None,
        *,
        reservation_ttl: float = RESERVATION_TTL,
        settle_retry_seconds: float = SETTLE_RETRY_SECONDS,
    ) -> None:
        for name, value in (
            ("reservation_ttl", reservation_ttl),
            ("settle_retry_seconds", settle_retry_seconds),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
                or (name == "reservation_ttl" and value == 0)
            ):
                raise InvalidRequest(f"{name} must be a positive number of seconds, not {value!r}")
        self._databases = as_databases(database)
        self.reservation_ttl = float(reservation_ttl)
        self.settle_retry_seconds = float(settle_retry_seconds)

    # ------------------------------------------------------------------ admit

    def admit(self, grant: Grant) -> None:
        """Check the workspace's budgets and reserve the estimate. Nothing is reserved when
        a budget refuses: BudgetExceeded when the period's spend leaves no room for the
        estimate, else BudgetBusy when only the reservations of calls in flight do (the
        permit waits and asks again)."""
        params = check_grant(grant)
        params["ttl"] = self.reservation_ttl
        engine = self._databases.of(params["ws"])

        def once() -> BudgetExceeded | BudgetBusy | None:
            with raw_connection(engine) as conn, conn.transaction():
                locked = fetch_all(conn, sql.LOCK_BUDGETS, params)
                execute(conn, sql.REAP, params)
                if locked:
                    rows = fetch_all(conn, sql.BUDGETS, {**params, "limit": BUDGETS_LIMIT})
                    refused = [
                        r
                        for row in rows
                        if (r := refusal(budget_of_row(row), params["tokens"], params["cost"]))
                    ]
                    # Nothing reserved; the expired reservations charged above stay charged
                    # (committed), so the spend read sees what the refusal counted.
                    if refused:  # no room for good decides over room held in flight
                        return min(refused, key=lambda r: isinstance(r, BudgetBusy))
                execute(conn, sql.RESERVE, params)
            return None

        refused = retry_disconnect(once)
        if refused is not None:
            raise refused

    # ------------------------------------------------------------------ settle

    # SpendHooks.settle's signature (alike by shape): the protocol method, spelled out.
    def settle(
        self,
        grant: Grant,
        usage: Usage | None,
        outcome: str,
        provider: str,
        model: str | None,
        cost: Decimal | None,
        started_at: datetime | None = None,
        ended_at: datetime | None = None,
    ) -> None:
        """Write the call's ledger row and clear its reservation (idempotent by permit)."""
        params = check_grant(grant)
        recorded = LEDGER_OUTCOME_OF.get(outcome) if isinstance(outcome, str) else None
        if recorded is None:
            raise InvalidRequest(
                f"outcome must be one of {', '.join(LEDGER_OUTCOME_OF)}, got {outcome!r}"
            )
        outcome = recorded
        if usage is not None and not isinstance(usage, Usage):
            raise InvalidRequest(f"usage must be a Usage or None, got {type(usage).__name__}")
        for name, when in (("started_at", started_at), ("ended_at", ended_at)):
            if when is not None and (not isinstance(when, datetime) or when.tzinfo is None):
                raise InvalidRequest(f"{name} must be a datetime with a time zone, or None")
        amount = None if cost is None else check_amount("cost", cost)
        if usage is not None:
            tokens_in, tokens_out = usage.input_tokens, usage.output_tokens
        elif outcome == "abandoned":  # the call may have been paid for: charged its estimate
            tokens_in, tokens_out = params["tokens"], 0
            amount = params["cost"] if amount is None else amount
        else:
            tokens_in = tokens_out = 0
        params.update(
            provider=check_id("provider", provider),
            model=_optional_id("model", model),
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            cost=amount,
            outcome=outcome,
            started_at=started_at,
            ended_at=ended_at,
        )
        written = self._settle_retrying(params)
        if written and usage is not None:
            metrics.provider_spend(params["provider"], tokens_in, tokens_out, amount)

    def _settle_retrying(self, params: dict[str, Any]) -> bool:
        """Run SETTLE until it answers or ``settle_retry_seconds`` have passed; whether this
        call wrote the row (False: an earlier attempt or settle had)."""
        engine = self._databases.of(params["ws"])

        def once() -> bool:
            with raw_connection(engine) as conn:
                return fetch_one(conn, sql.SETTLE, params) is not None

        deadline = time.monotonic() + self.settle_retry_seconds
        pause = 0.05
        while True:
            try:
                return retry_disconnect(once)
            except DatabaseUnavailable as exc:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("settle of permit %s: %s; retrying", params["permit_id"], exc)
            time.sleep(pause)
            pause = min(pause * 2, 2.0)

    # ------------------------------------------------------------------ release

    def release(self, grant: Grant) -> None:
        """Give the permit's reservation back (no call was made; no ledger row)."""
        params = check_grant(grant)
        engine = self._databases.of(params["ws"])

        def once() -> None:
            with raw_connection(engine) as conn:
                execute(conn, sql.RELEASE, params)

        retry_disconnect(once)


__all__ = [
    "LEDGER_OUTCOME_OF",
    "RESERVATION_TTL",
    "SETTLE_RETRY_SECONDS",
    "LedgerHooks",
    "check_grant",
]
