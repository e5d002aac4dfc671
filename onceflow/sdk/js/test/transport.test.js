// The transport's pure parts under Node's test runner: SSE parsing, backoff, Retry-After, op ids.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Api, backoffDelay, newOpId, retryAfterMs, sseEvents } from "../transport.js";

const enc = new TextEncoder();
async function parse(...chunks) {
  const events = [];
  for await (const event of sseEvents((async function* () { for (const c of chunks) yield enc.encode(c); })())) events.push(event);
  return events;
}

test("sseEvents: LF, CRLF and CR line ends give the same events", async () => {
  const want = [{ event: "ready", data: "{}", id: null }, { event: "commit", data: '{"clock":1}', id: "7" }];
  for (const nl of ["\n", "\r\n", "\r"]) {
    const text = `retry: 1000${nl}event: ready${nl}data: {}${nl}${nl}event: commit${nl}id: 7${nl}data: {"clock":1}${nl}${nl}`;
    assert.deepEqual(await parse(text), want, JSON.stringify(nl));
  }
});

test("sseEvents: chunks split anywhere, also inside CRLF and inside a UTF-8 character", async () => {
  const text = "event: commit\r\ndata: {\"v\":\"é€\"}\r\n\r\n";
  const bytes = enc.encode(text);
  for (let cut = 1; cut < bytes.length; cut++) {
    const events = [];
    const chunks = (async function* () { yield bytes.slice(0, cut); yield bytes.slice(cut); })();
    for await (const event of sseEvents(chunks)) events.push(event);
    assert.deepEqual(events, [{ event: "commit", data: '{"v":"é€"}', id: null }], `cut at ${cut}`);
  }
});

test("sseEvents: multi-line data, comments, no-data events, default event name", async () => {
  const events = await parse(": keep-alive\n\n", "data: a\ndata:b\n\n", "event: x\n\n", "data\n\n");
  assert.deepEqual(events, [
    { event: "message", data: "a\nb", id: null },
    { event: "message", data: "", id: null },
  ]);
});

test("sseEvents: an unfinished last event is not dispatched", async () => {
  assert.deepEqual(await parse("data: cut"), []);
});

test("backoffDelay: full jitter under a doubling, capped ceiling; Retry-After is a floor", () => {
  assert.equal(backoffDelay(0, { random: () => 0.999999 }), 199);
  assert.equal(backoffDelay(3, { random: () => 0.5 }), 800);
  assert.equal(backoffDelay(50, { random: () => 0.999999, capMs: 10_000 }), 9999);
  assert.equal(backoffDelay(0, { random: () => 0 }), 0);
  assert.equal(backoffDelay(0, { random: () => 0, retryAfterMs: 3000 }), 3000);
});

test("retryAfterMs: seconds, an HTTP date, absent or garbage", () => {
  const h = (v) => new Headers(v === null ? {} : { "Retry-After": v });
  assert.equal(retryAfterMs(h("2")), 2000);
  const now = Date.parse("2026-01-01T00:00:00Z");
  assert.equal(retryAfterMs(h("Thu, 01 Jan 2026 00:00:05 GMT"), now), 5000);
  assert.equal(retryAfterMs(h(null)), 0);
  assert.equal(retryAfterMs(h("soon")), 0);
  assert.equal(retryAfterMs(null), 0);
});

test("newOpId: 21 URL-safe symbols by default, the API's pattern, unique", () => {
  const seen = new Set();
  for (let i = 0; i < 5000; i++) {
    const id = newOpId();
    assert.match(id, /^[A-Za-z0-9_-]{21}$/);
    seen.add(id);
  }
  assert.equal(seen.size, 5000);
  assert.match(newOpId(64), /^[A-Za-z0-9_-]{64}$/);
  assert.throws(() => newOpId(15), RangeError);
  assert.throws(() => newOpId(65), RangeError);
  // every symbol of the 64-letter alphabet is reachable
  const letters = new Set([...Array.from({ length: 200 }, () => newOpId()).join("")]);
  assert.equal(letters.size, 64);
});

// ------------------------------------------------------------ a token function as apiKey

