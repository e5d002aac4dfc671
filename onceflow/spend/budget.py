"""Budgets per workspace and period: set, read, cleared, and checked when a call is admitted.

A budget limits what a workspace spends in a UTC calendar ``day`` or ``month``, in money
(``limit_cost``, in the providers' price currency), in tokens (``limit_tokens``, input plus
output), or both. A call is admitted only if what the period has spent, plus the estimates
of the workspace's calls in flight, plus its own estimate, stays within every limit: so a
budget is never overrun by more than what the calls in flight use beyond their estimates.
``on_exceeded`` says what a refused call does: ``fail`` (the stage fails at once) or
``wait`` (the stage is retried when the next period starts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from onceflow.db import fetch_all, fetch_one, raw_connection, retry_disconnect
from onceflow.errors import BudgetBusy, BudgetExceeded, InvalidRequest, UnknownWorkspace
from onceflow.ids import check_id
from onceflow.models.spend import ON_EXCEEDED, PERIODS
from onceflow.spend import sql
from onceflow.spend.databases import Database, Databases, as_databases

#: The most budgets one read returns.
BUDGETS_LIMIT = 1000


def check_amount(name: str, value: object) -> Decimal:
    """``value`` as a finite, non-negative :class:`~decimal.Decimal`, else InvalidRequest."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | str):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    try:
        amount = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except ArithmeticError:
        raise InvalidRequest(f"{name} must be a number, got {value!r}") from None
    if not amount.is_finite():
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    if amount < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value!r}")
    return amount


