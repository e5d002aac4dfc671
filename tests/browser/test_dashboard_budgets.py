"""The dashboard's Budgets panel in real headless Chromium (Debian's, driven by Playwright).

A real `onceflow api` on Postgres: budgets set and spend written through the ledger's own
hooks (settled calls and a call in flight). The panel shows each budget's limit, spend,
reservations and share used, fullest first, marks the budgets past 80 % and past their
limit, reads the ledger again with the spend panel (every 30 s: the page's clock is
advanced, not waited for), and says "unavailable" when the budgets cannot be read.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine

from onceflow.spend import Grant, LedgerHooks, Usage, set_budget
from tests.browser.conftest import VIEWER_KEY, artifacts_dir
from tests.browser.test_dashboard_page import DEADLINE_MS, enter_key, numbers, shows

pytestmark = pytest.mark.slow

ROWS = """els => els.map(tr => ({
    budget: tr.dataset.budget, mark: tr.dataset.mark,
    cells: [...tr.querySelectorAll("td")].map(td => td.textContent),
    bar: [...tr.querySelectorAll(".bar span")].map(s => s.style.width)}))"""


def spend(hooks: LedgerHooks, ws: str, tokens: tuple[int, int], cost: str) -> None:
    """One call of ``ws`` admitted (estimated at 100 tokens, 0.1) and settled at what it
    used: ``tokens`` (input, output) for ``cost`` (a call may use more than its estimate)."""
    g = Grant(workspace_id=ws, provider="openai", estimate_tokens=100,
              estimate_cost=Decimal("0.1"), stage="summarize")  # fmt: skip
    hooks.admit(g)
    hooks.settle(g, Usage(*tokens), "ok", "openai", "gpt-x", Decimal(cost))


def test_budgets_panel_in_chromium(
    browser: Any, dashboard_api: tuple[str, Any], clean_db: Engine
) -> None:
    url, _ = dashboard_api
    set_budget("dash-b1", "month", limit_cost="2", allow_new=True, database=clean_db)
    set_budget("dash-b1", "day", limit_tokens=500, database=clean_db)
    set_budget("dash-b2", "day", limit_cost="10", limit_tokens=1000, on_exceeded="wait",
               allow_new=True, database=clean_db)  # fmt: skip
    set_budget("dash-b3", "month", limit_cost="5", allow_new=True, database=clean_db)
    hooks = LedgerHooks(clean_db)
    flying = Grant(workspace_id="dash-b1", provider="openai", estimate_tokens=100,
                   estimate_cost=Decimal("0.1"))  # fmt: skip
    hooks.admit(flying)  # in flight: holds 100 tokens and 0.1
    spend(hooks, "dash-b1", (400, 200), "1.7")  # 85 % of 2 (month), 120 % of 500 tokens (day)
    spend(hooks, "dash-b2", (200, 100), "0.3")  # 30 % of the tokens, 3 % of the money

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.clock.install()
    page.goto(url + "/dashboard")
    page.wait_for_selector("body[data-state=no-key]", timeout=DEADLINE_MS)
    enter_key(page, VIEWER_KEY)
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)
    page.wait_for_function(
        "() => document.querySelectorAll('#budgets tbody tr').length === 4", timeout=DEADLINE_MS
    )
    rows = page.eval_on_selector_all("#budgets tbody tr", ROWS)

    # Fullest first; the marks follow the share used.
    assert [(r["budget"], r["mark"]) for r in rows] == [
        ("dash-b1/day", "exceeded"),
        ("dash-b1/month", "near"),
        ("dash-b2/day", ""),
        ("dash-b3/month", ""),
    ]
    shown = numbers(page)
    assert {k: v for k, v in shown.items() if k.startswith("budget/")} == {
        "budget/dash-b1/day/limit": "500 tokens",
        "budget/dash-b1/day/spent": "600 tokens",
        "budget/dash-b1/day/reserved": "100 tokens (1 call)",
        "budget/dash-b1/day/used": "120.0 % + 20.0 % in flight",
        "budget/dash-b1/month/limit": "2",
        "budget/dash-b1/month/spent": "1.7",
        "budget/dash-b1/month/reserved": "0.1 (1 call)",
        "budget/dash-b1/month/used": "85.0 % + 5.0 % in flight",
        "budget/dash-b2/day/limit": "10 · 1000 tokens",
        "budget/dash-b2/day/spent": "0.3 · 300 tokens",
        "budget/dash-b2/day/reserved": "none",
        "budget/dash-b2/day/used": "30.0 % of tokens",
        "budget/dash-b3/month/limit": "5",
        "budget/dash-b3/month/spent": "0",
        "budget/dash-b3/month/reserved": "none",
        "budget/dash-b3/month/used": "0.0 %",
    }
    status = {r["budget"]: r["cells"][6:8] for r in rows}
    assert status == {
        "dash-b1/day": ["exceeded", "fail"],
        "dash-b1/month": ["over 80 %", "fail"],
        "dash-b2/day": ["ok", "wait"],
        "dash-b3/month": ["ok", "fail"],
    }
    # The period's end: the next UTC day or month, with the time left.
    ends = {r["budget"]: r["cells"][8] for r in rows}
    for budget, end in ends.items():
        assert "T00:00:00+00:00 (in " in end, (budget, end)
        if budget.endswith("/month"):
            assert end[8:10] == "01", end
    # The bar: the spent part clamped at 100 %, the part in flight beside it.
    bars = {r["budget"]: r["bar"] for r in rows}
    assert bars == {
        "dash-b1/day": ["100%", "0%"],
        "dash-b1/month": ["85%", "5%"],
        "dash-b2/day": ["30%", "0%"],
        "dash-b3/month": ["0%", "0%"],
    }
    assert page.inner_text("#budgets-note") == "4 budget(s); 1 exceeded, 1 over 80 %"
    assert page.is_visible("#budgets tr.exceeded .bar .spent")
    page.locator("#budgets").screenshot(path=str(artifacts_dir() / "dashboard-budgets.png"))

    # Read again with the spend panel, 30 s later: the call in flight settled, dash-b2 spent.
    hooks.settle(flying, Usage(50, 50), "ok", "openai", "gpt-x", Decimal("0.1"))
    spend(hooks, "dash-b2", (400, 200), "0.5")  # 900 of 1000 tokens
    page.clock.fast_forward(30_000)
    shows(page, {
        "budget/dash-b1/month/used": "90.0 %",
        "budget/dash-b1/month/reserved": "none",
        "budget/dash-b2/day/used": "90.0 % of tokens",
        "budget/dash-b2/day/spent": "0.8 · 900 tokens",
    })  # fmt: skip
    assert page.inner_text("#budgets-note") == "4 budget(s); 1 exceeded, 2 over 80 %"

    # The budgets cannot be read: the panel says so and shows no stale standing.
    def down(route: Any) -> None:
        route.fulfill(status=503, content_type="application/json",
                      body='{"detail": "database not answering"}')  # fmt: skip

    page.route("**/dashboard/api/spend/budgets", down)
    page.clock.fast_forward(30_000)
    page.wait_for_function(
        "() => document.querySelector('#budgets-note').textContent"
        " === 'unavailable: database not answering'",
        timeout=DEADLINE_MS,
    )
    assert page.eval_on_selector_all("#budgets tbody tr", "t => t.length") == 0
    context.close()
