// The WorkspaceClient's send logic under Node, driven by a scripted fetch (a test double of the
// network for the pure logic only; the real server is exercised in Chromium, tests/browser).
import { test } from "node:test";
import assert from "node:assert/strict";
import { HttpError, MemoryOutbox, WorkspaceClient } from "../index.js";

const BACKOFF = { baseMs: 1, capMs: 2 };

/** A fetch that answers each POST with the next scripted reply; every call is recorded. */
function scripted(replies) {
  const calls = [];
  const fetch = async (url, init) => {
    const call = { url, method: init.method, body: init.body ? JSON.parse(init.body) : null, auth: init.headers.Authorization };
    calls.push(call);
    if (init.method === "GET") return Response.json({ clock: 4, state: {} });
    const reply = replies.shift();
    if (reply === undefined) throw new Error("no more scripted replies");
    if (reply === "offline") throw new TypeError("Failed to fetch");
    const { status, body = {}, headers = {} } = typeof reply === "function" ? reply(call) : reply;
    return new Response(JSON.stringify(body), { status, headers: { "Content-Type": "application/json", ...headers } });
  };
  return { fetch, calls };
}

function ok(call, extra = {}) {
  return { status: 201, body: { op_id: call.body.op_id, clock: 11, duplicate: false, applied: true, result: null, error: null, ...extra } };
}

function client(fetch, outbox = new MemoryOutbox()) {
  return new WorkspaceClient({ apiKey: "k_test", workspaceId: "w1", fetch, outbox, backoff: BACKOFF, baseUrl: "http://x" });
}

test("retries under the same op id and base clock until an answer, then leaves the outbox", async () => {
  let n = 0;
  const answer = (call) => ({ status: 201, body: { op_id: call.body.op_id, clock: 5, duplicate: false, applied: true, result: { n: ++n }, error: null } });
  const { fetch, calls } = scripted(["offline", { status: 503 }, { status: 429, headers: { "Retry-After": "0" } }, "offline", answer]);
  const c = client(fetch);
  await c.read("doc"); // the tab has seen the sub-doc at clock 4
  const got = await c.applyOp("doc", { type: "cell.set", column: "c", value: 1 });
  const posts = calls.filter((call) => call.method === "POST");
  assert.equal(posts.length, 5);
  assert.equal(new Set(posts.map((p) => p.body.op_id)).size, 1);
  assert.deepEqual(new Set(posts.map((p) => p.body.base_clock)), new Set([4])); // kept on retries
  assert.equal(got.opId, posts[0].body.op_id);
  assert.equal(got.clock, 5);
  assert.deepEqual(await c.pending(), []);
  assert.equal(c.clockOf("doc"), 5);
  assert.equal(posts[0].auth, "Bearer k_test");
  assert.ok(!posts[0].url.includes("k_test"));
  c.close();
});

test("ops are sent one at a time in the order they were applied, across sub-docs", async () => {
  let inFlight = 0;
  let most = 0;
  const slow = (call) => { inFlight++; most = Math.max(most, inFlight); return { status: 201, body: { op_id: call.body.op_id, clock: 1, duplicate: false, applied: true, result: null, error: null } }; };
  const replies = [];
  for (let i = 0; i < 6; i++) replies.push(i % 2 ? "offline" : slow);
  replies.push(slow, slow, slow);
  const { fetch, calls } = scripted(replies);
  const wrapped = async (url, init) => { const r = await fetch(url, init); inFlight = Math.max(0, inFlight - 1); return r; };
  const c = client(wrapped);
  const docs = ["a", "b", "a", "c", "b"];
  const answers = await Promise.all(docs.map((d, i) => c.applyOp(d, { type: "cell.set", column: "c", value: i }, { baseClock: i })));
  const posts = calls.filter((call) => call.method === "POST");
  // each op's attempts come before the next op's first attempt
  const order = [...new Set(posts.map((p) => p.body.op_id))];
  assert.deepEqual(order, answers.map((a) => a.opId));
  assert.deepEqual(posts.filter((p, i) => i === 0 || posts[i - 1].body.op_id !== p.body.op_id).map((p) => p.body.op.value), [0, 1, 2, 3, 4]);
  assert.deepEqual(order.map((id) => posts.find((p) => p.body.op_id === id).body.base_clock), [0, 1, 2, 3, 4]);
  assert.equal(most, 1);
  c.close();
});

