// The tabs' shared link under Node's test runner: two or more "tabs" (TabLink objects) of one
// "browser" (one Web Locks manager, Node's BroadcastChannel) share one wire — one call at a
// time, heartbeats first — and one event stream per workspace, handed over when its holder
// goes; and heartbeats that get no answer in time are sent again, not taken for a lost lease.
// The real thing (Chromium's Web Locks, its socket pool, a real `onceflow api`) is proven in
// tests/browser/test_sdk_tabs.py.

import assert from "node:assert/strict";
import { test } from "node:test";

import { ClaimEvents, PullWorker, TabLink, WorkspaceClient, computeOnce, linkNames, serverOf } from "../index.js";
import { MemoryOutbox } from "../outbox.js";

const KEY = "of_test_worker_key_for_node_0123456";
let serverCount = 0;

/** A Web Locks manager as a browser keeps one per profile: exclusive locks granted FIFO. */
function webLocks() {
  const held = new Map(); // name -> true
  const queues = new Map(); // name -> [{grant}]
  function pump(name) {
    if (held.get(name)) return;
    const queue = queues.get(name) || [];
    const next = queue.shift();
    if (next) next.grant();
  }
  return {
    async query() {
      return { held: [...held.keys()].map((name) => ({ name, mode: "exclusive" })), pending: [] };
    },
    request(name, options, callback) {
      if (typeof options === "function") [options, callback] = [{}, options];
      const { signal } = options;
      return new Promise((resolve, reject) => {
        if (signal?.aborted) return reject(signal.reason);
        const entry = {
          grant: () => {
            signal?.removeEventListener("abort", onAbort);
            held.set(name, true);
            Promise.resolve()
              .then(() => callback({ name }))
              .then(resolve, reject)
              .finally(() => {
                held.delete(name);
                pump(name);
              });
          },
        };
        const onAbort = () => {
          const queue = queues.get(name) || [];
          const at = queue.indexOf(entry);
          if (at !== -1) {
            queue.splice(at, 1);
            reject(signal.reason);
          }
        };
        signal?.addEventListener("abort", onAbort, { once: true });
        if (!queues.has(name)) queues.set(name, []);
        queues.get(name).push(entry);
        pump(name);
      });
    },
  };
}

/** Tabs of one browser: `n` links to one (fresh) server, sharing one Web Locks manager. */
function browser(n) {
  const locks = webLocks();
  const server = `http://api-${++serverCount}.test`;
  const tabs = Array.from({ length: n }, () => new TabLink(server, { locks, Channel: BroadcastChannel }));
  return { locks, server, tabs, close: () => tabs.forEach((t) => t.close()) };
}

function until(condition, what, ms = 3_000) {
  const deadline = Date.now() + ms;
  return new Promise((resolve, reject) => {
    const look = () => {
      const value = condition();
      if (value) return resolve(value);
      if (Date.now() > deadline) return reject(new Error(`timed out waiting for ${what}`));
      setTimeout(look, 2);
    };
    look();
  });
}

function gate() {
  let open;
  const opened = new Promise((resolve) => (open = resolve));
  return { opened, open };
}

test("names and servers: a relative baseUrl is this page's origin", () => {
  assert.equal(serverOf("", { location: { href: "https://app.example/page/x.html" } }), "https://app.example");
  assert.equal(serverOf("https://api.example/", {}), "https://api.example");
  const names = linkNames("https://api.example");
  assert.equal(names.wire, "onceflow:wire@https://api.example");
  assert.equal(names.feed("w1"), "onceflow:feed@https://api.example#w1");
});

test("the wire: one call of the browser in flight at a time, across tabs", async () => {
  const b = browser(3);
  try {
    let inFlight = 0;
    let most = 0;
    const call = async () => {
      inFlight += 1;
      most = Math.max(most, inFlight);
      await new Promise((resolve) => setTimeout(resolve, 3));
      inFlight -= 1;
      return "ok";
    };
    const answers = await Promise.all(b.tabs.flatMap((tab) => [tab.send(call), tab.send(call), tab.send(call, { priority: "high" })]));
    assert.deepEqual(answers, Array(9).fill("ok"));
    assert.equal(most, 1);
  } finally {
    b.close();
  }
});

