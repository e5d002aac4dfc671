// The pull worker's pure parts under Node's test runner (`node --test onceflow/sdk/js/test/`):
// intervals, leader names, outcome mapping, and computeOnce's decisions against a scripted
// fetch. The real server's behaviour (leases, locks, broadcasts) is proven in Chromium
// (tests/browser/test_sdk_worker.py).

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  Api,
  Cancelled,
  ClaimEvents,
  ClaimLocks,
  LEADER_PREFIX,
  LeaseLost,
  PermanentError,
  PullWorker,
  RetryLater,
  computeOnce,
  extendIntervalMs,
  failOutcome,
  failureOf,
  heartbeatIntervalMs,
  isReleaseOf,
  leaderName,
  whileLeader,
} from "../index.js";

const KEY = "of_test_worker_key_for_node_0123456";

/** A fetch that answers from `routes` ("POST /v1/..." → fn(body) → {status, body} | Response) and records calls. */
function scripted(routes) {
  const calls = [];
  async function fetch(url, init = {}) {
    const path = new URL(url, "http://x").pathname;
    const name = `${init.method} ${path}`;
    const body = init.body ? JSON.parse(init.body) : undefined;
    calls.push({ name, body, auth: init.headers?.Authorization, traceparent: init.headers?.traceparent });
    const route = routes[name];
    if (!route) return new Response(JSON.stringify({ detail: `no route ${name}`, code: "not_found" }), { status: 404 });
    const answer = await route(body, init);
    if (answer instanceof Response) return answer;
    if (answer.status === 204) return new Response(null, { status: 204 });
    return new Response(JSON.stringify(answer.body ?? null), { status: answer.status ?? 200, headers: { "content-type": "application/json" } });
  }
  return { fetch, calls, names: () => calls.map((c) => c.name) };
}

/** An SSE body we feed by hand: `send(kind, data)`, `end()`. */
function sseStream() {
  const encoder = new TextEncoder();
  let controller;
  const body = new ReadableStream({ start: (c) => (controller = c) });
  return {
    response: () => new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } }),
    send(kind, data) {
      controller.enqueue(encoder.encode(`event: ${kind}\ndata: ${JSON.stringify(data)}\n\n`));
    },
    end() {
      controller.close();
    },
  };
}

const REQ = "r".repeat(32);
const CLAIMS = `/v1/claims/${REQ}`;

function claimAnswer(extra = {}) {
  return {
    status: 201,
    body: {
      request_id: REQ,
      claim_token: "secret-claim-token",
      lease_expires_at: "2026-01-01T00:00:00+00:00",
      lease_seconds: 0.06,
      attempt: 1,
      request: { request_id: REQ, workspace_id: "w", job_id: "j1", stage: "s", input: { value: 3 } },
      ...extra,
    },
  };
}

// ----------------------------------------------------------------- pure helpers

test("heartbeats every lease/3", () => {
  assert.equal(heartbeatIntervalMs(6), 2000);
  assert.equal(heartbeatIntervalMs(2), 666);
  assert.equal(heartbeatIntervalMs(0.003), 10); // a floor: never a busy loop
  for (const bad of [0, -1, NaN, "x", undefined]) assert.throws(() => heartbeatIntervalMs(bad), RangeError);
  assert.equal(extendIntervalMs(60_000), 20_000);
});

test("leader names: one per worker class (and server), a given name as is, '-' names refused", () => {
  assert.equal(leaderName("browser"), `${LEADER_PREFIX}browser`);
  assert.equal(leaderName("browser", { baseUrl: "https://api.example/" }), `${LEADER_PREFIX}browser@https://api.example`);
  assert.notEqual(leaderName("a"), leaderName("b"));
  assert.equal(leaderName("browser", { leaderName: "my-app:leader" }), "my-app:leader");
  for (const bad of ["", "-reserved", 3, "x".repeat(501)]) {
    assert.throws(() => leaderName("browser", { leaderName: bad }), TypeError);
  }
  assert.throws(() => leaderName(""), TypeError);
  const worker = new PullWorker({ apiKey: KEY, workerClass: "wc", fetch: async () => {} });
  assert.equal(worker.leaderName, `${LEADER_PREFIX}wc`);
  const loner = new PullWorker({ apiKey: KEY, workerClass: "wc", leader: false, fetch: async () => {} });
  assert.equal(loner.leaderName, null);
});

