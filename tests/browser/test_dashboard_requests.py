"""The dashboard's request pages and history end to end, in real headless Chromium.

A real `onceflow api`, Postgres, Redis and a Celery worker (prefork, 2 children) run a
duplicate-heavy workload (one stage hands off to many cells of one job, which share one
compute-locked call; one request enqueued five times collapses onto one row) and a run
killed with ``kill -9`` of its pool child mid-stage (its lease lapses, the sweeper rescues
it, the worker runs it again). Then, from the page: a job id pasted into the search box
opens its request; two clicks from the landing page open a cell; every number on those
request pages is checked against the tables; the savings chart's last point and the
headline are checked against the Redis counters; an admin requeues a dead request from its
page (fenced on the version the page showed).
"""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.demo.procs import wait_for
from onceflow.keys import counters_key
from onceflow.locks.counters import calls_saved, parse_hash
from onceflow.locks.savings import read_savings
from onceflow.queue.series import write_rollup
from onceflow.spend import Grant, LedgerHooks, Usage, set_budget
from tests.acceptance.procs import pool_children
from tests.browser.conftest import ADMIN_KEY, SCOPED_KEY
from tests.browser.stages import RELEASE
from tests.browser.test_dashboard_api import drained, status_of
from tests.browser.test_dashboard_page import DEADLINE_MS, enter_key

pytestmark = pytest.mark.slow

WORKSPACES = ("dash-ws1", "dash-ws2")
NONE = "\u2013"  # what the page shows for a time not set (an en dash)


def shown_time(value: datetime | None) -> str:
    """A database time as the page shows it (util.js timeText): UTC, to the millisecond."""
    if value is None:
        return ""
    v = value.astimezone(UTC)
    return v.strftime("%Y-%m-%d %H:%M:%S.") + f"{v.microsecond // 1000:03d} UTC"


def one_row(engine: Engine, request_id: str) -> dict[str, Any]:
    query = text("SELECT * FROM workspace_process_requests WHERE request_id = :r")
    with engine.connect() as conn:
        return dict(conn.execute(query, {"r": request_id}).mappings().one())


def all_rows(engine: Engine, sql: str, **params: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(text(sql), params).mappings()]


PAGE = """() => {
  const text = (sel) => [...document.querySelectorAll(sel)].map((e) => e.textContent);
  const rows = (sel) => [...document.querySelectorAll(sel + " tbody tr")]
    .map((tr) => [...tr.children].map((td) => td.textContent));
  const facts = Object.fromEntries([...document.querySelectorAll("#req-facts dd")]
    .map((dd) => [dd.dataset.k, dd.textContent]));
  return {
    id: document.querySelector("#view-request").dataset.requestId,
    facts, history: rows("#req-history"), attempts: rows("#req-attempts"),
    locks: rows("#req-locks"), ops: rows("#req-ops"), spend: rows("#req-spend"),
    input: document.querySelector("#req-input").textContent,
    outcome: document.querySelector("#req-outcome").textContent,
    handedTo: text('[data-k="req/handoffs_to"] a'),
    actions: text("#req-actions button"),
  };
}"""


def page_data(page: Any, request_id: str) -> dict[str, Any]:
    """The request page of ``request_id`` once shown."""
    page.wait_for_function(
        "id => document.body.dataset.request === 'shown'"
        " && document.querySelector('#view-request').dataset.requestId === id",
        arg=request_id,
        timeout=DEADLINE_MS,
    )
    data: dict[str, Any] = page.evaluate(PAGE)
    return data