test("the wire: a heartbeat waits for the call in flight only, not for the queue of others", async () => {
  const b = browser(2);
  try {
    const order = [];
    const first = gate();
    const busy = b.tabs[0].send(async () => {
      order.push("busy");
      await first.opened;
    });
    await until(() => order.length === 1, "the first call on the wire");
    const queued = [1, 2, 3].map((n) => b.tabs[n % 2].send(async () => order.push(`call-${n}`)));
    const beat = b.tabs[1].send(async () => order.push("heartbeat"), { priority: "high" });
    await new Promise((resolve) => setTimeout(resolve, 5));
    first.open();
    await Promise.all([busy, beat, ...queued]);
    // the busy call held the gate and the wire: the heartbeat, queued on the wire, goes next
    assert.deepEqual(order, ["busy", "heartbeat", "call-1", "call-2", "call-3"]);
  } finally {
    b.close();
  }
});

test("the wire: a heartbeat that cannot get the wire in waitMs is sent beside a call that hangs", async () => {
  const b = browser(2);
  try {
    const hang = gate();
    const started = gate();
    const stuck = b.tabs[0].send(async () => {
      started.open();
      await hang.opened;
    });
    await started.opened;
    const beat = await b.tabs[1].send(async () => "beat", { priority: "high", waitMs: 20 });
    assert.equal(beat, "beat");
    assert.equal(b.tabs[1].stats.bypassed, 1);
    hang.open();
    await stuck;
  } finally {
    b.close();
  }
});

test("the wire: a call stopped while it waits is never sent", async () => {
  const b = browser(1);
  try {
    const hang = gate();
    const busy = b.tabs[0].send(() => hang.opened);
    const stop = new AbortController();
    let sent = false;
    const waiting = b.tabs[0].send(async () => (sent = true), { signal: stop.signal });
    stop.abort(new Error("stopped"));
    await assert.rejects(waiting, /stopped/);
    hang.open();
    await busy;
    assert.equal(sent, false);
  } finally {
    b.close();
  }
});

/** A feed opener that records its openings and lets the test drive its stream. */
function opener(log, name) {
  return async (stop, emit) => {
    log.push(`open:${name}`);
    emit("ready");
    log.emitters.set(name, emit);
    await new Promise((resolve) => stop.addEventListener("abort", resolve, { once: true }));
    log.push(`stop:${name}`);
  };
}

test("feeds: one tab of the browser holds a workspace's stream, every tab hears it; the next takes over", async () => {
  const b = browser(3);
  try {
    const log = Object.assign([], { emitters: new Map() });
    const heard = b.tabs.map(() => ({ ready: 0, events: [], down: 0 }));
    const follows = b.tabs.map((tab, n) =>
      tab.follow("w1", {
        open: opener(log, `tab${n}`),
        onReady: () => (heard[n].ready += 1),
        onEvent: (name, data) => heard[n].events.push([name, data]),
        onDown: () => (heard[n].down += 1),
      }),
    );
    await until(() => heard.every((h) => h.ready === 1), "every tab hears the first ready");
    assert.deepEqual([...log], ["open:tab0"]); // one stream for the browser
    log.emitters.get("tab0")("event", "commit", '{"clock":1}');
    await until(() => heard.every((h) => h.events.length === 1), "the commit everywhere");
    assert.deepEqual(heard.map((h) => h.events[0]), Array(3).fill(["commit", '{"clock":1}']));

    follows[0].close(); // the holder tab goes: the next in line opens, everyone catches up
    await until(() => log.includes("open:tab1"), "the next tab opens the stream");
    assert.deepEqual([...log], ["open:tab0", "stop:tab0", "open:tab1"]);
    await until(() => heard[1].ready === 2 && heard[2].ready === 2, "a new ready after the hand-over");
    assert.equal(heard[0].ready, 1); // the closed follower hears nothing more
    log.emitters.get("tab1")("event", "commit", '{"clock":2}');
    await until(() => heard[2].events.length === 2, "the new holder's commit");
    assert.equal(heard[0].events.length, 1);
    follows[1].close();
    follows[2].close();
  } finally {
    b.close();
  }
});

