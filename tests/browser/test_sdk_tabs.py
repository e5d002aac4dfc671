"""Many tabs of one browser against a real `onceflow api`: one connection per browser, not per tab.

A browser keeps at most 6 HTTP/1.1 connections per host and profile (`onceflow api` serves
HTTP/1.1). Each tab of the SDK used to hold its own event stream, and each waiting
``computeOnce`` another: with a few tabs a leader's claims and heartbeats waited for a socket
until their leases lapsed. Here, in real headless Chromium (Debian's), with Postgres, Redis
and a counting LLM stand-in, 12 tabs of one profile (and 3 profiles of 8 tabs):

* every tab follows the workspace (``WorkspaceClient.subscribe``) and runs a pull worker of a
  class of its own: every tab claims one evaluation of the same job, and they race its cells
  with ``computeOnce``;
* every tab also runs a pull worker of one shared class: one leader per profile claims a stage
  whose body runs 20 s, heartbeating every 0.5 s (a 1.5 s lease) through the rush;

and: every request succeeds at its first attempt, one provider call per cell, no lease lost
(no heartbeat answered 409), every tab sees every commit, no waiting ``computeOnce`` opened a
stream of its own, and the TCP connections established to the API's port — counted on the
server's side (``ss``, or ``/proc/net/tcp``) every 50 ms during the run — never exceed 2 per
profile.

The pages and the SDK's modules are served by the test (as an app's bundle from its own
server), so every connection to the API is the SDK's. The API's request rate limit is off:
what is measured is connections, not the rate limiter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.demo import procs
from onceflow.demo.standins import StandIn
from onceflow.integrations.fastapi import hash_key
from onceflow.keys import queue_name
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, api_server, wait_for
from tests.browser.conftest import LLM_KEY, SDK_APP

pytestmark = pytest.mark.slow

API_KEY = "of_test_tabs_api_key_0123456789abcdef"  # workspace tabs-w1
WORKER_KEY = "of_test_tabs_worker_key_0123456789ab"  # every worker class
WS = "tabs-w1"
SDK_DIR = ROOT / "onceflow" / "sdk" / "js"
COLUMNS = ["fit", "pay", "remote", "growth"]
HOLD_MS = 20_000
DEADLINE_MS = 20_000

PAGE = """<!doctype html><meta charset="utf-8"><title>tab</title>
<script type="module">
import { PullWorker, WorkspaceClient } from "/sdk/index.js";
const state = (window.state = { commits: [], outcomes: [], errors: [], failures: [], paths: [],
  waiting: 0, leader: false, held: [], claimStreams: 0, sharedFeeds: 0 });

window.startTab = (o) => {
  // The tab's fetch: records every answer that is not a success, and every call that got no
  // answer without being stopped by the SDK itself.
  const counting = async (url, init = {}) => {
    const path = new URL(url, location.href).pathname;
    try {
      const answer = await fetch(url, init);
      if (answer.status >= 400) state.failures.push(`${answer.status} ${path}`);
      return answer;
    } catch (error) {
      if (!init.signal?.aborted) state.failures.push(`no answer ${path}: ${error}`);
      throw error;
    }
  };
  const client = new WorkspaceClient({ apiKey: o.apiKey, workspaceId: o.ws, clientName: o.name,
    fetch: counting, shareTabs: o.share });
  client.subscribe(`job:${o.job}`, (commit) => state.commits.push(commit.clock), { since: 0 });
  client.on("error", (error) => state.errors.push(`client: ${error}`));

  const common = { apiKey: o.workerKey, fetch: counting, shareTabs: o.share,
    onOutcome: (outcome) => state.outcomes.push(outcome) };
  const hold = new PullWorker({ ...common, workerClass: o.holdClass, workerId: `${o.name}-hold`,
    onLeader: (leading) => { state.leader = leading; } });
  hold.run(async (ctx) => {
    state.held.push(ctx.requestId);
    // The stage's body: 20 s of work (stopped at once if the lease were lost).
    await new Promise((resolve, reject) => {
      const done = setTimeout(resolve, o.holdMs);
      const stop = () => { clearTimeout(done); reject(ctx.signal.reason); };
      ctx.signal.addEventListener("abort", stop);
    });
    return { tab: o.name };
  }).catch((error) => state.errors.push(`hold: ${error}`));

  const evaluate = new PullWorker({ ...common, workerClass: o.evalClass, workerId: o.name });
  evaluate.run(async (ctx) => {
    const job = ctx.request.job_id;
    const doc = `job:${job}`;
    const cells = async () => (await ctx.readSubDoc(doc)).state.cells || {};
    const scores = {};
    try {
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
          onWait: () => { state.waiting += 1; },
        });
        scores[column] = out.value;
        state.paths.push(out.path);
      }
    } finally {
      state.claimStreams += ctx.events.opened;
      state.sharedFeeds += ctx.events.shared;
    }
    return { tab: o.name, scores };
  }).catch((error) => state.errors.push(`eval: ${error}`));

  window.workers = { hold, evaluate };
};
window.report = () => ({ ...state, beats: [window.workers.hold.heartbeats,
  window.workers.evaluate.heartbeats], link: window.workers.hold.link?.stats ?? null });
