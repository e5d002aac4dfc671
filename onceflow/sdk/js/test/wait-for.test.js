// WorkspaceClient.waitFor under Node, driven by a scripted fetch (a test double of the network
// for the loop's logic; the real long poll against a server is tested from pytest).
import { test } from "node:test";
import assert from "node:assert/strict";
import { HttpError, MemoryOutbox, WaitTimeout, WorkspaceClient } from "../index.js";

/** A fetch answering each GET with the next scripted request status; calls are recorded. */
function reads(statuses) {
  const calls = [];
  const fetch = async (url, init) => {
    calls.push({ url: new URL(url), method: init.method, auth: init.headers.Authorization });
    const status = statuses.length > 1 ? statuses.shift() : statuses[0];
    if (status === 404) {
      return Response.json({ detail: "no request r1", code: "not_found" }, { status: 404 });
    }
    if (status === "offline") throw new TypeError("Failed to fetch");
    return Response.json({ request_id: "r/1", workspace_id: "w1", status, result: status === "succeeded" ? { n: 1 } : null });
  };
  return { fetch, calls };
}

function client(fetch) {
  return new WorkspaceClient({
    apiKey: "k_test", workspaceId: "w1", fetch, outbox: new MemoryOutbox(),
    backoff: { baseMs: 1, capMs: 2 }, baseUrl: "http://x",
  });
}

test("long-polls the request's read until it has ended, and returns it", async () => {
  const { fetch, calls } = reads(["queued", "running", "offline", "succeeded"]);
  const c = client(fetch);
  const done = await c.waitFor("r/1", { timeout: 120 });
  assert.equal(done.status, "succeeded");
  assert.deepEqual(done.result, { n: 1 });
  assert.equal(calls.length, 4);
  for (const call of calls) {
    assert.equal(call.method, "GET");
    assert.equal(call.url.pathname, "/v1/workspaces/w1/requests/r%2F1");
    const wait = Number(call.url.searchParams.get("wait"));
    assert.ok(wait > 0 && wait <= 60, `wait=${wait}`); // the API's bound, within the timeout
    assert.equal(call.auth, "Bearer k_test");
  }
  c.close();
});

test("dead and cancelled end the wait too", async () => {
  for (const status of ["dead", "cancelled"]) {
    const c = client(reads(["running", status]).fetch);
    assert.equal((await c.waitFor("r1", { timeout: 5 })).status, status);
    c.close();
  }
});

test("the timeout rejects with WaitTimeout carrying the request as last read", async () => {
  const { fetch, calls } = reads(["running"]);
  const c = client(fetch);
  await assert.rejects(c.waitFor("r1", { timeout: 0.05 }), (error) => {
    assert.ok(error instanceof WaitTimeout);
    assert.equal(error.request.status, "running");
    return true;
  });
  // Each read asks the server to hold it for what is left of the timeout, never more.
  assert.ok(calls.every((call) => Number(call.url.searchParams.get("wait")) <= 0.05));
  c.close();
});

test("no such request rejects with HttpError 404, at once", async () => {
  const { fetch, calls } = reads([404]);
  const c = client(fetch);
  await assert.rejects(c.waitFor("r1", { timeout: 5 }), (error) => error instanceof HttpError && error.status === 404);
  assert.equal(calls.length, 1);
  c.close();
});

test("bad ids and timeouts are refused before anything is sent", async () => {
  const { fetch, calls } = reads(["running"]);
  const c = client(fetch);
  for (const timeout of [0, -1, NaN, Infinity, 3601, "5", true, null]) {
    await assert.rejects(c.waitFor("r1", { timeout }), TypeError, String(timeout));
  }
  await assert.rejects(c.waitFor("", { timeout: 5 }), TypeError);
  assert.equal(calls.length, 0);
  c.close();
});

test("an abort signal stops the wait", async () => {
  const c = client(reads(["running"]).fetch);
  const stop = new AbortController();
  const waiting = c.waitFor("r1", { timeout: 60, signal: stop.signal });
  stop.abort();
  await assert.rejects(waiting, (error) => error.name === "Aborted");
  c.close();
});