test("without the Web Locks API there is no election: the body runs at once", async () => {
  const seen = [];
  const result = await whileLeader("n", async () => "ran", { locks: null, onLeader: (l) => seen.push(l) });
  assert.equal(result, "ran");
  assert.deepEqual(seen, [false]);
  // with a Web Locks implementation, the body runs inside the lock request
  const requested = [];
  const locks = { request: async (name, options, fn) => (requested.push([name, options.mode]), fn()) };
  assert.equal(await whileLeader("n2", async () => 7, { locks, onLeader: (l) => seen.push(l) }), 7);
  assert.deepEqual(requested, [["n2", "exclusive"]]);
  assert.deepEqual(seen, [false, true]);
});

test("outcomes: queued again is retry; a handler's error is retryable unless it says otherwise", () => {
  assert.equal(failOutcome({ status: "queued" }), "retry");
  assert.equal(failOutcome({ status: "dead" }), "dead");
  assert.equal(failOutcome({ status: "cancelled" }), "cancelled");
  assert.equal(failureOf(new Error("boom")).retryable, true);
  assert.equal(failureOf(new Error("boom")).error.message, "boom");
  assert.equal(failureOf(Object.assign(new Error("no"), { retryable: false })).retryable, false);
  assert.equal(failureOf(Object.assign(new Error("no"), { permanent: true })).retryable, false);
  class PermanentError extends Error {}
  assert.equal(failureOf(Object.assign(new PermanentError("p"), { name: "PermanentError" })).retryable, false);
  assert.equal(failureOf("a string").error.message, "a string");
  assert.ok(isReleaseOf({ kind: "lock_released", job_id: "j", task: "t", ok: true }, "j", "t"));
  assert.ok(!isReleaseOf({ kind: "lock_released", job_id: "j", task: "u" }, "j", "t"));
  assert.ok(!isReleaseOf({ kind: "commit", job_id: "j", task: "t" }, "j", "t"));
});

test("outcomes: RetryLater carries its delay; retryOn decides the other errors", () => {
  const later = failureOf(new RetryLater(120, "rate limited"));
  assert.deepEqual(later, { error: { type: "RetryLater", message: "rate limited", delay: 120 }, retryable: true });
  assert.equal(failureOf(new RetryLater(-1)).error.delay, null); // the backoff
  assert.equal(failureOf(new RetryLater(NaN)).error.delay, null);
  assert.equal(failureOf(new PermanentError("bad")).retryable, false);
  const onlyTypeErrors = (e) => e instanceof TypeError;
  assert.equal(failureOf(new TypeError("t"), onlyTypeErrors).retryable, true);
  assert.equal(failureOf(new RangeError("r"), onlyTypeErrors).retryable, false);
  assert.equal(failureOf(new RetryLater(5), onlyTypeErrors).retryable, true); // not for retryOn
  assert.equal(failureOf(new Error("e"), () => { throw new Error("x"); }).retryable, true);
  assert.throws(() => new PullWorker({ apiKey: KEY, workerClass: "c", retryOn: 3 }), TypeError);
});

// ----------------------------------------------------------------- runOnce

function worker(routes) {
  const script = scripted(routes);
  const w = new PullWorker({ apiKey: KEY, workerClass: "t-wc", leader: false, waitSeconds: 0, fetch: script.fetch });
  return { w, script };
}

test("runOnce: nothing due is null", async () => {
  const { w, script } = worker({ "POST /v1/worker-classes/t-wc/claims": () => ({ status: 204 }) });
  assert.equal(await w.runOnce(async () => assert.fail("no handler without a claim")), null);
  assert.deepEqual(script.calls[0].body, { worker_id: w.workerId });
  assert.equal(script.calls[0].auth, `Bearer ${KEY}`);
});

