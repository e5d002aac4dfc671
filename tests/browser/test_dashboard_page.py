"""The dashboard end to end in real headless Chromium (Debian's, driven by Playwright).

A real `onceflow api`, Postgres, Redis and a real Celery worker: the page refuses to show
data without a valid key, shows the table's numbers after a drain, updates without a reload
when the worker completes new work, and its requeue button is refused for a viewer key (the
row unchanged) and works for an admin key (queued, then completed by the worker). Nothing
downloads a browser: without /usr/bin/chromium the test skips, or fails under CI=true.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.integrations.fastapi import hash_key
from onceflow.keys import counters_key
from onceflow.locks.counters import calls_saved, parse_hash
from tests.browser.conftest import ADMIN_KEY, API_KEY, VIEWER_KEY, WC, artifacts_dir
from tests.browser.stages import FIXED
from tests.browser.test_dashboard_api import (
    OPS_LAST_MINUTE,
    drained,
    expected_depth,
    idle_rows,
    status_of,
)

pytestmark = pytest.mark.slow

DEADLINE_MS = 20_000


def row(engine: Engine, request_id: str) -> tuple[Any, ...]:
    query = text("SELECT * FROM workspace_process_requests WHERE request_id = :r")
    with engine.connect() as conn:
        return tuple(conn.execute(query, {"r": request_id}).one())


def numbers(page: Any) -> dict[str, str]:
    """Every cell the page marks with a data-k, as shown."""
    shown: dict[str, str] = page.eval_on_selector_all(
        "[data-k]", "els => Object.fromEntries(els.map(e => [e.dataset.k, e.textContent]))"
    )
    return shown


def table_numbers(engine: Engine, redis_url: str) -> dict[str, str]:
    """What those cells must show, from Postgres (and the savings from Redis)."""
    want: dict[str, str] = {}
    totals = dict.fromkeys(("queued", "scheduled", "running", "dead"), 0)
    for wc, stages in expected_depth(engine).items():
        for stage, counts in stages.items():
            for status, n in counts.items():
                want[f"depth/{wc}/{stage}/{status}"] = str(n)
                totals[status] += n
    want.update({f"total/{k}": str(v) for k, v in totals.items()})
    with engine.connect() as conn:
        ops = conn.execute(text(OPS_LAST_MINUTE)).scalar_one()
    want["ops/last_minute"] = str(ops)
    client = redis_lib.Redis.from_url(redis_url)
    for ws in ("dash-ws1", "dash-ws2"):
        stored = parse_hash(client.hgetall(counters_key(ws)))
        if not any(stored.values()):
            continue
        made = stored["computes"]  # computes_without_lock is a part of it
        want[f"savings/{ws}/made"] = str(made)
        want[f"savings/{ws}/asked"] = str(made + calls_saved(stored))
        want[f"savings/{ws}/saved"] = str(calls_saved(stored))
    return want


def shows(page: Any, want: dict[str, str]) -> None:
    """Wait (deadline, no sleep) until every expected cell shows its number."""
    page.wait_for_function(
        """want => Object.entries(want).every(([k, v]) => {
               const el = document.querySelector(`[data-k="${k}"]`);
               return el !== null && el.textContent === v; })""",
        arg=want,
        timeout=DEADLINE_MS,
    )


def enter_key(page: Any, key: str) -> None:
    page.fill("#key", key)
    page.click("#key-form button[type=submit]")


def test_dashboard_in_chromium(
    browser: Any,
    dashboard_api: tuple[str, Any],
    dashboard_worker: Any,
    dash: Any,
    engine: Engine,
    redis_url: str,
) -> None:
    url, api_proc = dashboard_api
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url))
    keyless: list[str] = []  # a data route read with no key in the tab
    page.on(
        "request",
        lambda r: (
            keyless.append(r.url)
            if r.headers.get("authorization") in ("Bearer null", "Bearer ")
            else None
        ),
    )
    posted: list[tuple[str, Any]] = []  # the actions' bodies, as the page sent them
    page.on(
        "request",
        lambda r: posted.append((r.url, r.post_data_json)) if r.method == "POST" else None,
    )

    # No key, a wrong key, an API key: no data is shown.
    page.goto(url + "/dashboard")
    page.wait_for_selector("body[data-state=no-key]", timeout=DEADLINE_MS)
    assert page.is_hidden("#panels")
    for bad in ("not-a-key", API_KEY):
        enter_key(page, bad)
        page.wait_for_selector("body[data-state=refused]", timeout=DEADLINE_MS)
        assert "Refused (401)" in page.inner_text("#refusal")
        assert page.is_hidden("#panels") and page.eval_on_selector_all("td", "t => t.length") < 5
    assert page.evaluate("sessionStorage.getItem('onceflow.operatorKey')") is None

    # A real drain: the page shows the table's numbers (and a request still running).
    idle_rows(engine, due=2, later=1)
    held = dash.flow.enqueue("hold", "dash-ws1", "jh", "", {}).request_id
    for branch in ("a", "b", "c"):
        dash.flow.enqueue("cell", "dash-ws1", "j1", branch, {"value": 5})
    dead_id = dash.flow.enqueue("flaky", "dash-ws1", "jf", "", {}).request_id
    from onceflow.demo.procs import wait_for

    wait_for(lambda: drained(engine) and status_of(engine, held) == "running", what="a drain")
    enter_key(page, VIEWER_KEY)
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)
    want = table_numbers(engine, redis_url)
    assert want["savings/dash-ws1/made"] == "1" and want["savings/dash-ws1/asked"] == "3"
    assert want[f"depth/{WC}/flaky/dead"] == "1" and want["ops/last_minute"] == "3"
    shows(page, want)
    assert page.inner_text(f'#dead tr[data-request-id="{dead_id}"] td.error').startswith(
        "RuntimeError: not fixed yet"
    )

    holder = page.inner_text(f'#running tr[data-request-id="{held}"]')
    with engine.connect() as conn:
        claimed_by = conn.execute(
            text("SELECT claimed_by FROM workspace_process_requests WHERE request_id = :r"),
            {"r": held},
        ).scalar_one()
    assert claimed_by and claimed_by in holder

    # Live: new work completed by the worker appears without a reload.
    page.evaluate("window.__sameDocument = true")
    loaded = page.evaluate("performance.getEntriesByType('navigation').length")
    dash.flow.enqueue("cell", "dash-ws2", "j2", "", {"value": 6})
    dash.flow.enqueue("cell", "dash-ws2", "j2", "x", {"value": 6})
    wait_for(lambda: drained(engine), what="the worker to complete the new work")
    want = table_numbers(engine, redis_url)
    assert want["savings/dash-ws2/asked"] == "2" and want["ops/last_minute"] == "5"
    shows(page, want)
    assert page.evaluate("window.__sameDocument") is True
    assert page.evaluate("performance.getEntriesByType('navigation').length") == loaded

    # Requeue with a viewer key: refused, the row unchanged.
    before = row(engine, dead_id)  # (the held row heartbeats: compare this row only)
    # Pressed, a snapshot arrives, released: the click still happens (the row is not
    # rebuilt under the pointer).
    page.hover(f'#dead tr[data-request-id="{dead_id}"] button[data-action=requeue]')
    page.mouse.down()
    seen = int(page.get_attribute("body", "data-snapshots") or 0)
    dash.flow.enqueue("cell", "dash-ws2", "j3", "", {"value": 8})
    page.wait_for_function(
        "n => Number(document.body.dataset.snapshots) > n", arg=seen, timeout=DEADLINE_MS
    )
    page.mouse.up()
    page.wait_for_selector("#action-result[data-outcome=refused]", timeout=DEADLINE_MS)
    assert page.inner_text("#action-result") == (  # the server's reason, as it gave it
        "Refused (403): this operator key does not have the 'admin' role"
    )
    assert row(engine, dead_id) == before
    shot = artifacts_dir() / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000

    # "Forget key" starts the page afresh: nothing shown stays, nothing more is read.
    with page.expect_navigation():
        page.click("#forget")
    page.wait_for_selector("body[data-state=no-key]", timeout=DEADLINE_MS)
    assert page.evaluate("sessionStorage.getItem('onceflow.operatorKey')") is None
    assert page.is_hidden("#panels") and page.eval_on_selector_all("td", "t => t.length") < 5
    assert dead_id not in page.content()

    # With an admin key: queued again, then completed by the worker.
    enter_key(page, ADMIN_KEY)
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)
    redis_lib.Redis.from_url(redis_url).set(FIXED + "jf", 1)
    page.click(f'#dead tr[data-request-id="{dead_id}"] button[data-action=requeue]')
    page.wait_for_selector("#action-result[data-outcome=ok]", timeout=DEADLINE_MS)
    assert f"requeue {dead_id}: done (now queued)" in page.inner_text("#action-result")
    wait_for(lambda: status_of(engine, dead_id) == "succeeded", what="the requeued request to run")
    page.wait_for_selector(f'#dead tr[data-request-id="{dead_id}"]', state="detached",
                           timeout=DEADLINE_MS)  # fmt: skip
    # Cancel the running request: it is asked to stop, stops, and leaves the panel.
    page.click(f'#running tr[data-request-id="{held}"] button[data-action=cancel]')
    page.wait_for_selector("#action-result[data-outcome=ok]", timeout=DEADLINE_MS)
    assert f"cancel {held}: done (now running)" in page.inner_text("#action-result")
    wait_for(lambda: status_of(engine, held) == "cancelled", what="the held request to stop")
    page.wait_for_selector(f'#running tr[data-request-id="{held}"]', state="detached",
                           timeout=DEADLINE_MS)  # fmt: skip
    shows(page, table_numbers(engine, redis_url))
    context.close()

    # Each action named the row by its key: the workspace shown with it went in the body.
    actions = {url.rsplit("/", 1)[1]: body for url, body in posted if "/requests/" in url}
    assert actions["requeue"]["workspace_id"] == actions["cancel"]["workspace_id"] == "dash-ws1"
    # The key never travelled in a URL; the requeue is audit-logged with the key id only.
    assert not [u for u in sent if any(k in u for k in (VIEWER_KEY, ADMIN_KEY, API_KEY))]
    assert keyless == []
    wait_for(lambda: f"requeued request {dead_id}" in api_proc.log(), what="the audit line")
    assert f"operator {hash_key(ADMIN_KEY)[:12]} requeued request {dead_id}" in api_proc.log()