test("feeds: watch() hears a live feed of another tab, and null when no tab follows the workspace", async () => {
  const b = browser(2);
  try {
    assert.equal(await b.tabs[1].watch("w9", { timeoutMs: 50 }), null);
    const log = Object.assign([], { emitters: new Map() });
    const follow = b.tabs[0].follow("w9", { open: opener(log, "holder") });
    await until(() => log.emitters.has("holder"), "the holder's stream");
    const events = [];
    let resyncs = 0;
    const watch = await b.tabs[1].watch("w9", { onEvent: (name, data) => events.push(data), onReady: () => (resyncs += 1) });
    assert.ok(watch);
    log.emitters.get("holder")("event", "lock_released", '{"kind":"lock_released"}');
    await until(() => events.length === 1, "the event");
    log.emitters.get("holder")("down");
    log.emitters.get("holder")("ready");
    await until(() => resyncs === 1, "a resync on the new connection");
    watch.close();
    follow.close();
  } finally {
    b.close();
  }
});

test("ClaimEvents: with a tab following the claim's workspace, waiters hear its feed (their job's news only), no stream of their own", async () => {
  const b = browser(2);
  try {
    const log = Object.assign([], { emitters: new Map() });
    const follow = b.tabs[0].follow("w", { open: opener(log, "holder") });
    await until(() => log.emitters.has("holder"), "the holder's stream");
    let streams = 0;
    const api = { raw: async () => ((streams += 1), new Response(null, { status: 500 })) };
    const events = new ClaimEvents(api, "r1", "tok", { workspaceId: "w", link: b.tabs[1], jobId: "j1" });
    const sub = await events.subscribe();
    assert.equal(sub.ended, null);
    assert.equal(events.opened, 0);
    assert.equal(events.shared, 1);
    const emit = log.emitters.get("holder");
    emit("event", "lock_released", JSON.stringify({ kind: "lock_released", job_id: "j2", task: "eval:a" }));
    emit("event", "commit", JSON.stringify({ kind: "commit", sub_doc: "job:j2", clock: 3 }));
    emit("event", "commit", JSON.stringify({ kind: "commit", sub_doc: "job:j1", clock: 4 }));
    emit("event", "lock_released", JSON.stringify({ kind: "lock_released", job_id: "j1", task: "eval:a" }));
    assert.deepEqual(await sub.next(1_000), { kind: "commit", sub_doc: "job:j1", clock: 4 });
    assert.deepEqual(await sub.next(1_000), { kind: "lock_released", job_id: "j1", task: "eval:a" });
    emit("ready"); // a new connection (a holder that crashed, the next one's ready): a release may be missed
    assert.deepEqual(await sub.next(1_000), { kind: "resync" });
    emit("down"); // the holder lost its stream: the waiters subscribe again
    assert.equal(await sub.next(1_000), null);
    assert.equal(sub.ended, "ended");
    sub.close();
    assert.equal(streams, 0);
    follow.close();
  } finally {
    b.close();
  }
});

test("computeOnce: a waiter whose feed connected again tries the lock at once (resync), no TTL wait", async () => {
  const b = browser(2);
  try {
    const log = Object.assign([], { emitters: new Map() });
    const follow = b.tabs[0].follow("w", { open: opener(log, "holder") });
    await until(() => log.emitters.has("holder"), "the holder's stream");
    const events = new ClaimEvents({ raw: async () => assert.fail("no stream of its own") }, "r1", "tok", { workspaceId: "w", link: b.tabs[1], jobId: "j1" });
    let acquires = 0;
    const locks = {
      acquire: async () => (++acquires <= 2 ? { locked: true, remaining_ms: 60_000 } : { acquired: true, lock_token: "t", ttl_ms: 60_000 }),
      extend: async () => true,
      release: async () => true,
    };
    const started = Date.now();
    const out = computeOnce("eval:a", {
      locks, events, jobId: "j1", check: async () => null, compute: async () => 7, store: async () => true,
      onWait: () => setTimeout(() => { log.emitters.get("holder")("down"); log.emitters.get("holder")("ready"); }, 5),
    });
    const result = await out;
    assert.equal(result.path, "computed");
    assert.equal(acquires, 3);
    assert.ok(Date.now() - started < 10_000);
    follow.close();
  } finally {
    b.close();
  }
});