test("runOnce: a result completes with the hand-offs; the token only in bodies", async () => {
  const { w, script } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 30 }),
    [`POST ${CLAIMS}/ops`]: (body) => ({ status: 201, body: { op_id: "x", clock: 1, key: body.key } }),
    [`POST ${CLAIMS}/sub-docs`]: (body) => ({ body: { workspace_id: "w", sub_doc: body.sub_doc, clock: 2, state: { cells: { c: 0.5 } } } }),
    [`POST ${CLAIMS}/complete`]: () => ({ body: { status: "succeeded" } }),
  });
  const outcome = await w.runOnce(async (ctx) => {
    assert.deepEqual(ctx.input, { value: 3 });
    assert.deepEqual((await ctx.readSubDoc("job:j1")).state, { cells: { c: 0.5 } });
    assert.equal(ctx.attempt, 1);
    assert.equal(ctx.requestId, REQ);
    assert.ok(!JSON.stringify(ctx.claim).includes("secret-claim-token")); // not enumerable
    await ctx.applyOp("job:j1", { type: "cell.set", column: "c", value: 1 }, { key: "cell:c" });
    ctx.then("next", { a: 1 }, { branchPath: "b" });
    return { done: 3 };
  });
  assert.equal(outcome, "succeeded");
  const complete = script.calls.find((c) => c.name.endsWith("/complete"));
  assert.deepEqual(complete.body, { claim_token: "secret-claim-token", workspace_id: "w", result: { done: 3 }, then: [{ stage: "next", input: { a: 1 }, branch_path: "b" }] });
  const read = script.calls.find((c) => c.name.endsWith("/sub-docs"));
  assert.deepEqual(read.body, { claim_token: "secret-claim-token", workspace_id: "w", sub_doc: "job:j1" });
  const op = script.calls.find((c) => c.name.endsWith("/ops"));
  assert.equal(op.body.key, "cell:c");
  assert.ok(script.calls.every((c) => !c.name.includes("secret")));
});

test("every later call of a claim names its request's workspace (the claim answer's request.workspace_id)", async () => {
  let beaten;
  const beat = new Promise((resolve) => (beaten = resolve));
  const { w, script } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 0.06 }),
    [`POST ${CLAIMS}/heartbeat`]: () => (beaten(), { body: { cancel_requested: false } }),
    [`POST ${CLAIMS}/ops`]: () => ({ status: 201, body: { op_id: "x", clock: 1 } }),
    [`POST ${CLAIMS}/sub-docs`]: () => ({ body: { workspace_id: "w", sub_doc: "d", clock: 0, state: {} } }),
    [`POST ${CLAIMS}/locks`]: () => ({ status: 201, body: { acquired: true, locked: false, lock_token: "lt", ttl_ms: 60_000 } }),
    [`POST ${CLAIMS}/locks/extend`]: () => ({ body: { held: true } }),
    [`POST ${CLAIMS}/locks/release`]: () => ({ body: { released: true } }),
    [`POST ${CLAIMS}/events`]: () => {
      const sse = sseStream();
      sse.send("ready", {});
      return sse.response();
    },
    [`POST ${CLAIMS}/fail`]: () => ({ body: { status: "queued" } }),
  });
  const outcome = await w.runOnce(async (ctx) => {
    assert.equal(ctx.claim.workspaceId, "w");
    await beat;
    await ctx.applyOp("d", { type: "cell.set", column: "c", value: 1 }, { key: "k" });
    await ctx.readSubDoc("d");
    const sub = await ctx.events.subscribe();
    sub.close();
    await ctx.locks.acquire("eval:fit");
    await ctx.locks.extend("eval:fit", "lt");
    await ctx.locks.release("eval:fit", "lt", "computed");
    throw new Error("fail too");
  });
  assert.equal(outcome, "retry");
  const onClaim = script.calls.filter((c) => c.name.startsWith(`POST ${CLAIMS}/`));
  const actions = new Set(onClaim.map((c) => c.name.slice(`POST ${CLAIMS}/`.length)));
  assert.deepEqual([...actions].sort(), ["events", "fail", "heartbeat", "locks", "locks/extend", "locks/release", "ops", "sub-docs"]);
  for (const call of onClaim) assert.equal(call.body.workspace_id, "w", call.name);
  // a claim answer without one (an older server): the calls name the request by its id alone
  const older = worker({
    "POST /v1/worker-classes/t-wc/claims": () => {
      const answer = claimAnswer({ lease_seconds: 30 });
      delete answer.body.request.workspace_id;
      return answer;
    },
    [`POST ${CLAIMS}/complete`]: () => ({ body: { status: "succeeded" } }),
  });
  assert.equal(await older.w.runOnce(async () => 1), "succeeded");
  assert.deepEqual(older.script.calls.at(-1).body, { claim_token: "secret-claim-token", result: 1, then: [] });
});

