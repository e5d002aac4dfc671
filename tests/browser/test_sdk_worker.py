"""The SDK's PullWorker in real headless Chromium: browser tabs as real pull workers.

Against a real `onceflow api` (Postgres, Redis), a real Celery worker, the real MCP server
and a counting LLM stand-in:

* two tabs of one browser racing the same work: one leader (Web Locks), one claim;
* a tab closed mid-stage: its lease lapses (the database's clock) and the other tab,
  leader once the closed one's Web Lock is gone, completes the work;
* a tab finding a cell's compute lock taken waits for the broadcast: no provider call;
* three browsers + a Celery worker + an MCP agent asking for the same cells: exactly one
  provider call per cell at the stand-in, every cell stored once.

The tabs call the stand-in directly with a test key: a real deployment proxies provider
calls through its own back end and never ships a provider secret to a browser.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.demo import procs
from onceflow.demo.standins import StandIn
from onceflow.keys import queue_name
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, wait_for
from tests.browser.conftest import LLM_KEY, SDK_API_KEY, SDK_APP, SDK_WORKER_KEY, open_tab

pytestmark = pytest.mark.slow

DEADLINE_MS = 15_000

PAGE = """<!doctype html><meta charset="utf-8"><title>pull worker tab</title>
<script type="module">
import * as sdk from "/sdk/index.js";
const { PullWorker } = sdk;
const state = (window.state = { leader: false, claimCalls: 0, lockCalls: 0, runs: [],
  outcomes: [], paths: [], waiting: [], errors: [] });
window.hold = false;

// The tab's app: a PullWorker whose fetch counts the claims and lock acquisitions it makes.
window.startWorker = (o) => {
  const counting = (url, init) => {
    const path = new URL(url, location.href).pathname;
    if (path.endsWith("/claims")) state.claimCalls += 1;
    if (path.endsWith("/locks")) state.lockCalls += 1;
    return fetch(url, init);
  };
  const worker = new PullWorker({ apiKey: o.workerKey, workerClass: o.workerClass,
    workerId: o.name, waitSeconds: 10, fetch: counting, leaseSeconds: o.leaseSeconds,
    onLeader: (leading) => { state.leader = leading; },
    onOutcome: (outcome) => state.outcomes.push(outcome) });
  window.worker = worker;
  const handler = o.mode === "eval" ? evaluate(o) : record(o);
  worker.run(handler).catch((error) => state.errors.push(String(error)));
  return worker.leaderName;
};

function record(o) {
  return async (ctx) => {
    state.runs.push({ requestId: ctx.requestId, attempt: ctx.attempt });
    if (window.hold) await new Promise(() => {}); // a stage still running when the tab closes
    return { tab: o.name, attempt: ctx.attempt };
  };
}

// The demo's evaluate, in the tab: one provider call per cell under its compute lock.
function evaluate(o) {
  return async (ctx) => {
    const job = ctx.request.job_id;
    const doc = `job:${job}`;
    // The cell as stored: a read under the claim (a worker key has no workspace scope).
    const cells = async () => (await ctx.readSubDoc(doc)).state.cells || {};
    const scores = {}, paths = {};
    for (const column of ctx.input.columns) {
      const out = await ctx.computeOnce(`eval:${column}`, {
        ttlSeconds: 10,
        check: async () => (await cells())[column] ?? null,
        compute: async () => {
          const prompt = `cell: ${job}/eval:${column}\\n`
            + `Score job ${job} on '${column}' from 0 to 1.`;
          const answer = await fetch(`${o.llmUrl}/v1/chat/completions`, { method: "POST",
            headers: { Authorization: `Bearer ${o.llmKey}`, "Content-Type": "application/json" },
            body: JSON.stringify({ model: "standin-1",
                                   messages: [{ role: "user", content: prompt }] }) });
          if (!answer.ok) throw new Error(`llm ${answer.status}`);
          return JSON.parse((await answer.json()).choices[0].message.content).score;
        },
        store: (value) => ctx.applyOp(doc, { type: "cell.set", column, value },
                                      { key: `cell:${column}` }),
        onWait: (info) => state.waiting.push(info.task),
      });
      scores[column] = out.value;
      paths[column] = out.path;
      state.paths.push([column, out.path, out.servedBy || null]);
    }
    return { tab: o.name, scores, paths };
  };
}
window.sdkReady = true;
</script>"""


# ----------------------------------------------------------------------- fixtures


@pytest.fixture()
def sdk(clean_db: Engine, redis_url: str) -> Iterator[Any]:
    """The SDK stages' flow on an empty table; the pull classes' unconsumed wake-ups cleared."""
    os.environ.update(TEST_ENV)
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    from tests.browser import sdk_stages

    client = redis_lib.Redis.from_url(redis_url)
    queues = [queue_name(wc) for wc in (*sdk_stages.PULL_CLASSES, sdk_stages.CELLS_CELERY)]
    client.delete(*queues)
    yield sdk_stages
    client.delete(*queues)
    get_settings.cache_clear()


def provider_context(browser: Any) -> Any:
    """A browser (context) whose tabs may call the stand-in on the loopback address.

    Chromium's Local Network Access asks the user before a page reaches a loopback
    address; the test page is served by Playwright's route, not from a loopback socket, so
    the permission is granted up front (a real app calls its own back end instead).
    """
    return browser.new_context(permissions=["local-network-access"])


def tab(context: Any, base: str, name: str) -> Any:
    page = open_tab(context, base, PAGE, name=name)
    page.wait_for_function("window.sdkReady === true", timeout=DEADLINE_MS)
    return page


def start(page: Any, base: str, **options: Any) -> str:
    """Start the tab's PullWorker (leader election on); returns its Web Lock name."""
    defaults = {"workerKey": SDK_WORKER_KEY, "mode": "record"}
    name: str = page.evaluate("o => window.startWorker(o)", {**defaults, **options})
    return name