// ------------------------------------------------------------------ heartbeats

const REQ = "r".repeat(32);
const CLAIMS = `/v1/claims/${REQ}`;

function claimAnswer(leaseSeconds) {
  const request = { request_id: REQ, workspace_id: "w", job_id: "j1", stage: "s", input: {} };
  return new Response(JSON.stringify({ request_id: REQ, claim_token: "tok", lease_expires_at: "2026-01-01T00:00:00+00:00", lease_seconds: leaseSeconds, attempt: 1, request }), { status: 201 });
}

test("heartbeats: a beat without an answer in time is sent again at once, not a lost lease; only 409 ends it", async () => {
  // lease 0.3 s, beats every 100 ms, each given 100 ms. Beats 1-3 hang (as a request waiting
  // for a socket): each is aborted by its own timeout and sent again; then answers come back.
  let beats = 0;
  const fetch = async (url, init) => {
    const path = new URL(url).pathname;
    if (path.endsWith("/claims")) return claimAnswer(0.3);
    if (path.endsWith("/heartbeat")) {
      beats += 1;
      if (beats <= 3) {
        return new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(init.signal.reason), { once: true }));
      }
      if (beats >= 8) return new Response(JSON.stringify({ detail: "gone", code: "lease_lost" }), { status: 409 });
      return new Response(JSON.stringify({ lease_expires_at: "x", cancel_requested: false }), { status: 200 });
    }
    if (path.endsWith("/fail")) return new Response(JSON.stringify({ status: "queued" }), { status: 200 });
    return new Response("{}", { status: 404 });
  };
  const w = new PullWorker({ baseUrl: "http://api.test", apiKey: KEY, workerClass: "t-wc", leader: false, waitSeconds: 0, fetch });
  const seen = [];
  const outcome = await w.runOnce(async (ctx) => {
    await until(() => beats >= 4, "an answered beat after three hung ones", 5_000);
    seen.push(ctx.leaseLost);
    await new Promise((resolve) => ctx.signal.addEventListener("abort", resolve, { once: true }));
    return 1;
  });
  assert.deepEqual(seen, [false]); // three beats without an answer did not end the lease
  assert.equal(outcome, "lease_lost"); // the 409 did
  assert.equal(w.heartbeats.retried, 3);
  assert.equal(w.heartbeats.lost, 1);
  assert.equal(w.heartbeats.answered, beats - 4);
  assert.equal(w.heartbeats.sent, beats);
});

test("heartbeats: on a busy shared wire a beat goes before the other calls waiting", async () => {
  const b = browser(2);
  const order = [];
  const release = gate();
  const fetch = async (url, init) => {
    const path = new URL(url).pathname;
    if (path.endsWith("/claims")) return claimAnswer(0.3);
    order.push(path.split("/").pop());
    if (path.endsWith("/slow")) await release.opened;
    if (path.endsWith("/heartbeat")) return new Response(JSON.stringify({ cancel_requested: false }), { status: 200 });
    return new Response(JSON.stringify({ ok: true }), { status: 200 });
  };
  try {
    const w = new PullWorker({ baseUrl: b.server, apiKey: KEY, workerClass: "t-wc", leader: false, fetch, shareTabs: b.tabs[0] });
    const other = new WorkspaceClient({ baseUrl: b.server, apiKey: KEY, workspaceId: "w", outbox: new MemoryOutbox(), fetch, shareTabs: b.tabs[1] });
    const outcome = await w.runOnce(async (ctx) => {
      // the other tab fills the wire: one slow call on it, five more waiting
      const calls = [other._api.call("GET", "/v1/slow"), ...[1, 2, 3, 4, 5].map((n) => other._api.call("GET", `/v1/q${n}`))];
      await until(() => order.includes("slow"), "the slow call on the wire");
      await until(() => w.heartbeats.sent >= 1, "a beat due", 2_000);
      release.open();
      await Promise.all(calls);
      ctx.check();
      return 1;
    });
    assert.equal(outcome, "succeeded");
    const firstBeat = order.indexOf("heartbeat");
    assert.ok(firstBeat !== -1 && firstBeat <= 2, order.join()); // after the slow call (and at most the one at the wire's door)
    assert.equal(w.heartbeats.lost, 0);
    other.close();
  } finally {
    b.close();
  }
});

