"""The dashboard's layout in real headless Chromium at 1280, 1440 and 1920 wide and on a
phone (390 x 844): after a real drain (a worker, Postgres, Redis, an `onceflow api`), no two
visible text elements overlap on the overview, the request list and a request's page, and
the page never spills sideways (wide tables scroll inside their panel). A screenshot of each
goes under the test's tmp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.demo.procs import wait_for
from tests.browser.conftest import VIEWER_KEY
from tests.browser.layout import check_layout
from tests.browser.stages import RELEASE
from tests.browser.test_dashboard_api import drained, idle_rows, status_of
from tests.browser.test_dashboard_page import DEADLINE_MS, enter_key

pytestmark = pytest.mark.slow

SIZES = {
    "1280": {"viewport": {"width": 1280, "height": 900}},
    "1440": {"viewport": {"width": 1440, "height": 900}},
    "1920": {"viewport": {"width": 1920, "height": 1080}},
    "phone": {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True,
              "device_scale_factor": 2},
}  # fmt: skip

OLD_LAYOUT = """() => {
  const sheet = document.styleSheets[0];
  for (const rule of [".grid { grid-template-columns: repeat(4, 12rem) !important; }",
                      ".panel.wide { grid-column: auto !important; }",
                      ".scroll { overflow: visible !important; }"]) {
    sheet.insertRule(rule, sheet.cssRules.length);
  }
}"""


def test_no_text_overlaps_at_any_width(
    browser: Any,
    dashboard_api: tuple[str, Any],
    dashboard_worker: Any,
    dash: Any,
    engine: Engine,
    redis_url: str,
    tmp_path: Path,
) -> None:
    url, _ = dashboard_api
    # Before anything is counted the headline says so, in words.
    context = browser.new_context(**SIZES["1280"])
    page = context.new_page()
    page.goto(url + "/dashboard")
    enter_key(page, VIEWER_KEY)
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)
    assert page.is_visible("#savings-empty")
    assert page.inner_text("#savings-note") == "nothing counted yet"
    assert page.is_hidden("#savings")  # no empty per-workspace table
    context.close()

    # Enough of everything that every panel has rows: queued and scheduled rows of a class
    # nobody serves, finished cells, a dead request with a long error, one still running.
    idle_rows(engine, due=2, later=1)
    held = dash.flow.enqueue("hold", "dash-ws1", "jh", "", {}).request_id
    cell_id = ""
    for branch in ("a", "b", "c"):
        cell_id = dash.flow.enqueue("cell", "dash-ws1", "j1", branch, {"value": 5}).request_id
    dead_id = dash.flow.enqueue("flaky", "dash-ws1", "a-rather-long-job-id-" + "x" * 40, "",
                                {}).request_id  # fmt: skip
    wait_for(lambda: drained(engine) and status_of(engine, held) == "running", what="a drain")
    try:
        problems = look_at_every_width(browser, url, dead_id, cell_id, tmp_path)
    finally:  # the held run returns: its pool child is free for the next test
        redis_lib.Redis.from_url(redis_url).rpush(RELEASE + "jh", 1)
    assert {k: v for k, v in problems.items() if v} == {}
    for shot in tmp_path.glob("*.png"):
        assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 1000
    wait_for(lambda: status_of(engine, held) == "succeeded", what="the held run to return")


def look_at_every_width(
    browser: Any, url: str, dead_id: str, cell_id: str, tmp_path: Path
) -> dict[str, list[tuple[str, str]]]:
    """Each view at each size: its screenshot, and the overlaps :func:`check_layout` finds."""

    problems: dict[str, list[tuple[str, str]]] = {}
    for size, options in SIZES.items():
        width = options["viewport"]["width"]
        context = browser.new_context(**options)
        page = context.new_page()
        # A script error or a refusal by the page's CSP (an inline style, a foreign source)
        # is reported as a problem too.
        page.on("pageerror", lambda exc, size=size: problems.setdefault(
            f"errors-{size}", []).append(("script error", str(exc))))  # fmt: skip
        page.on("console", lambda msg, size=size: problems.setdefault(
            f"errors-{size}", []).append(("console", msg.text))
            if msg.type == "error" else None)  # fmt: skip
        page.goto(url + "/dashboard")
        enter_key(page, VIEWER_KEY)
        page.wait_for_selector(f'#dead tr[data-request-id="{dead_id}"]', timeout=DEADLINE_MS)
        page.wait_for_function(
            "() => document.querySelectorAll('#results tbody tr').length === 8"
            " && document.querySelector('#charts').dataset.range === 'hour'",
            timeout=DEADLINE_MS,
        )
        # The headline is never a bare "0 workspace(s)": totals, and what they cover.
        assert page.inner_text('[data-k="savings/total/asked"]') == "3"
        assert page.inner_text('[data-k="savings/total/saved"]') == "2"
        assert "workspace(s)" not in page.inner_text("#headline")
        page.screenshot(path=str(tmp_path / f"overview-{size}.png"), full_page=True)
        problems[f"overview-{size}"] = check_layout(page, width)
        if size == "1280":
            # The check sees what it is for: panels side by side in columns as wide as their
            # content would let them be, tables not scrolling (the page's old layout), make
            # the depth table run into the panel beside it.
            page.evaluate(OLD_LAYOUT)
            assert check_layout(page, width), "the old layout's overlaps were not seen"
            page.reload()
            page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)

        page.goto(f"{url}/dashboard#/requests?status=dead")
        # The dead-filtered list itself, not the list the overview showed before it.
        page.wait_for_function(
            "id => { const rows = [...document.querySelectorAll('#results tbody tr')];"
            " return document.body.dataset.view === 'requests'"
            " && rows.some(tr => tr.dataset.requestId === id)"
            " && rows.every(tr => tr.querySelector('td.status')?.textContent === 'dead')"
            " && /^\\d+ shown/.test(document.querySelector('#search-note').textContent); }",
            arg=dead_id,
            timeout=DEADLINE_MS,
        )
        page.screenshot(path=str(tmp_path / f"requests-{size}.png"), full_page=True)
        problems[f"requests-{size}"] = check_layout(page, width)

        page.goto(f"{url}/dashboard#/requests/{dead_id}?ws=dash-ws1")
        page.wait_for_function(
            "() => document.body.dataset.request === 'shown'", timeout=DEADLINE_MS
        )
        page.screenshot(path=str(tmp_path / f"request-{size}.png"), full_page=True)
        problems[f"request-{size}"] = check_layout(page, width)
        # A cell's page: its op with its clock and its compute lock.
        page.goto(f"{url}/dashboard#/requests/{cell_id}?ws=dash-ws1")
        page.wait_for_function(
            "id => document.body.dataset.request === 'shown'"
            " && document.querySelector('#view-request').dataset.requestId === id",
            arg=cell_id,
            timeout=DEADLINE_MS,
        )
        assert page.eval_on_selector_all("#req-ops tbody tr", "t => t.length") == 1
        problems[f"cell-{size}"] = check_layout(page, width)
        context.close()
    return problems