test("a refusal removes the op and rejects with HttpError; the next op still goes", async () => {
  const { fetch } = scripted([
    { status: 409, body: { detail: "op id used with another payload", code: "op_id_conflict" } },
    { status: 422, body: { detail: "bad op", code: "invalid_request" } },
    (call) => ok(call, { clock: 3 }),
  ]);
  const c = client(fetch);
  const refused = [];
  c.on("refused", (d) => refused.push(d.error.code));
  const first = c.applyOp("d", { type: "cell.set", column: "c", value: 1 }, { baseClock: 0 });
  const second = c.applyOp("d", { type: "nope" }, { baseClock: 0 });
  const third = c.applyOp("d", { type: "cell.set", column: "c", value: 2 }, { baseClock: 0 });
  await assert.rejects(first, (e) => e instanceof HttpError && e.status === 409 && e.code === "op_id_conflict");
  await assert.rejects(second, (e) => e instanceof HttpError && e.status === 422);
  assert.equal((await third).clock, 3);
  assert.deepEqual(refused, ["op_id_conflict", "invalid_request"]);
  assert.deepEqual(await c.pending(), []);
  c.close();
});

test("401 keeps the op and retries it; setApiKey lets it through", async () => {
  const { fetch, calls } = scripted([{ status: 401, body: { detail: "bad key", code: "unauthorized" } }, { status: 401 }, (call) => ok(call)]);
  const c = client(fetch);
  let told = 0;
  c.on("unauthorized", () => { told++; if (told === 2) c.setApiKey("k_new"); });
  const got = await c.applyOp("d", { type: "cell.set", column: "c", value: 1 }, { baseClock: 0 });
  assert.equal(got.applied, true);
  assert.equal(calls.at(-1).auth, "Bearer k_new");
  assert.equal(told, 2);
  c.close();
});

test("start() replays what an earlier page load left, in seq order, with stored ids", async () => {
  const outbox = new MemoryOutbox();
  const ns = "default@w1";
  await outbox.add(ns, { opId: "left_by_earlier_load_1", subDoc: "d", op: { type: "cell.clear", column: "x" }, baseClock: 7 });
  await outbox.add(ns, { opId: "left_by_earlier_load_2", subDoc: "e", op: { type: "cell.clear", column: "y" }, baseClock: 2 });
  await outbox.add("other@w1", { opId: "another_namespace_op", subDoc: "d", op: { type: "cell.clear", column: "z" }, baseClock: 0 });
  const { fetch, calls } = scripted([(call) => ok(call, { duplicate: true, clock: 8 }), (call) => ok(call)]);
  const c = client(fetch, outbox);
  const applied = [];
  const done = new Promise((resolve) => c.on("applied", (d) => { applied.push(d); if (applied.length === 2) resolve(); }));
  await c.start();
  await done;
  assert.deepEqual(calls.map((call) => [call.body.op_id, call.body.base_clock]), [["left_by_earlier_load_1", 7], ["left_by_earlier_load_2", 2]]);
  assert.deepEqual(applied.map((d) => [d.opId, d.duplicate, d.clock]), [["left_by_earlier_load_1", true, 8], ["left_by_earlier_load_2", false, 11]]);
  assert.deepEqual((await outbox.list("other@w1")).map((e) => e.opId), ["another_namespace_op"]);
  c.close();
});

test("bad input is refused before anything is stored or sent", async () => {
  const { fetch, calls } = scripted([]);
  const c = client(fetch);
  for (const [subDoc, op, opts] of [["", { type: "cell.set" }], ["d", null], ["d", [1]], ["d", "cell.set"], ["d", {}], ["d", { type: "x" }, { baseClock: -1 }], ["a\u0000b", { type: "x" }]]) {
    await assert.rejects(c.applyOp(subDoc, op, opts), TypeError);
  }
  assert.deepEqual(await c.pending(), []);
  assert.equal(calls.length, 0);
  c.close();
});

test("close() rejects waiting ops and keeps them in the outbox", async () => {
  const { fetch } = scripted(Array(1000).fill("offline"));
  const outbox = new MemoryOutbox();
  const c = client(fetch, outbox);
  const waiting = c.applyOp("d", { type: "cell.set", column: "c", value: 1 }, { baseClock: 1 });
  await new Promise((r) => setTimeout(r, 20));
  c.close();
  await assert.rejects(waiting, (e) => e.name === "Aborted");
  assert.equal((await outbox.list("default@w1")).length, 1);
});