def check_tokens(name: str, value: object) -> int:
    """``value`` as a non-negative int (a bool refused), else InvalidRequest."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value}")
    if value >= 2**63:
        raise InvalidRequest(f"{name} is too large: {value}")
    return value


def check_period(value: object) -> str:
    if value not in PERIODS:
        raise InvalidRequest(f"period must be one of {', '.join(PERIODS)}, got {value!r}")
    return str(value)


def check_on_exceeded(value: object) -> str:
    if value not in ON_EXCEEDED:
        raise InvalidRequest(f"on_exceeded must be one of {', '.join(ON_EXCEEDED)}, got {value!r}")
    return str(value)


@dataclass(frozen=True, slots=True)
class Budget:
    """A workspace's budget for one period, with its current period's standing.

    ``spent_*``: settled in the current period; ``reserved_*``: held by ``in_flight`` calls
    admitted and not settled. ``period_ends`` is the next period's start (UTC),
    ``period_ends_in`` seconds after the read (database clock).
    """

    workspace_id: str
    period: str
    limit_cost: Decimal | None
    limit_tokens: int | None
    on_exceeded: str
    updated_at: datetime | None = None
    period_starts: datetime | None = None
    period_ends: datetime | None = None
    period_ends_in: float | None = None
    spent_cost: Decimal = Decimal(0)
    spent_tokens: int = 0
    reserved_cost: Decimal = Decimal(0)
    reserved_tokens: int = 0
    in_flight: int = 0
    #: Seconds until the first reservation of a call in flight expires (None: none held).
    next_expiry_in: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: money as decimal strings, times in ISO 8601."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            if name == "next_expiry_in":  # a hint for admit, not the budget's standing
                continue
            value = getattr(self, name)
            if isinstance(value, Decimal):
                value = str(value)
            elif isinstance(value, datetime):
                value = value.isoformat()
            out[name] = value
        return out


def budget_of_row(row: dict[str, Any]) -> Budget:
    """A :class:`Budget` from a row of the budgets read."""

    def tokens(value: Any) -> int | None:
        return None if value is None else int(value)

    return Budget(
        workspace_id=row["workspace_id"],
        period=row["period"],
        limit_cost=row["limit_cost"],
        limit_tokens=tokens(row["limit_tokens"]),
        on_exceeded=row["on_exceeded"],
        updated_at=row.get("updated_at"),
        period_starts=row.get("starts"),
        period_ends=row.get("ends"),
        period_ends_in=row.get("ends_in"),
        spent_cost=row.get("spent_cost") or Decimal(0),
        spent_tokens=int(row.get("spent_tokens") or 0),
        reserved_cost=row.get("reserved_cost") or Decimal(0),
        reserved_tokens=int(row.get("reserved_tokens") or 0),
        in_flight=int(row.get("in_flight") or 0),
        next_expiry_in=row.get("next_expiry_in"),
    )


# Keyword options alike only by shape to Provider's: the public signature, spelled out.
def set_budget(
    workspace_id: str,
    period: str,
    *,
    limit_cost: object = None,
    limit_tokens: object = None,
    on_exceeded: str = "fail",
    allow_new: bool = False,
    database: Database | Databases = None,
) -> Budget:
    """Set (or replace) ``workspace_id``'s budget for ``period`` (``day`` or ``month``).

    At least one of ``limit_cost`` (money, finite, >= 0) and ``limit_tokens`` (int, >= 0).
    A workspace the database has no trace of (no request, sub-doc, spend or budget) raises
    :class:`~onceflow.errors.UnknownWorkspace` unless ``allow_new``. Bad input raises
    :class:`~onceflow.errors.InvalidRequest`; nothing is written.
    """
    ws = check_id("workspace_id", workspace_id)
    params = {
        "ws": ws,
        "period": check_period(period),
        "limit_cost": None if limit_cost is None else check_amount("limit_cost", limit_cost),
        "limit_tokens": (
            None if limit_tokens is None else check_tokens("limit_tokens", limit_tokens)
        ),
        "on_exceeded": check_on_exceeded(on_exceeded),
        "allow_new": bool(allow_new),
    }
    if params["limit_cost"] is None and params["limit_tokens"] is None:
        raise InvalidRequest("a budget needs limit_cost, limit_tokens, or both")
    engine = as_databases(database).of(ws)

    def write() -> Any:
        with raw_connection(engine) as conn:
            return fetch_one(conn, sql.SET_BUDGET, params)

    row = retry_disconnect(write)
    if row is None:
        raise UnknownWorkspace(ws)
    return budget_of_row(row)


def clear_budget(
    workspace_id: str, period: str | None = None, *, database: Database | Databases = None
) -> list[str]:
    """Remove ``workspace_id``'s budget for ``period`` (None: every period); the periods
    removed (none: there was no such budget)."""
    ws = check_id("workspace_id", workspace_id)
    params = {"ws": ws, "period": None if period is None else check_period(period)}
    engine = as_databases(database).of(ws)

    def write() -> list[Any]:
        with raw_connection(engine) as conn:
            return fetch_all(conn, sql.CLEAR_BUDGET, params)

    return sorted(r["period"] for r in retry_disconnect(write))


def budgets(
    workspace_id: str | None = None, *, database: Database | Databases = None
) -> list[Budget]:
    """Budgets (of one workspace, or all, up to :data:`BUDGETS_LIMIT`) with their current
    period's spend and reservations."""
    ws = None if workspace_id is None else check_id("workspace_id", workspace_id)
    dbs = as_databases(database)
    params = {"ws": ws, "limit": BUDGETS_LIMIT, "permit_id": None}

    def read(engine: Any) -> list[Any]:
        def once() -> list[Any]:
            with raw_connection(engine) as conn:
                return fetch_all(conn, sql.BUDGETS, params)

        return retry_disconnect(once)

    if ws is not None:
        rows = read(dbs.of(ws))
    else:
        answers, _ = dbs.each(read)
        rows = [r for rows in answers for r in rows]
    return [budget_of_row(r) for r in rows][:BUDGETS_LIMIT]


#: How long a permit refused only by the reservations of calls in flight waits before it
#: asks its budget again (ms), unless a reservation expires sooner.
BUSY_POLL_MS = 200
#: The shortest such wait (ms): an expiry a few ms away is not asked about in a busy loop.
BUSY_MIN_MS = 10