test("WorkspaceClient: the tabs of a browser following a workspace hold one event stream; each catches up on a hand-over", async () => {
  const b = browser(3);
  const streams = [];
  const ops = [{ op_id: "o1", clock: 1, op_type: "cell.set", payload: {}, result: null, fence: null, committed_at: "t" }];
  const encoder = new TextEncoder();
  const fetch = async (url, init) => {
    const path = new URL(url).pathname;
    if (path.endsWith("/events")) {
      let controller;
      const body = new ReadableStream({ start: (c) => (controller = c) });
      const stream = { send: (kind, data) => controller.enqueue(encoder.encode(`event: ${kind}\ndata: ${JSON.stringify(data)}\n\n`)) };
      init.signal.addEventListener("abort", () => controller.error(new Error("aborted")), { once: true });
      streams.push(stream);
      queueMicrotask(() => stream.send("ready", { kind: "ready" }));
      return new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } });
    }
    if (path.endsWith("/ops")) {
      const since = Number(new URL(url).searchParams.get("since"));
      return new Response(JSON.stringify({ ops: ops.filter((op) => op.clock > since) }), { status: 200 });
    }
    return new Response(JSON.stringify({ clock: 0, state: {} }), { status: 200 });
  };
  const clients = b.tabs.map((tab) => new WorkspaceClient({ baseUrl: b.server, apiKey: KEY, workspaceId: "w", outbox: new MemoryOutbox(), fetch, shareTabs: tab }));
  try {
    const seen = clients.map(() => []);
    const offs = clients.map((client, n) => client.subscribe("job:j1", (commit) => seen[n].push(commit.clock), { since: 0 }));
    await until(() => seen.every((s) => s.length === 1), "every tab's catch-up");
    assert.equal(streams.length, 1);
    ops.push({ ...ops[0], op_id: "o2", clock: 2 });
    streams[0].send("commit", { kind: "commit", sub_doc: "job:j1", clock: 2 });
    await until(() => seen.every((s) => s.length === 2), "the commit in every tab");
    ops.push({ ...ops[0], op_id: "o3", clock: 3 }); // committed at the hand-over: no event for it
    offs[0](); // the holder's tab stops following: another tab opens the stream
    await until(() => streams.length === 2, "a second holder's stream");
    await until(() => seen[1].length === 3 && seen[2].length === 3, "caught up by clock at the new ready");
    assert.deepEqual(seen.slice(1), [[1, 2, 3], [1, 2, 3]]);
    assert.deepEqual(seen[0], [1, 2]);
    offs[1]();
    offs[2]();
  } finally {
    clients.forEach((c) => c.close());
    b.close();
  }
});

test("PullWorker on a shared wire: claims are short calls (no long poll), tried every claimPollMs", async () => {
  const b = browser(1);
  const claims = [];
  let worker;
  const fetch = async (url, init) => {
    claims.push(JSON.parse(init.body));
    if (claims.length === 3) worker.stop();
    return new Response(null, { status: 204 });
  };
  try {
    worker = new PullWorker({ baseUrl: b.server, apiKey: KEY, workerClass: "t-wc", leader: false, waitSeconds: 20, claimPollMs: 5, fetch, shareTabs: b.tabs[0] });
    assert.equal(await worker.run(async () => assert.fail("nothing is due")), 0);
    assert.equal(claims.length, 3);
    assert.ok(claims.every((body) => !("wait" in body)), JSON.stringify(claims));
    assert.equal(b.tabs[0].stats.sent, 3); // each on the wire
    const alone = new PullWorker({ baseUrl: b.server, apiKey: KEY, workerClass: "t-wc", fetch, shareTabs: b.tabs[0], shareWire: false });
    assert.equal(alone.api.lane, null); // over HTTP/2: the streams are shared, the calls are not
  } finally {
    b.close();
  }
});