test("a claim's calls carry its stored trace context as traceparent (none without one)", async () => {
  const parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  let beaten;
  const beat = new Promise((resolve) => (beaten = resolve));
  const { w, script } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 0.06, trace_context: `${parent}\nvendor=abc` }),
    [`POST ${CLAIMS}/heartbeat`]: () => (beaten(), { body: { cancel_requested: false } }),
    [`POST ${CLAIMS}/ops`]: () => ({ status: 201, body: { op_id: "x", clock: 1 } }),
    [`POST ${CLAIMS}/locks`]: () => ({ status: 201, body: { acquired: true, locked: false, lock_token: "lt", ttl_ms: 60_000 } }),
    [`POST ${CLAIMS}/locks/extend`]: () => ({ body: { held: true } }),
    [`POST ${CLAIMS}/locks/release`]: () => ({ body: { released: true } }),
    [`POST ${CLAIMS}/fail`]: () => ({ body: { status: "queued" } }),
  });
  const outcome = await w.runOnce(async (ctx) => {
    assert.equal(ctx.claim.traceContext, `${parent}\nvendor=abc`);
    await beat;
    await ctx.applyOp("d", { type: "cell.set", column: "c", value: 1 }, { key: "k" });
    await ctx.locks.acquire("eval:fit");
    await ctx.locks.extend("eval:fit", "lt");
    await ctx.locks.release("eval:fit", "lt", "computed");
    throw new Error("fail too");
  });
  assert.equal(outcome, "retry");
  const onClaim = script.calls.filter((c) => c.name.startsWith(`POST ${CLAIMS}/`));
  const actions = new Set(onClaim.map((c) => c.name.slice(`POST ${CLAIMS}/`.length)));
  assert.deepEqual([...actions].sort(), ["fail", "heartbeat", "locks", "locks/extend", "locks/release", "ops"]);
  for (const call of onClaim) assert.equal(call.traceparent, parent, call.name);
  assert.equal(script.calls[0].traceparent, undefined); // the claim itself: no trace yet
  const untraced = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 30, trace_context: null }),
    [`POST ${CLAIMS}/complete`]: () => ({ body: { status: "succeeded" } }),
  });
  assert.equal(await untraced.w.runOnce(async () => 1), "succeeded");
  assert.equal(untraced.script.calls.at(-1).traceparent, undefined);
});

test("runOnce: an error fails retryable (retry) or permanent (dead)", async () => {
  const failed = [];
  const { w } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 30 }),
    [`POST ${CLAIMS}/fail`]: (body) => (failed.push(body), { body: { status: body.retryable ? "queued" : "dead" } }),
  });
  assert.equal(await w.runOnce(async () => { throw new Error("flaky"); }), "retry");
  assert.equal(await w.runOnce(async () => { throw Object.assign(new Error("bad input"), { retryable: false }); }), "dead");
  assert.deepEqual(failed.map((f) => [f.retryable, f.error.message]), [[true, "flaky"], [false, "bad input"]]);
});

test("runOnce: a completion answered 409 lease_lost (e.g. a retry after a lost answer) is lease_lost", async () => {
  const { w } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 30 }),
    [`POST ${CLAIMS}/complete`]: () => ({ status: 409, body: { detail: "gone", code: "lease_lost" } }),
  });
  assert.equal(await w.runOnce(async () => 1), "lease_lost");
});

test("heartbeats every lease/3; the first 409 lease_lost aborts ctx.signal and nothing more is written", async () => {
  let beats = 0;
  const { w, script } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 0.06 }),
    [`POST ${CLAIMS}/heartbeat`]: () => (++beats < 3 ? { body: { cancel_requested: false } } : { status: 409, body: { detail: "gone", code: "lease_lost" } }),
  });
  const outcome = await w.runOnce(async (ctx) => {
    await new Promise((resolve) => ctx.signal.addEventListener("abort", resolve, { once: true }));
    assert.ok(ctx.signal.reason instanceof LeaseLost);
    assert.ok(ctx.leaseLost);
    assert.throws(() => ctx.check(), LeaseLost);
    await assert.rejects(ctx.applyOp("job:j1", { type: "cell.set", column: "c", value: 1 }, { key: "k" }), LeaseLost);
    return "late";
  });
  assert.equal(outcome, "lease_lost");
  assert.equal(beats, 3);
  assert.ok(!script.names().some((n) => n.endsWith("/ops") || n.endsWith("/complete") || n.endsWith("/fail")));
});