def state(page: Any) -> dict[str, Any]:
    found: dict[str, Any] = page.evaluate("() => window.state")
    return found


def rows(engine: Engine, workspace: str) -> list[dict[str, Any]]:
    query = text(
        "SELECT request_id, stage, status, attempts, result, claimed_by "
        "FROM workspace_process_requests WHERE workspace_id = :w ORDER BY stage"
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query, {"w": workspace})]


def all_succeeded(engine: Engine, workspace: str, n: int) -> list[dict[str, Any]] | None:
    found = rows(engine, workspace)
    ok = len(found) == n and all(r["status"] == "succeeded" for r in found)
    return found if ok else None


def beat_at(engine: Engine, request_id: str) -> Any:
    query = text("SELECT heartbeat_at FROM workspace_process_requests WHERE request_id = :r")
    with engine.connect() as conn:
        return conn.execute(query, {"r": request_id}).scalar_one()


def job() -> str:
    return f"j-{uuid.uuid4().hex[:8]}"


# -------------------------------------------------------------------------- tests


def test_two_tabs_of_one_browser_one_leader_one_claim(
    browser: Any, sdk_api: tuple[str, Any], sdk: Any, engine: Engine
) -> None:
    base, _ = sdk_api
    context = browser.new_context()
    try:
        tabs = [tab(context, base, f"lead-{i}") for i in (1, 2)]
        names = [start(page, base, workerClass=sdk.TAB_LEAD, name=f"lead-{i}")
                 for i, page in enumerate(tabs, start=1)]  # fmt: skip
        assert names[0] == names[1] == f"onceflow:pull-worker:{sdk.TAB_LEAD}"
        # One of them holds the browser's Web Lock for the class; the other waits for it.
        leaders = wait_for(
            lambda: [i for i, page in enumerate(tabs) if state(page)["leader"]],
            what="a leader tab",
        )
        assert len(leaders) == 1
        leader, other = tabs[leaders[0]], tabs[1 - leaders[0]]

        made = sdk.flow.enqueue("tab_lead", "sdk-w3", job(), "main", {"value": 1})
        [row] = wait_for(lambda: all_succeeded(engine, "sdk-w3", 1), what="the stage ran")
        assert row["request_id"] == made.request_id
        assert row["attempts"] == 1
        assert row["result"] == {"tab": f"lead-{leaders[0] + 1}", "attempt": 1}
        leader.wait_for_function("window.state.outcomes.length >= 1", timeout=DEADLINE_MS)
        ran = state(leader)  # (the row commits before the tab has its complete's answer)
        assert ran["runs"] == [{"requestId": made.request_id, "attempt": 1}]
        assert ran["outcomes"] == ["succeeded"] and ran["claimCalls"] >= 1
        idle = state(other)
        # The other tab never claimed: not one claim call, no run, still not the leader.
        assert (idle["leader"], idle["claimCalls"], idle["runs"]) == (False, 0, [])
        assert ran["errors"] == idle["errors"] == []
    finally:
        context.close()