def check_against_tables(engine: Engine, shown: dict[str, Any], request_id: str) -> None:
    """Every number and time of a request's page against the tables."""
    row = one_row(engine, request_id)
    facts = shown["facts"]
    assert facts["req/status"] == row["status"]
    assert facts["req/workspace_id"] == row["workspace_id"]
    assert facts["req/job_id"] == row["job_id"]
    assert facts["req/stage"] == row["stage"] and facts["req/worker_class"] == row["worker_class"]
    assert facts["req/attempts"] == f"{row['attempts']} of {row['max_attempts']}"
    assert facts["req/crash_attempts"] == (
        f"{row['crash_attempts']} of {row['max_crash_attempts']}"
    )
    assert facts["req/priority"] == str(row["priority"])
    for name in ("created_at", "run_after", "updated_at"):
        assert facts[f"req/{name}"] == shown_time(row[name]), name
    assert facts["req/finished_at"] == (shown_time(row["finished_at"]) or NONE)

    # The attempts: one line per claim that ended, in order, as the history table has them.
    ended = all_rows(
        engine,
        "SELECT * FROM workspace_request_attempts WHERE request_id = :r AND attempt IS NOT NULL"
        " ORDER BY seq",
        r=request_id,
    )
    assert [a[0] for a in shown["attempts"]] == [str(e["attempt"]) for e in ended]
    for line, e in zip(shown["attempts"], ended, strict=True):
        assert line[1] == e["claimed_by"]
        assert line[2] == shown_time(e["claimed_at"])
        assert line[3] == f"{e['lease_seconds']:g} s"
        assert line[5] == shown_time(e["ended_at"])
        assert line[6] == e["event"]
        assert line[7] == e["next_status"]
    # The history: the enqueue and each claim, then every recorded end, by database time.
    events = [(h[0], h[1]) for h in shown["history"]]
    assert events[0] == (shown_time(row["created_at"]), "enqueued")
    recorded = all_rows(
        engine, "SELECT * FROM workspace_request_attempts WHERE request_id = :r ORDER BY seq",
        r=request_id,
    )  # fmt: skip
    for e in recorded:
        assert (shown_time(e["ended_at"]), e["event"]) in events, e
        if e["claimed_at"] is not None:
            assert (shown_time(e["claimed_at"]), "claimed") in events, e

    # The ops this request's claims wrote, with their clocks and commit times.
    ops = all_rows(
        engine,
        "SELECT * FROM workspace_sub_doc_ops WHERE fence = :r ORDER BY committed_at, clock",
        r=request_id,
    )
    assert [(o[0], o[1], o[2], o[4]) for o in shown["ops"]] == [
        (str(o["clock"]), o["sub_doc"], o["op_id"], shown_time(o["committed_at"])) for o in ops
    ]
    # The compute locks of its runs, and whether each paid.
    locks = [(lk["cell"], lk["outcome"]) for e in ended for lk in (e["locks"] or [])]
    assert [(lk[0], lk[1]) for lk in shown["locks"]] == locks
    assert [lk[2] for lk in shown["locks"]] == [
        "paid" if outcome == "paid" else "not paid" for _, outcome in locks
    ]
    # Its spend lines, from the ledger.
    spend = all_rows(
        engine, "SELECT * FROM spend_ledger WHERE request_id = :r ORDER BY recorded_at",
        r=request_id,
    )  # fmt: skip
    assert [(s[1], s[5], s[6], s[7]) for s in shown["spend"]] == [
        (s["provider"], str(s["input_tokens"]), str(s["output_tokens"]), str(s["cost"].normalize()))
        for s in spend
    ]