test("MemoryOutbox keeps seq order per namespace and returns copies", async () => {
  const box = new MemoryOutbox();
  const a = await box.add("n", { opId: "1" });
  const b = await box.add("n", { opId: "2" });
  await box.add("m", { opId: "x" });
  assert.deepEqual([a.seq, b.seq], [1, 2]);
  await box.delete("n", 1);
  const c = await box.add("n", { opId: "3" });
  assert.equal(c.seq, 3);
  const list = await box.list("n");
  assert.deepEqual(list.map((e) => e.opId), ["2", "3"]);
  list[0].opId = "changed";
  assert.equal((await box.list("n", 1))[0].opId, "2");
});

test("ops on a sub-doc never seen keep their call order and carry base clock 0", async () => {
  const { fetch, calls } = scripted([ok, ok, ok].map((f) => (call) => f(call)));
  const c = client(fetch);
  const answers = await Promise.all([1, 2, 3].map((v) => c.applyOp("fresh", { type: "cell.set", column: "c", value: v })));
  const posts = calls.filter((call) => call.method === "POST");
  assert.deepEqual(posts.map((p) => p.body.op.value), [1, 2, 3]);
  assert.deepEqual(posts.map((p) => p.body.base_clock), [0, 0, 0]); // minted unseen: 0, not null
  assert.equal(calls.filter((call) => call.method === "GET").length, 0); // stored at once, no read first
  assert.equal(answers.length, 3);
  c.close();
});

const TOO_OLD = { status: 409, body: { detail: "older than the horizon", code: "replay_too_old", horizon: 7 } };

test("a first op never sent, refused as too old, is re-based on the horizon and sent again", async () => {
  const { fetch, calls } = scripted([TOO_OLD, (call) => ok(call, { clock: 8 })]);
  const c = client(fetch);
  const got = await c.applyOp("pruned", { type: "cell.set", column: "c", value: 1 });
  const posts = calls.filter((call) => call.method === "POST");
  assert.deepEqual(posts.map((p) => [p.body.op_id, p.body.base_clock]), [[got.opId, 0], [got.opId, 7]]);
  assert.equal(got.clock, 8);
  assert.equal(c.clockOf("pruned"), 8);
  assert.deepEqual(await c.pending(), []);
  c.close();
});

test("a first op whose answer was lost, refused as too old on its retry, is refused: never applied twice", async () => {
  const { fetch, calls } = scripted(["offline", TOO_OLD]);
  const c = client(fetch);
  const refused = [];
  c.on("refused", (d) => refused.push(d.error.code));
  const sent = c.applyOp("pruned", { type: "cell.set", column: "c", value: 1 });
  await assert.rejects(sent, (e) => e instanceof HttpError && e.status === 409 && e.code === "replay_too_old");
  const posts = calls.filter((call) => call.method === "POST");
  assert.deepEqual(posts.map((p) => p.body.base_clock), [0, 0]); // the same op, not re-based
  assert.deepEqual(refused, ["replay_too_old"]);
  c.close();
});

test("an op left by an earlier page load, refused as too old, is refused, not re-based", async () => {
  const outbox = new MemoryOutbox();
  await outbox.add("default@w1", { opId: "left_by_earlier_load_1", subDoc: "d", op: { type: "cell.clear", column: "x" }, baseClock: 0 });
  const { fetch, calls } = scripted([TOO_OLD]);
  const c = client(fetch, outbox);
  const refused = new Promise((resolve) => c.on("refused", resolve));
  await c.start();
  assert.equal((await refused).error.code, "replay_too_old");
  assert.deepEqual(calls.map((call) => call.body.base_clock), [0]);
  c.close();
});

/** A MemoryOutbox whose `method` throws on the calls numbered in `failOn` (1-based). */
function flaky(method, failOn) {
  const box = new MemoryOutbox();
  const real = box[method].bind(box);
  let n = 0;
  box[method] = async (...args) => {
    if (failOn.includes(++n)) throw new DOMException("The transaction was aborted", "AbortError");
    return real(...args);
  };
  return box;
}