def over(held: int | Decimal, need: int | Decimal, limit: int | Decimal) -> bool:
    """Whether ``need`` does not fit under ``limit`` beside ``held``. A call with no
    estimate (0) does not fit once ``held`` has reached the limit: its usage is unknown."""
    return held + need > limit or (not need and held >= limit)


def refusal(
    budget: Budget, tokens: int, cost: Decimal | None
) -> BudgetExceeded | BudgetBusy | None:
    """Why ``budget`` refuses a call of ``tokens`` / ``cost`` estimated, or None when it fits.

    :class:`~onceflow.errors.BudgetExceeded` when the period's spend plus the estimate is
    over a limit: no call in flight settling can make room. :class:`~onceflow.errors.BudgetBusy`
    when the spend plus the estimate fits and only the reservations of the calls in flight
    make it not fit: room comes back as they settle (below their estimates) or their
    reservations expire. With no estimate of cost, a money budget refuses once the spend
    (or the spend and reservations: busy) has reached its limit.
    """
    need = cost or Decimal(0)
    spent: list[str] = []
    held: list[str] = []
    if budget.limit_tokens is not None:
        limit = budget.limit_tokens
        in_flight = budget.spent_tokens + budget.reserved_tokens
        if over(budget.spent_tokens, tokens, limit):
            spent.append(f"{budget.spent_tokens} tokens spent + {tokens} estimated > limit {limit}")
        elif over(in_flight, tokens, limit):
            held.append(
                f"{budget.spent_tokens} tokens spent + {budget.reserved_tokens} in flight + "
                f"{tokens} estimated > limit {limit}"
            )
    if budget.limit_cost is not None:
        limit_cost = budget.limit_cost
        in_flight_cost = budget.spent_cost + budget.reserved_cost
        if over(budget.spent_cost, need, limit_cost):
            spent.append(f"{budget.spent_cost} spent + {need} estimated > limit {limit_cost}")
        elif over(in_flight_cost, need, limit_cost):
            held.append(
                f"{budget.spent_cost} spent + {budget.reserved_cost} in flight + {need} "
                f"estimated > limit {limit_cost}"
            )
    if spent:
        return exceeded(budget, tokens, need, "; ".join(spent))
    if held:
        return BudgetBusy(budget.workspace_id, budget.period, "; ".join(held), busy_wait(budget))
    return None


def busy_wait(budget: Budget) -> float:
    """Seconds worth waiting before a busy budget is asked again: :data:`BUSY_POLL_MS`, or
    less when a reservation expires sooner (its call is then charged its estimate)."""
    wait_ms = float(BUSY_POLL_MS)
    expiry = budget.next_expiry_in
    if expiry is not None and math.isfinite(expiry):
        wait_ms = min(wait_ms, max(float(BUSY_MIN_MS), expiry * 1000))
    return wait_ms / 1000


def exceeded(budget: Budget, tokens: int, need: Decimal, detail: str) -> BudgetExceeded:
    """The :class:`~onceflow.errors.BudgetExceeded` of ``budget`` for a call of ``tokens``
    / ``need`` that its period's spend leaves no room for."""
    # When the next period starts: the stage may wait for it (its own on_budget, or the
    # budget's). None when the call could not fit even an empty period: no wait helps.
    fits_a_period = (budget.limit_tokens is None or tokens <= budget.limit_tokens) and (
        budget.limit_cost is None or need <= budget.limit_cost
    )
    turns = budget.period_ends if fits_a_period else None
    return BudgetExceeded(
        budget.workspace_id,
        budget.period,
        detail,
        on_exceeded=budget.on_exceeded,
        retry_at=None if turns is None else turns.isoformat(),
        retry_in=None if turns is None else budget.period_ends_in,
    )


__all__ = [
    "BUDGETS_LIMIT",
    "BUSY_MIN_MS",
    "BUSY_POLL_MS",
    "Budget",
    "budget_of_row",
    "budgets",
    "busy_wait",
    "check_amount",
    "check_on_exceeded",
    "check_period",
    "check_tokens",
    "clear_budget",
    "exceeded",
    "over",
    "refusal",
    "set_budget",
]