def test_request_pages_and_history_against_the_tables(
    browser: Any,
    dashboard_api: tuple[str, Any],
    dashboard_worker: Any,
    dash: Any,
    engine: Engine,
    redis_url: str,
    tmp_path: Path,
) -> None:
    url, _ = dashboard_api
    client = redis_lib.Redis.from_url(redis_url)
    flow = dash.flow

    def roll_up() -> None:
        """The rollup a minute's first sweep writes (a sweep writes it once a minute), now."""
        write_rollup(engine, savings=read_savings(client))

    # The rollup's first savings totals are its baseline: stored now, before anything counts.
    roll_up()

    # Duplicate-heavy: twelve cells of one job (handed off by one request) share one call,
    # and one request enqueued five times is one row.
    parent = flow.enqueue("split", "dash-ws1", "jdup", "", {"value": 12}).request_id
    same = {
        flow.enqueue("cell", "dash-ws2", "jsame", "", {"value": 3}, dedupe=True).request_id
        for _ in range(5)
    }
    assert len(same) == 1
    dead_id = flow.enqueue("flaky", "dash-ws2", "jdead", "", {}).request_id

    # A run killed mid-stage: kill -9 of the pool child that holds it.
    held = flow.enqueue("hold", "dash-ws1", "jkill", "", {}).request_id
    wait_for(lambda: status_of(engine, held) == "running", what="the held request to run")
    holder = one_row(engine, held)["claimed_by"]
    pid = int(holder.rsplit(":", 1)[1])
    assert pid in pool_children(dashboard_worker)
    os.kill(pid, signal.SIGKILL)
    # Its lease lapses; the sweeper (called here; beat does the same) rescues it.
    wait_for(
        lambda: flow.sweep_once() is not None and one_row(engine, held)["crash_attempts"] == 1,
        timeout=30,
        what="the killed run's rescue",
    )
    # Released now, not before: a BLPOP of the killed child may still be registered with
    # Redis until its socket closes, and would take the release with it.
    client.rpush(RELEASE + "jkill", 1)
    wait_for(lambda: status_of(engine, held) == "succeeded", timeout=30, what="the second run")
    # A provider call charged to the held request (the ledger's own hooks), under a budget.
    set_budget("dash-ws1", "day", limit_cost="1", limit_tokens=1000, allow_new=True,
               database=engine)  # fmt: skip
    hooks = LedgerHooks(engine)
    grant = Grant(workspace_id="dash-ws1", provider="openai", estimate_tokens=100,
                  estimate_cost=Decimal("0.1"), stage="hold", request_id=held,
                  cell_key="cell:held")  # fmt: skip
    hooks.admit(grant)
    hooks.settle(grant, Usage(40, 10), "ok", "openai", "gpt-x", Decimal("0.02"))
    cells = lambda: all_rows(  # noqa: E731
        engine, "SELECT request_id FROM workspace_process_requests WHERE job_id = 'jdup'"
        " AND stage = 'cell'"
    )  # fmt: skip
    wait_for(lambda: len(cells()) == 12 and drained(engine), what="the drain")
    assert status_of(engine, dead_id) == "dead"
    roll_up()  # the rollup takes the counters' change since the baseline, and the ledger

    stored = {ws: parse_hash(client.hgetall(counters_key(ws))) for ws in WORKSPACES}
    made = sum(s["computes"] for s in stored.values())
    saved = sum(calls_saved(s) for s in stored.values())
    assert (made, saved) == (2, 11)  # one call for jdup's twelve cells, one for jsame

    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = context.new_page()
    script_errors: list[str] = []
    page.on("pageerror", lambda exc: script_errors.append(str(exc)))
    page.goto(url + "/dashboard")
    enter_key(page, ADMIN_KEY)
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)

    # The headline and the savings chart's last point: the Redis counters.
    want = {"asked": made + saved, "made": made, "saved": saved}
    for name, value in want.items():
        page.wait_for_function(
            "([k, v]) => document.querySelector(`[data-k='savings/total/${k}']`)"
            "?.dataset.value === v",
            arg=[name, str(value)],
            timeout=DEADLINE_MS,
        )
    # Each range has its buckets: a week of 2 h, a day of 15 min, an hour of minutes.
    for range_, points in (("week", 84), ("day", 96), ("hour", 60)):
        page.check(f"#series-form input[value={range_}]")
        page.wait_for_function(
            "([r, n]) => [...document.querySelectorAll('figure.chart')].every(f =>"
            " f.dataset.range === r && f.dataset.points === String(n))",
            arg=[range_, points],
            timeout=DEADLINE_MS,
        )
    page.wait_for_function(
        "want => Object.entries(want).every(([k, v]) =>"
        " document.querySelector(`[data-chart=savings] li[data-series=${k}]`)"
        "?.dataset.last === String(v))",
        arg=want,
        timeout=DEADLINE_MS,
    )
    # Each line breaks where a bucket has no value: one stretch ("M") per run of values.
    stretches = page.evaluate(
        """() => [...document.querySelectorAll('figure.chart path.line')].map(p => [
          (p.getAttribute('d').match(/M/g) || []).length,
          p.dataset.values.split(',').filter((v, i, a) => v !== '' && (i === 0 || a[i - 1] === ''))
            .length])"""
    )
    assert stretches and all(m == runs for m, runs in stretches), stretches
    label = page.get_attribute("[data-chart=savings] svg", "aria-label")
    assert f"asked {made + saved}, paid {made}, saved {saved}" in label
    # Tokens and money per provider against the day budget: the ledger's line.
    spent = {"tokens": {"openai": "50", "limit": "1000"}, "cost": {"openai": "0.02", "limit": "1"}}
    page.wait_for_function(
        "spent => Object.entries(spent).every(([chart, lines]) =>"
        " Object.entries(lines).every(([k, v]) => document.querySelector("
        " `[data-chart=${chart}] li[data-series=${k}]`)?.dataset.last === v))",
        arg=spent,
        timeout=DEADLINE_MS,
    )
    # The rescued lease is in the failures chart.
    page.wait_for_function(
        "() => document.querySelector('[data-chart=failures] li[data-series=rescued]')"
        "?.dataset.total === '1'",
        timeout=DEADLINE_MS,
    )

    # A job id pasted into the search box: its only request opens.
    page.fill("#q", "  jkill ")
    page.press("#q", "Enter")
    shown = page_data(page, held)
    assert page.url.endswith(f"#/requests/{held}?ws=dash-ws1")
    check_against_tables(engine, shown, held)
    assert [a[6] for a in shown["attempts"]] == ["rescued", "succeeded"]
    assert shown["attempts"][0][1] == holder  # the killed child's run
    assert shown["spend"] == [[shown["spend"][0][0], "openai", "gpt-x", "cell:held", "ok",
                               "40", "10", "0.02", shown["spend"][0][8]]]  # fmt: skip
    assert shown["actions"] == []  # succeeded: nothing to requeue or cancel

    # The back button returns to the list (it does not reopen the request).
    page.go_back()
    # The list for the pasted id itself (one row), not the list shown before the search.
    page.wait_for_function(
        "id => document.querySelector('#search-note').textContent === '1 shown'"
        " && [...document.querySelectorAll('#results tbody tr')]"
        ".map(tr => tr.dataset.requestId).join() === id",
        arg=held,
        timeout=DEADLINE_MS,
    )
    assert page.evaluate("() => document.body.dataset.view") == "requests"
    assert page.url.endswith("#/requests?q=jkill")

    # Pages, newest first: "Older" follows the server's cursor, "Newest" goes back.
    jdup = all_rows(
        engine,
        "SELECT request_id FROM workspace_process_requests WHERE job_id = 'jdup'"
        " ORDER BY created_at DESC, workspace_id, request_id DESC",
    )
    page.goto(f"{url}/dashboard#/requests?job=jdup&limit=5")
    listed = []
    for number, size in enumerate((5, 5, 3), start=1):
        page.wait_for_function(
            "([n, seen]) => { const ids = [...document.querySelectorAll('#results tbody tr')]"
            ".map(tr => tr.dataset.requestId);"
            " return ids.length === n && !ids.some(id => seen.includes(id)); }",
            arg=[size, listed],
            timeout=DEADLINE_MS,
        )
        listed += page.eval_on_selector_all(
            "#results tbody tr", "rows => rows.map(tr => tr.dataset.requestId)"
        )
        if number > 1:
            assert page.inner_text("#search-note").endswith(f"(page {number})")
        if size == 5:  # a double click reads one page, and counts one
            page.dblclick("#next-page")
    assert listed == [r["request_id"] for r in jdup]  # 13: the parent and its 12 cells
    assert page.is_disabled("#next-page")
    page.click("#first-page")
    page.wait_for_selector(f'#results tr[data-request-id="{listed[0]}"]', timeout=DEADLINE_MS)

    # Two clicks from the landing page: "Requests", then a cell of the duplicate-heavy job.
    page.goto(url + "/dashboard")
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)
    page.click("nav [data-nav=requests]")
    [first] = all_rows(
        engine,
        "SELECT request_id, workspace_id FROM workspace_process_requests WHERE job_id = 'jdup'"
        " AND stage = 'cell' AND branch_path = 's0'",
    )
    page.click(f'#results tr[data-request-id="{first["request_id"]}"] a')
    shown = page_data(page, first["request_id"])
    check_against_tables(engine, shown, first["request_id"])
    assert len(shown["ops"]) == 1  # the cell's op, with its clock
    assert len(shown["locks"]) == 1  # its compute-locked call: paid, or served by another
    # The parent's page links its hand-offs; one of them leads back here.
    page.goto(f"{url}/dashboard#/requests/{parent}")
    shown = page_data(page, parent)
    check_against_tables(engine, shown, parent)
    assert sorted(shown["handedTo"]) == sorted(r["request_id"] for r in cells())
    page.click(f'[data-k="req/handoffs_to"] a[title="{first["request_id"]}"]')
    page_data(page, first["request_id"])

    # The paid call and the saved ones over the twelve cells' pages add up to the counters.
    outcomes = all_rows(
        engine,
        "SELECT l->>'outcome' AS outcome FROM workspace_request_attempts a,"
        " jsonb_array_elements(a.locks) l WHERE a.workspace_id = 'dash-ws1'",
    )
    assert sum(o["outcome"] == "paid" for o in outcomes) == stored["dash-ws1"]["computes"]

    # A dead request's page offers Requeue to an admin; it sends the version it showed.
    page.goto(f"{url}/dashboard#/requests/{dead_id}?ws=dash-ws2")
    shown = page_data(page, dead_id)
    check_against_tables(engine, shown, dead_id)
    assert shown["actions"] == ["Requeue"]
    assert shown["outcome"].startswith("{") and "not fixed yet: job jdead" in shown["outcome"]
    version = one_row(engine, dead_id)["updated_at"]
    with page.expect_request("**/requeue") as sent:
        page.click("#req-actions button[data-action=requeue]")
    assert datetime.fromisoformat(sent.value.post_data_json["version"]) == version
    page.wait_for_selector("#action-result[data-outcome=ok]", timeout=DEADLINE_MS)
    wait_for(lambda: one_row(engine, dead_id)["updated_at"] > version, what="the requeue")
    page.screenshot(path=str(tmp_path / "request-page.png"), full_page=True)

    # A running request's page asks it to stop, fenced on the run it showed.
    running = flow.enqueue("hold", "dash-ws1", "jstop", "", {}).request_id
    wait_for(lambda: status_of(engine, running) == "running", what="the request to run")
    page.goto(f"{url}/dashboard#/requests/{running}?ws=dash-ws1")
    shown = page_data(page, running)
    assert shown["actions"] == ["Ask to stop"] and shown["facts"]["req/status"] == "running"
    # A live re-read that fails keeps the page as drawn and says why; the next snapshot
    # reads it again.
    failed: list[str] = []

    def fail_once(route: Any) -> None:
        failed.append(route.request.url)
        route.fulfill(status=503, json={"detail": "the database is away"})

    page.route(f"**/dashboard/api/requests/{running}*", fail_once, times=1)
    flow.enqueue("cell", "dash-ws2", "jblip", "", {"value": 7})  # a change: a snapshot
    page.wait_for_function(
        "() => document.querySelector('#req-note').textContent.includes('the database is away')"
        " && document.body.dataset.request === 'shown'",
        timeout=DEADLINE_MS,
    )
    assert len(failed) == 1
    kept = page.evaluate(PAGE)  # nothing cleared
    assert (kept["id"], kept["facts"]["req/status"], kept["actions"]) == (
        running,
        "running",
        ["Ask to stop"],
    )
    assert kept["history"] == shown["history"] and kept["input"] == shown["input"]
    with page.expect_request("**/cancel") as sent:
        page.click("#req-actions button[data-action=cancel]")
    assert set(sent.value.post_data_json) == {"run", "workspace_id"}
    wait_for(lambda: status_of(engine, running) == "cancelled", what="the run to stop")
    page.wait_for_function(
        "() => document.querySelector('[data-k=\"req/status\"]')?.textContent === 'cancelled'"
        " && document.querySelector('#req-note').textContent.startsWith('as of database time')",
        timeout=DEADLINE_MS,
    )  # the page follows: read again with the snapshot that saw it end
    # A link with a broken escape in its id leads to the landing page, not to an error.
    page.evaluate("location.hash = '#/requests/%'")
    page.wait_for_function("() => document.body.dataset.view === 'overview'", timeout=DEADLINE_MS)
    assert page.is_hidden("#view-request") and script_errors == []
    context.close()

    # A key limited to other workspaces sees the request, not its input or error.
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(url + "/dashboard")
    enter_key(page, SCOPED_KEY)
    page.wait_for_selector("body[data-state=live]", timeout=DEADLINE_MS)
    page.goto(f"{url}/dashboard#/requests/{dead_id}?ws=dash-ws2")
    shown = page_data(page, dead_id)
    assert shown["input"] == shown["outcome"] == ""
    assert page.inner_text("#req-input-note").startswith("withheld")
    assert shown["facts"]["req/status"] == one_row(engine, dead_id)["status"]
    context.close()