test("an outbox delete that fails is retried; the answered op resolves once and is not resent", async () => {
  const { fetch, calls } = scripted([(call) => ok(call, { clock: 1 }), (call) => ok(call, { clock: 2 })]);
  const c = client(fetch, flaky("delete", [1, 2]));
  const errors = [];
  const applied = [];
  c.on("error", (e) => errors.push(e));
  c.on("applied", (d) => applied.push(d.opId));
  const first = c.applyOp("d", { type: "cell.set", column: "c", value: 1 });
  const second = c.applyOp("d", { type: "cell.set", column: "c", value: 2 });
  const [a, b] = await Promise.all([first, second]);
  assert.deepEqual([a.clock, b.clock], [1, 2]);
  assert.equal(calls.length, 2); // op 1 was answered once: its deletion is retried, not its send
  assert.deepEqual(applied, [a.opId, b.opId]); // one `applied` each
  assert.equal(errors.length, 2);
  assert.ok(errors.every((e) => e.name === "OutboxError" && e.cause.name === "AbortError"), errors);
  assert.deepEqual(await c.pending(), []);
  c.close();
});

test("an outbox list that fails is retried and the drain goes on", async () => {
  const { fetch, calls } = scripted([(call) => ok(call, { clock: 1 })]);
  const c = client(fetch, flaky("list", [1, 2, 3]));
  const got = await c.applyOp("d", { type: "cell.set", column: "c", value: 1 });
  assert.equal(got.clock, 1);
  assert.equal(calls.length, 1);
  assert.deepEqual(await c.pending(), []);
  c.close();
});

test("an op the outbox cannot store rejects with OutboxError and nothing is sent", async () => {
  const { fetch, calls } = scripted([(call) => ok(call, { clock: 1 })]);
  const c = client(fetch, flaky("add", [1]));
  await assert.rejects(c.applyOp("d", { type: "cell.set", column: "c", value: 1 }),
    (e) => e.name === "OutboxError" && /not stored/.test(e.message) && e.cause.name === "AbortError");
  assert.deepEqual(await c.pending(), []);
  assert.equal(calls.length, 0);
  const got = await c.applyOp("d", { type: "cell.set", column: "c", value: 2 }); // the next one goes
  assert.equal(calls.length, 1);
  assert.equal(calls[0].body.op.value, 2);
  assert.equal(got.clock, 1);
  c.close();
});

test("an outbox that cannot open: start() rejects with OutboxError, and a later start() tries again", async () => {
  const box = new MemoryOutbox();
  let opens = 0;
  box.open = async () => { if (++opens === 1) throw new DOMException("denied", "UnknownError"); };
  const { fetch } = scripted([(call) => ok(call, { clock: 1 })]);
  const c = client(fetch, box);
  await assert.rejects(c.start(), (e) => e.name === "OutboxError" && /could not be opened/.test(e.message));
  assert.equal((await c.applyOp("d", { type: "cell.set", column: "c", value: 1 })).clock, 1);
  assert.equal(opens, 2);
  c.close();
});

test("the default outbox falls back to memory, with a warning, when IndexedDB cannot open", async () => {
  const denied = { open() { const req = {}; setTimeout(() => { req.error = new DOMException("denied", "InvalidStateError"); req.onerror(); }); return req; } };
  globalThis.indexedDB = denied; // a browser whose IndexedDB refuses (e.g. storage disabled)
  try {
    const { fetch } = scripted([(call) => ok(call, { clock: 1 })]);
    const c = new WorkspaceClient({ apiKey: "k", workspaceId: "w1", fetch, backoff: BACKOFF, baseUrl: "http://x" });
    const warnings = [];
    c.on("warning", (w) => warnings.push(w));
    assert.equal(c.outbox.shared, true);
    assert.equal((await c.applyOp("d", { type: "cell.set", column: "c", value: 1 })).clock, 1);
    assert.ok(c.outbox instanceof MemoryOutbox);
    assert.equal(warnings.length, 1);
    assert.match(warnings[0].message, /in memory/);
    assert.equal(warnings[0].error.name, "InvalidStateError");
    c.close();
  } finally {
    delete globalThis.indexedDB;
  }
});

test("MemoryOutbox never reuses a seq and deletes only the entry of the given op id", async () => {
  const box = new MemoryOutbox();
  const a = await box.add("n", { opId: "a" });
  assert.equal(await box.delete("n", a.seq, "a"), true);
  const b = await box.add("n", { opId: "b" }); // the namespace was empty: seq still moves on
  assert.notEqual(b.seq, a.seq);
  assert.equal(await box.delete("n", a.seq, "a"), false); // a late second delete of a
  assert.equal(await box.delete("n", b.seq, "not-b"), false);
  assert.deepEqual((await box.list("n")).map((e) => e.opId), ["b"]);
});