test("cancel_requested stops the stage: ctx.signal aborts with Cancelled, failed not retryable", async () => {
  let failBody = null;
  const { w } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 0.06 }),
    [`POST ${CLAIMS}/heartbeat`]: () => ({ body: { cancel_requested: true } }),
    [`POST ${CLAIMS}/fail`]: (body) => ((failBody = body), { body: { status: "cancelled" } }),
  });
  const outcome = await w.runOnce(async (ctx) => {
    await new Promise((resolve) => ctx.signal.addEventListener("abort", resolve, { once: true }));
    assert.ok(ctx.signal.reason instanceof Cancelled);
    ctx.check();
  });
  assert.equal(outcome, "cancelled");
  assert.deepEqual([failBody.retryable, failBody.error.type], [false, "Cancelled"]);
});

// ----------------------------------------------------------------- computeOnce

/** computeOnce against scripted lock routes; `events` is an SSE body (or a 503). */
function cell({ acquire, extend = () => ({ body: { held: true } }), events, stored = () => null }) {
  const log = [];
  const script = scripted({
    [`POST ${CLAIMS}/locks`]: (body) => (log.push("acquire"), acquire(body)),
    [`POST ${CLAIMS}/locks/extend`]: (body) => (log.push("extend"), extend(body)),
    [`POST ${CLAIMS}/locks/release`]: (body) => (log.push(`release:${body.outcome}`), { body: { released: true } }),
    [`POST ${CLAIMS}/events`]: () => (log.push("events"), events ? events.response() : { status: 503, body: { detail: "down", code: "unavailable" } }),
  });
  const api = new Api("", { apiKey: KEY, fetch: script.fetch });
  const locks = new ClaimLocks(api, REQ, "tok");
  const eventsClient = new ClaimEvents(api, REQ, "tok");
  const hooks = {
    check: async () => (log.push("check"), stored()),
    compute: async () => (log.push("compute"), 42),
    store: async (v) => log.push(`store:${v}`),
  };
  const run = (extra = {}) => computeOnce("eval:fit", { locks, events: eventsClient, jobId: "j1", ...hooks, ...extra });
  return { log, run, script, eventsClient };
}

const ACQUIRED = { status: 201, body: { acquired: true, locked: false, lock_token: "lt", ttl_ms: 60_000 } };
const locked = (ms) => ({ status: 200, body: { acquired: false, locked: true, remaining_ms: ms } });

test("computeOnce: a stored value returns at the pre-flight, no lock call", async () => {
  const { log, run, script } = cell({ acquire: () => assert.fail(), stored: () => 7 });
  assert.deepEqual(await run(), { value: 7, path: "preflight", rounds: 0 });
  assert.deepEqual(log, ["check"]);
  assert.equal(script.calls.length, 0);
});

test("computeOnce: holding the lock, compute, store, release computed", async () => {
  const { log, run } = cell({ acquire: () => ACQUIRED });
  const out = await run();
  assert.deepEqual([out.value, out.path], [42, "computed"]);
  assert.deepEqual(log, ["check", "acquire", "check", "compute", "extend", "store:42", "release:computed"]);
});

test("computeOnce: the double-check finds it stored: no compute, release double_check", async () => {
  let n = 0;
  const { log, run } = cell({ acquire: () => ACQUIRED, stored: () => (n++ === 0 ? null : 5) });
  assert.deepEqual(await run(), { value: 5, path: "double_check", rounds: 1 });
  assert.deepEqual(log, ["check", "acquire", "check", "release:double_check"]);
});

test("computeOnce: a compute that throws releases as failed and rethrows", async () => {
  const { log, run } = cell({ acquire: () => ACQUIRED });
  await assert.rejects(run({ compute: async () => { throw new Error("provider down"); } }), /provider down/);
  assert.deepEqual(log.slice(-1), ["release:failed"]);
  assert.ok(!log.some((x) => x.startsWith("store")));
});

