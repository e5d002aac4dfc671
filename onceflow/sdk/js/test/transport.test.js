// The transport's pure parts under Node's test runner: SSE parsing, backoff, Retry-After, op ids.
import { test } from "node:test";
import assert from "node:assert/strict";
import { backoffDelay, newOpId, retryAfterMs, sseEvents } from "../transport.js";

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