def test_a_tab_closed_mid_stage_lapses_and_the_other_tab_completes(
    browser: Any, sdk_api: tuple[str, Any], sdk: Any, engine: Engine
) -> None:
    base, _ = sdk_api
    context = browser.new_context()
    try:
        first = tab(context, base, "close-a")
        first.evaluate("() => { window.hold = true; }")  # its stage never ends
        # A short lease (2 s, heartbeats every 2/3 s): a closed tab's lapses soon.
        start(first, base, workerClass=sdk.TAB_CLOSE, name="close-a", leaseSeconds=2)
        first.wait_for_function("window.state.leader === true", timeout=DEADLINE_MS)
        second = tab(context, base, "close-b")
        start(second, base, workerClass=sdk.TAB_CLOSE, name="close-b", leaseSeconds=2)

        made = sdk.flow.enqueue("tab_close", "sdk-w4", job(), "main", {"value": 2})
        first.wait_for_function("window.state.runs.length === 1", timeout=DEADLINE_MS)
        [running] = rows(engine, "sdk-w4")
        assert (running["status"], running["claimed_by"]) == ("running", "close-a")
        # It heartbeats: the lease moves on (the database's clock) while the tab is open.
        first_beat = beat_at(engine, made.request_id)
        wait_for(lambda: beat_at(engine, made.request_id) > first_beat, what="a heartbeat")
        assert state(second)["leader"] is False

        first.close()  # mid-stage: no completion, no more heartbeats, its Web Lock released

        [row] = wait_for(
            lambda: all_succeeded(engine, "sdk-w4", 1), timeout=15, what="completed elsewhere"
        )
        assert row["request_id"] == made.request_id
        assert row["attempts"] == 2  # claimed again once the closed tab's lease lapsed
        assert (row["claimed_by"], row["result"]) == ("close-b", {"tab": "close-b", "attempt": 2})
        # The row commits before the tab has the answer of its complete call: wait for it.
        second.wait_for_function("window.state.outcomes.length >= 1", timeout=DEADLINE_MS)
        took_over = state(second)
        assert took_over["leader"] is True
        assert took_over["runs"] == [{"requestId": made.request_id, "attempt": 2}]
        assert took_over["outcomes"] == ["succeeded"] and took_over["errors"] == []
    finally:
        context.close()


def test_a_tab_finding_the_cell_locked_waits_for_the_broadcast(
    browser: Any, sdk_api: tuple[str, Any], sdk: Any, engine: Engine, llm: StandIn
) -> None:
    from onceflow.locks.protocol import get_backend

    base, _ = sdk_api
    j = job()
    backend = get_backend()
    holder = backend.acquire("sdk-w6", j, "eval:fit", 30)  # someone else (Python) is on it
    assert holder is not None
    context = provider_context(browser)
    try:
        page = tab(context, base, "wait")
        start(page, base, workerClass=sdk.TAB_WAIT, name="wait", mode="eval",
              llmUrl=llm.url, llmKey=LLM_KEY)  # fmt: skip
        made = sdk.flow.enqueue("tab_wait", "sdk-w6", j, "main", {"columns": ["fit"]})
        # The tab got {locked: true}, subscribed, re-checked, tried again (locked), and waits.
        page.wait_for_function("window.state.waiting.length === 1", timeout=DEADLINE_MS)

        # The holder stores its value (a commit broadcast) and releases (lock_released).
        doc = f"job:{j}"
        answer = httpx.post(
            f"{base}/v1/workspaces/sdk-w6/sub-docs/{doc}/ops",
            json={"op_id": f"holder-{j}-0001", "op": {"type": "cell.set", "column": "fit",
                                                       "value": 0.77}},
            headers={"Authorization": f"Bearer {SDK_API_KEY}"},
        )  # fmt: skip
        assert answer.status_code == 201, answer.text
        holder.release()
        backend.announce(holder, ok=True)

        [row] = wait_for(lambda: all_succeeded(engine, "sdk-w6", 1), what="the tab finished")
        assert row["request_id"] == made.request_id
        assert row["result"] == {"tab": "wait", "scores": {"fit": 0.77}, "paths": {"fit": "waited"}}
        seen = state(page)
        assert seen["paths"] == [["fit", "waited", "broadcast"]]
        assert seen["waiting"] == ["eval:fit"]
        # one acquire, one more once subscribed (a release before the stream was live would
        # be missed otherwise), then the broadcast: no polling loop
        assert seen["lockCalls"] == 2
        assert f"{j}/eval:fit" not in llm.stats()["per_key"]  # the provider was never called
    finally:
        context.close()


COLUMNS = ["fit", "pay", "remote", "growth"]