window.sdkReady = true;
</script>"""


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tabs_api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[tuple[str, procs.Proc]]:
    """A real `onceflow api` (HTTP/1.1, as uvicorn serves it) for these tests: (URL, process)."""
    env = {
        **TEST_ENV,
        "PYTHONPATH": str(ROOT),
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): [WS]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): ["*"]}),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
        "ONCEFLOW_API_RATE_LIMIT": "",
        "ONCEFLOW_API_SSE_KEEPALIVE_SECONDS": "1",
    }
    with api_server(tmp_path_factory.mktemp("tabs-api"), env, app=SDK_APP) as (url, proc):
        yield url, proc
    log_text = proc.log()
    for secret in (API_KEY, WORKER_KEY):
        assert secret not in log_text  # keys are never logged


@pytest.fixture()
def tabs_flow(clean_db: Engine, redis_url: str) -> Iterator[Any]:
    """The SDK stages' flow on an empty table; the pull classes' unconsumed wake-ups cleared."""
    os.environ.update(TEST_ENV)
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    from tests.browser import sdk_stages

    client = redis_lib.Redis.from_url(redis_url)
    queues = [queue_name(wc) for wc in sdk_stages.TABS_CLASSES]
    client.delete(*queues)
    yield sdk_stages
    client.delete(*queues)
    get_settings.cache_clear()


# ----------------------------------------------------------------------- helpers


def established(port: int) -> int:
    """TCP connections established to ``port`` on this machine, counted on the server's side
    (the sockets whose LOCAL port is ``port``): with ``ss`` (the kernel filters: fast however
    many sockets the machine has), else from /proc/net/tcp and tcp6."""
    if SS is not None:
        command = [SS, "-Htn", "state", "established", f"( sport = :{port} )"]
        done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=10)
        return len(done.stdout.splitlines())
    count = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as table:
            next(table)
            for line in table:
                fields = line.split()
                local, state = fields[1], fields[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


SS = shutil.which("ss")


class Sampler:
    """Counts the API's established connections every 50 ms on a thread: the most, and each
    change of the count (seconds since the start, count) for a failure's message."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.most = 0
        self.samples = 0
        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connections", daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            count = established(self.port)
            if not self.changes or self.changes[-1][1] != count:
                self.changes.append((round(time.monotonic() - start, 2), count))
            self.most = max(self.most, count)
            self.samples += 1
            self._stop.wait(0.05)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def profile(browser: Any, base: str) -> Any:
    """A new browser profile (context) whose pages and SDK modules the test serves.

    Chromium's Local Network Access asks before a page reaches a loopback address: granted up
    front, so the tabs may call the stand-in (a real app calls its own back end instead)."""
    context = browser.new_context(permissions=["local-network-access"])

    def serve(route: Any) -> None:
        path = urlsplit(route.request.url).path
        if path.startswith("/sdk/") and path.endswith(".js"):
            source = SDK_DIR / Path(path).name
            if source.is_file():
                route.fulfill(status=200, content_type="text/javascript", body=source.read_text())
                return
        if path.startswith("/__test__/"):
            route.fulfill(status=200, content_type="text/html; charset=utf-8", body=PAGE)
            return
        route.fulfill(status=404, body="")

    # A pattern (matched by Playwright's driver, not by this thread): the API's own calls
    # go through untouched while the test thread is busy elsewhere.
    context.route(re.compile(rf"^{re.escape(base)}/(sdk/|__test__/|favicon\.ico)"), serve)
    return context


def rows(engine: Engine, workspace: str) -> list[dict[str, Any]]:
    query = text(
        "SELECT request_id, stage, status, attempts, claimed_by "
        "FROM workspace_process_requests WHERE workspace_id = :w ORDER BY stage"
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query, {"w": workspace})]


def all_ended(engine: Engine, workspace: str, n: int) -> list[dict[str, Any]] | None:
    found = rows(engine, workspace)
    ended = len(found) == n and all(r["status"] in ("succeeded", "dead") for r in found)
    return found if ended else None


