// Provider permits under Node's test runner against a scripted fetch: asking again with one
// permit id, giving back what a body left unsettled, a 402 as BudgetExceeded. The real
// server's limits and budgets are proven by tests/acceptance/test_pull_permits.py.

import assert from "node:assert/strict";
import { test } from "node:test";

import { Api, BudgetExceeded, ClaimPermits, PermitTimeout, failureOf, takePermit, withPermit } from "../index.js";

const KEY = "of_test_worker_key_for_node_0123456";
const PERMITS = "POST /v1/claims/r1/permits";

function scripted(routes) {
  const calls = [];
  async function fetch(url, init = {}) {
    // A permit id is minted by the client: routes name it ID.
    const path = new URL(url, "http://x").pathname.replace(/\/permits\/[0-9a-f]{32}\//, "/permits/ID/");
    const name = `${init.method} ${path}`;
    const body = init.body ? JSON.parse(init.body) : undefined;
    calls.push({ name, body });
    const route = routes[name];
    if (!route) return new Response(JSON.stringify({ detail: `no route ${name}`, code: "not_found" }), { status: 404 });
    const answer = await route(body);
    return new Response(JSON.stringify(answer.body ?? null), { status: answer.status ?? 200, headers: { "content-type": "application/json", ...(answer.headers || {}) } });
  }
  return { fetch, calls };
}

function permits(routes) {
  const fake = scripted(routes);
  const api = new Api("http://api", { apiKey: KEY, fetch: fake.fetch });
  return { permits: new ClaimPermits(api, "r1", "tok-secret", { workspaceId: "w1" }), calls: fake.calls };
}

const GRANTED = { status: 200, body: { permit_id: "x", provider: "llm", granted: true, granted_at_ms: 1000, expires_in_ms: 600000 } };

test("a busy provider is asked again with the same permit id, after its retry_after_ms", async () => {
  let asks = 0;
  const { permits: p, calls } = permits({
    [PERMITS]: () => (++asks < 3 ? { status: 429, body: { code: "provider_busy", reason: "rpm", retry_after_ms: 5 } } : GRANTED),
  });
  const permit = await takePermit(p, "llm", { tokens: 7, cellKey: "eval:a" });
  assert.equal(permit.grantedAtMs, 1000);
  const ids = new Set(calls.map((c) => c.body.permit_id));
  assert.equal(ids.size, 1);
  assert.match([...ids][0], /^[0-9a-f]{32}$/);
  assert.deepEqual(calls[0].body, { claim_token: "tok-secret", workspace_id: "w1", provider: "llm", tokens: 7, permit_id: [...ids][0], wait_seconds: 20, cell_key: "eval:a" });
});

test("none granted within timeoutMs: PermitTimeout with the last reason, retryable", async () => {
  const { permits: p } = permits({ [PERMITS]: () => ({ status: 429, body: { code: "provider_busy", reason: "concurrency", retry_after_ms: 5 } }) });
  await assert.rejects(takePermit(p, "llm", { timeoutMs: 30 }), (error) => error instanceof PermitTimeout && error.reason === "concurrency" && error.retryable === true);
});

test("a 402 is BudgetExceeded: its budget says whether the stage waits; reported so", async () => {
  const body = { detail: "day budget", code: "budget_exceeded", workspace_id: "w1", period: "day", on_exceeded: "wait", retry_at: "2026-12-08T00:00:00+00:00", retry_in: 3600, reason: "no room" };
  const { permits: p } = permits({ [PERMITS]: () => ({ status: 402, body }) });
  const error = await takePermit(p, "llm", { tokens: 100 }).catch((e) => e);
  assert.ok(error instanceof BudgetExceeded);
  assert.equal(error.waits, true);
  assert.deepEqual(failureOf(error), {
    error: { type: "BudgetExceeded", message: error.message, on_exceeded: "wait", retry_in: 3600, retry_at: "2026-12-08T00:00:00+00:00" },
    retryable: true,
  });
  const failing = new BudgetExceeded("x", { status: 402, code: "budget_exceeded", body: { ...body, on_exceeded: "fail", retry_in: null } });
  assert.equal(failureOf(failing).retryable, false);
});

test("a body left without a settle gives the permit back: unsettled when it returned, failed when it threw", async () => {
  const released = [];
  const { permits: p } = permits({
    [PERMITS]: () => GRANTED,
    "POST /v1/claims/r1/permits/ID/release": (b) => (released.push(b.outcome), { status: 200, body: {} }),
  });
  assert.equal(await withPermit(p, "llm", {}, async () => "done"), "done");
  await assert.rejects(withPermit(p, "llm", {}, async () => { throw new Error("boom"); }), /boom/);
  assert.deepEqual(released, ["unsettled", "failed"]);
});

test("a settled permit is not given back, and cannot be settled twice", async () => {
  const { permits: p, calls } = permits({
    [PERMITS]: () => GRANTED,
    "POST /v1/claims/r1/permits/ID/settle": () => ({ status: 200, body: {} }),
  });
  await withPermit(p, "llm", {}, async (permit) => {
    await permit.settle({ inputTokens: 3, outputTokens: 1 }, { model: "m" });
    await assert.rejects(permit.settle({ inputTokens: 3, outputTokens: 1 }), /already settled/);
    assert.throws(() => permit.settle({ inputTokens: -1, outputTokens: 1 }), TypeError);
  });
  const after = calls.slice(1).map((c) => [c.name, c.body]);
  assert.deepEqual(after, [["POST /v1/claims/r1/permits/ID/settle", { claim_token: "tok-secret", workspace_id: "w1", usage: { input_tokens: 3, output_tokens: 1 }, model: "m" }]]);
});

test("a refusal whose hint is most of a window is asked again within a second (the workspace keeps waiting)", async () => {
  const asked = [];
  const { permits: p } = permits({
    [PERMITS]: () => (asked.push(Date.now()), asked.length < 3 ? { status: 429, body: { code: "provider_busy", reason: "rpm", retry_after_ms: 55_000 } } : GRANTED),
  });
  const permit = await takePermit(p, "llm", { timeoutMs: 10_000 });
  assert.equal(permit.grantedAtMs, 1000);
  assert.equal(asked.length, 3);
  for (let i = 1; i < asked.length; i++) assert.ok(asked[i] - asked[i - 1] < 1_500, `asked again after ${asked[i] - asked[i - 1]} ms`);
});

test("a settle without an answer (503s past the retries) is sent again as it was on leaving, not released", async () => {
  let settles = 0;
  const sent = [];
  const { permits: p } = permits({
    [PERMITS]: () => GRANTED,
    "POST /v1/claims/r1/permits/ID/settle": (b) => (sent.push(["settle", b.usage]), ++settles <= 5 ? { status: 503, body: { detail: "ledger down", code: "unavailable" } } : { status: 200, body: {} }),
    "POST /v1/claims/r1/permits/ID/release": (b) => (sent.push(["release", b.outcome]), { status: 200, body: {} }),
  });
  p.api.callRetrying = ((retrying) => (method, path, body, options = {}) => retrying.call(p.api, method, path, body, { ...options, backoff: { baseMs: 1, capMs: 2 } }))(p.api.callRetrying);
  let held;
  await assert.rejects(
    withPermit(p, "llm", {}, async (permit) => {
      held = permit;
      await permit.settle({ inputTokens: 3, outputTokens: 1 });
    }),
    (error) => error.status === 503,
  );
  assert.equal(held.outcome, "ok");
  assert.deepEqual(sent.at(-1), ["settle", { input_tokens: 3, output_tokens: 1 }]);
  assert.ok(!sent.some(([action]) => action === "release"));
  await assert.rejects(held.settle({ inputTokens: 3, outputTokens: 1 }), /already settled/);
});

test("a settle without an answer may only be sent again as it was", async () => {
  const { permits: p } = permits({
    [PERMITS]: () => GRANTED,
    "POST /v1/claims/r1/permits/ID/settle": () => ({ status: 503, body: { detail: "down", code: "unavailable" } }),
  });
  p.api.callRetrying = ((retrying) => (method, path, body, options = {}) => retrying.call(p.api, method, path, body, { ...options, attempts: 1 }))(p.api.callRetrying);
  const permit = await takePermit(p, "llm", {});
  await assert.rejects(permit.settle({ inputTokens: 3, outputTokens: 1 }), (error) => error.status === 503);
  await assert.rejects(permit.settle({ inputTokens: 9, outputTokens: 9 }), /without an answer/);
  await assert.rejects(permit.release(), /without an answer/);
  assert.equal(permit.outcome, null);
});