def test_three_browsers_a_celery_worker_and_an_agent_pay_once_per_cell(
    browser: Any,
    sdk_api: tuple[str, Any],
    sdk: Any,
    engine: Engine,
    llm: StandIn,
    tmp_path: Path,
) -> None:
    base, _ = sdk_api
    j = job()
    env = {**TEST_ENV, "PYTHONPATH": str(ROOT), "ONCEFLOW_DEMO_LLM_URLS": llm.url,
           "ONCEFLOW_LLM_API_KEY": LLM_KEY}  # fmt: skip
    worker = procs.start_worker(
        tmp_path, SDK_APP, sdk.CELLS_CELERY, env=env, cwd=ROOT, name="sdk-cells"
    )
    contexts = [provider_context(browser) for _ in sdk.TAB_EVAL]  # three browsers
    try:
        pages = []
        for n, (context, wc) in enumerate(zip(contexts, sdk.TAB_EVAL, strict=True), start=1):
            page = tab(context, base, f"cells-{n}")
            start(page, base, workerClass=wc, name=f"cells-{n}", mode="eval",
                  llmUrl=llm.url, llmKey=LLM_KEY)  # fmt: skip
            page.wait_for_function("window.state.leader === true", timeout=DEADLINE_MS)
            pages.append(page)

        # The agent asks for every evaluation over MCP, and follows them until they are done.
        stages = [f"tab_eval_{n}" for n in (1, 2, 3)] + ["celery_eval"]
        done = agent(sdk_stages_app=SDK_APP, workspace="sdk-w5", job_id=j, stages=stages)

        assert sorted(r["stage"] for r in done) == sorted(stages)
        summary = [(r["stage"], r["status"], r["attempts"], r.get("error")) for r in done]
        assert all(r[1:3] == ("succeeded", 1) for r in summary), json.dumps(summary, indent=1)
        # Exactly one provider call per cell, whoever asked.
        calls = {k: n for k, n in llm.stats()["per_key"].items() if k.startswith(f"{j}/")}
        assert calls == {f"{j}/eval:{c}": 1 for c in COLUMNS}
        # Every cell stored once (one cell.set op per column), with the value everyone got.
        query = text(
            "SELECT payload->>'column', count(*), min(clock) IS NOT NULL "
            "FROM workspace_sub_doc_ops WHERE workspace_id = 'sdk-w5' AND sub_doc = :d "
            "GROUP BY 1"
        )
        with engine.connect() as conn:
            stored = {c: (n, ok) for c, n, ok in conn.execute(query, {"d": f"job:{j}"})}
        assert stored == {c: (1, True) for c in COLUMNS}
        results = {r["stage"]: r["result"] for r in rows(engine, "sdk-w5")}
        # Four callers, one value per cell. Compared as numbers: a tab (JavaScript) writes a
        # score of exactly 0 as 0 and Python as 0.0, one JSON number in two spellings (a
        # comparison of the JSON texts failed whenever a cell scored 0: 1 in 25 runs).
        scores = [res["scores"] for res in results.values()]
        assert all(s == scores[0] for s in scores), scores
        paths = [p for res in results.values() for p in res["paths"].values()]
        assert paths.count("computed") == len(COLUMNS)
        assert set(paths) <= {"computed", "waited", "double_check", "preflight"}
        for page in pages:
            page.wait_for_function("window.state.outcomes.length >= 1", timeout=DEADLINE_MS)
            assert state(page)["errors"] == [] and state(page)["outcomes"] == ["succeeded"]
    finally:
        for context in contexts:
            context.close()
        worker.stop()


def agent(
    *, sdk_stages_app: str, workspace: str, job_id: str, stages: list[str]
) -> list[dict[str, Any]]:
    """An MCP agent (the real `onceflow mcp` over stdio) enqueues each stage for the same
    cells and polls ``get_request`` until every one succeeded; returns the requests.

    Run on its own thread (its own event loop), beside Playwright's sync API."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "onceflow.cli", "mcp", "--app", sdk_stages_app],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=str(ROOT),
    )

    async def scenario() -> list[dict[str, Any]]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            ids = []
            for stage in stages:
                args = {"workspace_id": workspace, "job_id": job_id, "branch_path": "main",
                        "stage": stage, "input": {"columns": COLUMNS}}  # fmt: skip
                made = json.loads((await session.call_tool("enqueue_stage", args)).content[0].text)
                assert made["created"] is True, made
                ids.append(made["request_id"])
            with anyio.fail_after(25):
                while True:
                    got = []
                    for request_id in ids:
                        answer = await session.call_tool("get_request", {"request_id": request_id})
                        got.append(json.loads(answer.content[0].text))
                    if all(r["status"] in ("succeeded", "dead", "cancelled") for r in got):
                        return got
                    await anyio.sleep(0.1)

    out: list[Any] = []

    def run() -> None:
        try:
            out.append(anyio.run(scenario))
        except BaseException as exc:  # reported on the test's thread
            out.append(exc)

    thread = threading.Thread(target=run, name="mcp-agent", daemon=True)
    thread.start()
    thread.join(timeout=40)
    assert out, "the MCP agent did not finish"
    if isinstance(out[0], BaseException):
        raise out[0]
    result: list[dict[str, Any]] = out[0]
    return result