# -------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("profiles", "tabs"), [(1, 12), (3, 8)], ids=["1x12", "3x8"])
def test_tabs_of_a_browser_share_one_connection(
    browser: Any,
    tabs_api: tuple[str, procs.Proc],
    tabs_flow: Any,
    engine: Engine,
    llm: StandIn,
    profiles: int,
    tabs: int,
) -> None:
    base, _ = tabs_api
    port = urlsplit(base).port
    assert port is not None
    job = f"j-{uuid.uuid4().hex[:8]}"
    contexts = [profile(browser, base) for _ in range(profiles)]
    # the connections are counted from the first tab's first call to the end
    with Sampler(port) as sampler:
        try:
            pages = [open_tabs(context, base, p, tabs, job, tabs_flow, llm)
                     for p, context in enumerate(contexts)]  # fmt: skip

            def leaders() -> list[int] | None:
                found = [sum(1 for page in tabs_of if page.evaluate("window.state.leader"))
                         for tabs_of in pages]  # fmt: skip
                return found if all(found) else None

            # one leader of the shared class per profile (Web Locks)
            assert wait_for(leaders, timeout=20, what="a leader per profile") == [1] * profiles

            started = time.monotonic()
            for p in range(profiles):  # one 20 s stage per profile's leader (one per branch)
                tabs_flow.flow.enqueue("tabs_hold", WS, job, f"hold-{p}", {"value": p})
            for n in range(profiles * tabs):  # one evaluation per tab, all of the same cells
                tabs_flow.flow.enqueue(f"tabs_eval_{n + 1}", WS, job, "main", {"columns": COLUMNS})
            total = profiles + profiles * tabs
            try:
                done = wait_for(lambda: all_ended(engine, WS, total), timeout=60, what="stages")
            except AssertionError as exc:  # say which stages, and what the tabs saw
                seen = [page.evaluate("window.report()") for tabs_of in pages for page in tabs_of]
                raise AssertionError(f"{exc}: {rows(engine, WS)}; tabs: {seen}") from None
            elapsed = time.monotonic() - started
            reports = [page.evaluate("window.report()") for tabs_of in pages for page in tabs_of]
        finally:
            for context in contexts:
                context.close()

    summary = [(r["stage"], r["status"], r["attempts"]) for r in done]
    # every request succeeded at its first attempt: no lease lost, none claimed again
    assert all(r[1:] == ("succeeded", 1) for r in summary), summary
    holders = {r["claimed_by"] for r in done if r["stage"] == "tabs_hold"}
    assert len(holders) == profiles  # each profile's leader ran one 20 s stage
    # one provider call per cell, whichever of the tabs asked
    calls = {k: n for k, n in llm.stats()["per_key"].items() if k.startswith(f"{job}/")}
    assert calls == {f"{job}/eval:{c}": 1 for c in COLUMNS}

    for report in reports:
        assert report["errors"] == [] and report["failures"] == [], report
        assert all(outcome == "succeeded" for outcome in report["outcomes"]), report
        assert sum(beats["lost"] for beats in report["beats"]) == 0, report
    # every tab saw the job's four commits (one event stream per profile, fanned out)
    assert all(len(r["commits"]) == len(set(r["commits"])) == len(COLUMNS) for r in reports), [
        r["commits"] for r in reports
    ]
    paths = [p for r in reports for p in r["paths"]]
    assert paths.count("computed") == len(COLUMNS)
    assert set(paths) <= {"computed", "waited", "double_check", "preflight"}
    # a waiting computeOnce listened to its profile's feed: no stream of its own
    assert sum(r["claimStreams"] for r in reports) == 0
    leading = [r for r in reports if r["held"]]
    assert len(leading) == profiles
    assert all(r["beats"][0]["answered"] > 0 for r in leading)  # the leaders heartbeat
    beats = [b for r in reports for b in r["beats"]]

    # the measure: connections from the browser to the API, at most 2 per profile
    assert sampler.samples > 0
    assert sampler.most <= 2 * profiles, (sampler.most, profiles, sampler.changes)
    print(
        f"\n{profiles} profile(s) x {tabs} tabs: at most {sampler.most} connections to the API "
        f"({sampler.samples} samples; stages done in {elapsed:.1f} s); heartbeats answered "
        f"{sum(b['answered'] for b in beats)}, sent again {sum(b['retried'] for b in beats)}, "
        f"lost 0; computeOnce waits {sum(r['waiting'] for r in reports)}, on a shared feed "
        f"{sum(r['sharedFeeds'] for r in reports)}; heartbeats sent beside the wire "
        f"{sum((r['link'] or {}).get('bypassed', 0) for r in reports)}"
    )


def open_tabs(
    context: Any, base: str, p: int, tabs: int, job: str, flow: Any, llm: StandIn
) -> list[Any]:
    """Profile ``p``'s tabs, each following the workspace and running its two workers."""
    opened = []
    for t in range(tabs):
        n = p * tabs + t
        page = context.new_page()
        page.goto(f"{base}/__test__/tab-{n}.html")
        page.wait_for_function("window.sdkReady === true", timeout=DEADLINE_MS)
        options = {
            "name": f"p{p}-t{t}", "apiKey": API_KEY, "workerKey": WORKER_KEY, "ws": WS,
            "job": job, "holdClass": flow.TABS_HOLD, "evalClass": flow.TABS_EVAL[n],
            "llmUrl": llm.url, "llmKey": LLM_KEY, "holdMs": HOLD_MS, "share": True,
        }  # fmt: skip
        page.evaluate("o => window.startTab(o)", options)
        opened.append(page)
    return opened