function fakeServer({ valid }) {
  const seen = [];
  const fetchImpl = async (url, init) => {
    seen.push({ url, auth: init.headers.Authorization, body: init.body });
    const ok = valid.has(init.headers.Authorization);
    return new Response(ok ? '{"ok":true}' : '{"detail":"unknown key","code":"unauthorized"}', { status: ok ? 200 : 401 });
  };
  return { seen, fetchImpl };
}

test("Api: a token function is called once, then again on a 401; the call is sent once more", async () => {
  const valid = new Set(["Bearer t1"]);
  const { seen, fetchImpl } = fakeServer({ valid });
  const minted = [];
  const api = new Api("http://x", {
    fetch: fetchImpl,
    apiKey: async () => { minted.push(`t${minted.length + 1}`); return minted.at(-1); },
  });
  assert.equal((await api.call("POST", "/v1/claims/r/heartbeat", { claim_token: "c" })).status, 200);
  assert.deepEqual(minted, ["t1"]);
  valid.clear();
  valid.add("Bearer t2"); // t1 expired; the back end mints t2
  const answer = await api.call("POST", "/v1/claims/r/heartbeat", { claim_token: "c" });
  assert.equal(answer.status, 200);
  assert.deepEqual(minted, ["t1", "t2"]);
  assert.deepEqual(seen.map((s) => s.auth), ["Bearer t1", "Bearer t1", "Bearer t2"]);
  assert.equal(seen[2].body, seen[1].body); // the same call, the claim token kept
  assert.ok(!JSON.stringify(api).includes("t2")); // the token is not an enumerable field
});

test("Api: calls answered 401 together share one refresh; a still-refused token is the 401", async () => {
  const valid = new Set();
  const { fetchImpl } = fakeServer({ valid });
  let calls = 0;
  let release;
  let asked;
  const gate = new Promise((resolve) => { release = resolve; });
  const refreshing = new Promise((resolve) => { asked = resolve; });
  const apiKey = () => {
    calls += 1;
    if (calls === 1) return "t1";
    asked();
    return gate;
  };
  const api = new Api("http://x", { fetch: fetchImpl, apiKey });
  const both = Promise.all([api.call("GET", "/a"), api.call("GET", "/b")]); // t1 refused twice
  await refreshing;
  valid.add("Bearer t2");
  release("t2");
  const answers = await both;
  assert.deepEqual(answers.map((a) => a.status), [200, 200]);
  assert.equal(calls, 2); // one token for the start, one refresh for both 401s
  const refused = await new Api("http://x", { fetch: fetchImpl, apiKey: () => "never" }).call("GET", "/a");
  assert.equal(refused.status, 401);
});

test("Api: a plain key is never refreshed; a bad apiKey is refused at once", async () => {
  const { seen, fetchImpl } = fakeServer({ valid: new Set() });
  assert.equal((await new Api("http://x", { fetch: fetchImpl, apiKey: "k" }).call("GET", "/a")).status, 401);
  assert.equal(seen.length, 1);
  assert.throws(() => new Api("http://x", { apiKey: 42 }), TypeError);
  const broken = new Api("http://x", { fetch: fetchImpl, apiKey: () => "" });
  await assert.rejects(broken.call("GET", "/a"), TypeError);
});

test("a stream (stream: true) stays tied to the caller's signal after its headers: aborting it closes the body", async () => {
  const seen = [];
  const fetch = async (_url, init) => {
    seen.push(init.signal);
    return new Response(new ReadableStream({ start() {} }), { status: 200 });
  };
  const api = new Api("http://api.test", { apiKey: "k", fetch });
  const streamStop = new AbortController();
  await api.raw("GET", "/v1/workspaces/w/events", { signal: streamStop.signal, timeoutMs: 0, stream: true });
  const callStop = new AbortController();
  await api.raw("GET", "/v1/x", { signal: callStop.signal });
  streamStop.abort();
  callStop.abort();
  assert.equal(seen[0].aborted, true); // the stream's connection is let go
  assert.equal(seen[1].aborted, false); // a plain call is answered: nothing left to cut
});