test("computeOnce: locked → listen FIRST, re-check, wait for the broadcast; never computes", async () => {
  const sse = sseStream();
  let value = null;
  const { log, run } = cell({ acquire: () => locked(60_000), events: sse, stored: () => value });
  const waits = [];
  const pending = run({ onWait: (w) => waits.push(w) });
  // the stream opens, says ready; then an unrelated release (checked, ignored), then the commit
  setTimeout(() => sse.send("ready", {}), 5);
  setTimeout(() => sse.send("lock_released", { kind: "lock_released", job_id: "j1", task: "eval:other", ok: true }), 20);
  setTimeout(() => {
    value = 9;
    sse.send("commit", { kind: "commit", sub_doc: "job:j1", clock: 3 });
  }, 40);
  const out = await pending;
  assert.deepEqual([out.value, out.path, out.servedBy], [9, "waited", "broadcast"]);
  assert.deepEqual(log, ["check", "acquire", "events", "check", "acquire", "check", "check"]);
  assert.deepEqual(waits, [{ task: "eval:fit", remainingMs: 60_000 }]);
  assert.ok(!log.includes("compute"));
});

test("computeOnce: locked, but the re-check after subscribing finds it: waited (recheck)", async () => {
  const sse = sseStream();
  let n = 0;
  const { log, run } = cell({ acquire: () => locked(60_000), events: sse, stored: () => (n++ === 0 ? null : 4) });
  setTimeout(() => sse.send("ready", {}), 5);
  const out = await run();
  assert.deepEqual([out.value, out.path, out.servedBy], [4, "waited", "recheck"]);
  assert.deepEqual(log, ["check", "acquire", "events", "check"]);
});

test("computeOnce: the holder failed (ok=false, nothing stored): try again, lead, compute once", async () => {
  const sse = sseStream();
  let acquires = 0;
  const { log, run } = cell({ acquire: () => (++acquires <= 2 ? locked(60_000) : ACQUIRED), events: sse });
  setTimeout(() => sse.send("ready", {}), 5);
  setTimeout(() => sse.send("lock_released", { kind: "lock_released", job_id: "j1", task: "eval:fit", ok: false }), 20);
  const out = await run();
  assert.deepEqual([out.value, out.path, out.rounds], [42, "computed", 3]);
  assert.deepEqual(log, ["check", "acquire", "events", "check", "acquire", "check", "acquire", "check", "compute", "extend", "store:42", "release:computed"]);
});

test("computeOnce: a silent holder's TTL runs out: one more acquire after remaining_ms, no polling", async () => {
  const sse = sseStream();
  let acquires = 0;
  const { log, run } = cell({ acquire: () => (++acquires <= 2 ? locked(30) : ACQUIRED), events: sse });
  setTimeout(() => sse.send("ready", {}), 5);
  const out = await run({ waitMarginMs: 5 });
  assert.equal(out.path, "computed");
  assert.equal(log.filter((x) => x === "acquire").length, 3); // first, after subscribing, after the TTL
  assert.equal(log.filter((x) => x === "events").length, 1);
});

test("computeOnce: concurrent waiters of one claim share one event stream", async () => {
  const sse = sseStream();
  let value = null;
  const { run, eventsClient, script } = cell({ acquire: () => locked(60_000), events: sse, stored: () => value });
  const both = Promise.all([run(), run()]);
  setTimeout(() => sse.send("ready", {}), 10);
  setTimeout(() => ((value = 1), sse.send("commit", { kind: "commit" })), 30);
  const outs = await both;
  assert.deepEqual(outs.map((o) => o.path), ["waited", "waited"]);
  assert.equal(eventsClient.opened, 1);
  assert.equal(script.calls.filter((c) => c.name.endsWith("/events")).length, 1);
});

test("computeOnce: the claim is gone at the acquire: LeaseLost, no compute", async () => {
  const { log, run } = cell({ acquire: () => ({ status: 409, body: { detail: "gone", code: "lease_lost" } }) });
  await assert.rejects(run(), LeaseLost);
  assert.ok(!log.includes("compute"));
});

test("computeOnce: bad arguments are refused before any call", async () => {
  const { run, script } = cell({ acquire: () => ACQUIRED });
  await assert.rejects(run({ compute: undefined }), TypeError);
  await assert.rejects(computeOnce("", {}), TypeError);
  assert.equal(script.calls.length, 0);
});

/** `promise`'s value, or `fallback` if it has not settled within `ms` (a deadline, not a measure). */
function within(promise, ms, fallback) {
  let timer;
  const late = new Promise((resolve) => (timer = setTimeout(() => resolve(fallback), ms)));
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

test("heartbeats: a beat that hangs is dropped at the next slot (its timeout ≤ lease/3), the next goes out on time", async () => {
  // The worker's API timeout is the default 30 s; the lease 60 ms (beats every 20 ms). The first
  // beat never answers: the second must not wait for it (else the lease lapses while the
  // network is back).
  let beats = 0;
  let firstAbort = null; // the hung beat's abort reason, once aborted
  let abortedBeforeSecond = null;
  let second;
  const secondBeat = new Promise((resolve) => (second = resolve));
  const { w } = worker({
    "POST /v1/worker-classes/t-wc/claims": () => claimAnswer({ lease_seconds: 0.06 }),
    [`POST ${CLAIMS}/heartbeat`]: (_body, init) => {
      beats += 1;
      if (beats === 1) {
        return new Promise((_, reject) =>
          init.signal.addEventListener("abort", () => ((firstAbort = init.signal.reason), reject(init.signal.reason)), { once: true }),
        );
      }
      if (beats === 2) (abortedBeforeSecond = firstAbort !== null), second();
      return { body: { cancel_requested: false } };
    },
    [`POST ${CLAIMS}/complete`]: () => ({ body: { status: "succeeded" } }),
  });
  let sent = false;
  const outcome = await w.runOnce(async () => {
    sent = await within(secondBeat.then(() => true), 5_000, false); // 250 intervals
    return 1;
  });
  assert.equal(outcome, "succeeded");
  assert.ok(sent, "a second heartbeat went out while the first one hung");
  assert.equal(abortedBeforeSecond, true);
  assert.equal(firstAbort?.message, "timeout"); // by its own (slot) timeout, not by the stage's end
});

test("computeOnce: a release missed before the stream was live: acquire again at once, no TTL wait", async () => {
  // The holder released (failed, nothing stored) between our first acquire and our stream's
  // ready: no broadcast will come. The acquire after subscribing finds the lock free.
  const sse = sseStream();
  let acquires = 0;
  const { log, run } = cell({ acquire: () => (++acquires === 1 ? locked(300) : ACQUIRED), events: sse });
  setTimeout(() => sse.send("ready", {}), 5);
  const waits = [];
  const out = await run({ onWait: (info) => waits.push(info) });
  assert.deepEqual(waits, []); // never waited out the first answer's remaining_ms
  assert.deepEqual([out.value, out.path, out.rounds], [42, "computed", 2]);
  assert.deepEqual(log, ["check", "acquire", "events", "check", "acquire", "check", "compute", "extend", "store:42", "release:computed"]);
});

test("computeOnce: the lock watchdog keeps extending after a failed extend (no answer / 5xx)", async () => {
  // TTL 60 ms: an extend every 20 ms. The first extend fails (503 twice: its retry too); the
  // watchdog must try again at the next third, not stop for good.
  let extends_ = 0;
  let third;
  const thirdExtend = new Promise((resolve) => (third = resolve));
  const { log, run } = cell({
    acquire: () => ({ status: 201, body: { acquired: true, locked: false, lock_token: "lt", ttl_ms: 60 } }),
    extend: () => {
      extends_ += 1;
      if (extends_ <= 2) return { status: 503, body: { detail: "blip", code: "unavailable" } };
      if (extends_ === 3) third();
      return { body: { held: true } };
    },
  });
  let extendedAfterBlip = false;
  const out = await run({
    compute: async () => {
      extendedAfterBlip = await within(thirdExtend.then(() => true), 5_000, false);
      return 42;
    },
  });
  assert.ok(extendedAfterBlip, "the watchdog extended again after the failed extend");
  assert.equal(out.path, "computed");
  assert.deepEqual(log.slice(-2), ["store:42", "release:computed"]);
});

test("computeOnce: stopped before compute() (guard or double-check throws) releases 'abandoned'; compute/store throwing is 'failed'", async () => {
  // the stage must stop after the acquire: guard() throws before the provider call
  let stop = false;
  let checks = 0;
  const a = cell({ acquire: () => ACQUIRED, stored: () => (++checks === 2 ? ((stop = true), null) : null) });
  await assert.rejects(a.run({ guard: () => { if (stop) throw new LeaseLost("gone"); } }), LeaseLost);
  assert.ok(!a.log.includes("compute"));
  assert.equal(a.log.at(-1), "release:abandoned");
  // the double-check's read throws
  let reads = 0;
  const b = cell({ acquire: () => ACQUIRED });
  await assert.rejects(b.run({ check: async () => { if (++reads === 2) throw new Error("read failed"); return null; } }), /read failed/);
  assert.equal(b.log.at(-1), "release:abandoned");
  // store() throws after a paid compute: failed
  const c = cell({ acquire: () => ACQUIRED });
  await assert.rejects(c.run({ store: async () => { throw new Error("store failed"); } }), /store failed/);
  assert.ok(c.log.includes("compute"));
  assert.equal(c.log.at(-1), "release:failed");
});

test("ClaimEvents: `event: end` ends the claim's stream for good; a stream closed otherwise opens again", async () => {
  const streams = [];
  const script = scripted({
    [`POST ${CLAIMS}/events`]: () => {
      const sse = sseStream();
      streams.push(sse);
      sse.send("ready", {});
      return sse.response();
    },
  });
  const events = new ClaimEvents(new Api("", { apiKey: KEY, fetch: script.fetch }), REQ, "tok");
  // a stream that closes without `end` (a server restart): the next subscribe opens it again
  const first = await events.subscribe();
  streams[0].end();
  assert.equal(await first.next(5_000), null);
  assert.equal(first.ended, "ended");
  first.close();
  const second = await events.subscribe();
  assert.equal(second.ended, null);
  assert.equal(events.opened, 2);
  // the server ends it: the claim is over
  streams[1].send("end", { kind: "end", reason: "claim_ended" });
  assert.equal(await second.next(5_000), null); // not a message: the end of the stream
  assert.equal(second.ended, "claim_ended");
  second.close();
  const third = await events.subscribe();
  assert.equal(third.ended, "claim_ended");
  assert.equal(await third.next(10), null); // a dead subscription waits out its timeout (the TTL)
  third.close();
  assert.equal(events.opened, 2); // never opened again
  assert.equal(script.calls.length, 2);
});

test("run: a transport error backs off and goes on; stop() ends the loop during a long poll", async () => {
  let claims = 0;
  const ran = [];
  let worker;
  const script = scripted({
    "POST /v1/worker-classes/t-wc/claims": async (body, init) => {
      claims += 1;
      if (claims === 1) throw new TypeError("connection refused"); // no answer: NetworkError
      if (claims === 2) return claimAnswer({ lease_seconds: 30 });
      // a long poll: held until the worker stops (the abort reaches fetch)
      return new Promise((_, reject) => init.signal.addEventListener("abort", () => reject(new Error("aborted")), { once: true }));
    },
    [`POST ${CLAIMS}/complete`]: () => ({ body: { status: "succeeded" } }),
  });
  worker = new PullWorker({ apiKey: KEY, workerClass: "t-wc", leader: false, waitSeconds: 1, fetch: script.fetch, onOutcome: (o) => (ran.push(o), setTimeout(() => worker.stop(), 20)) });
  const runs = await worker.run(async (ctx) => ctx.input.value);
  assert.equal(runs, 1);
  assert.deepEqual(ran, ["succeeded"]);
  assert.equal(claims, 3);
  assert.deepEqual(script.calls.find((c) => c.name.endsWith("/complete")).body.result, 3);
});

test("run: a refused key rejects (not retried forever)", async () => {
  const script = scripted({ "POST /v1/worker-classes/t-wc/claims": () => ({ status: 401, body: { detail: "bad key", code: "unauthorized" } }) });
  const worker = new PullWorker({ apiKey: KEY, workerClass: "t-wc", leader: false, fetch: script.fetch });
  await assert.rejects(worker.run(async () => 1), (e) => e.status === 401);
  assert.equal(script.calls.length, 1);
});
