// onceflow SDK — layer 2 for a pull worker: the compute-lock protocol over HTTP, so a
// tab, a Celery stage and a Python pull worker asking for the same cell pay for it once.
//
//   1. pre-flight check(): a stored value returns at once, no lock round trip;
//   2. acquire the cell's lock (POST /v1/claims/{id}/locks). `{locked: true}` is "someone else
//      is on it": open the claim's event stream FIRST, check again, and try the lock once
//      more (a release announced before the stream was live is not missed; its answer gives a
//      fresh `remaining_ms`), then wait for a `lock_released` of this (job, task) or a
//      `commit` (after which check() runs again), at most the holder's `remaining_ms` plus a
//      margin, and try again (the holder may have died: its lock expires). No polling loop;
//   3. holding the lock, check() again (the double-check);
//   4. compute() — the provider call — with the lock extended every ttl/3 (a failed extend
//      is tried again at the next third; only a refused one — `held: false` — stops it);
//   5. store(value), then release with the outcome — `computed`, `double_check`, `failed`
//      (compute() or store() threw) or `abandoned` (stopped before compute() was called:
//      the server counts no provider call) — which announces `lock_released` to the waiters.

import { Aborted, LeaseLost, NetworkError, OnceflowError, errorFor, isRetryable, seg, sleep, sseEvents } from "./transport.js";

/** Waits run this long past the holder's remaining TTL, so the retry finds the key expired. */
export const WAIT_MARGIN_MS = 50;

/** A lock's extension interval: a third of its TTL (as the Python watchdog). */
export function extendIntervalMs(ttlMs) {
  return Math.max(10, Math.floor(ttlMs / 3));
}

/**
 * The message a waiter gets when the tabs' shared feed it listens to connected again (a new
 * holder tab, a reconnect): a release may have been missed meanwhile, so it tries the lock
 * again at once (the answer's `remaining_ms` is the fresh wait).
 */
export const RESYNC = Object.freeze({ kind: "resync" });

/** True if `message` (a broadcast's JSON) says the lock of (jobId, task) was released. */
export function isReleaseOf(message, jobId, task) {
  return !!message && message.kind === "lock_released" && message.job_id === jobId && message.task === task;
}

// Constructor alike by shape to ClaimLocks' on purpose: each takes the claim's parts, no more.
/**
 * The claimed request's workspace events (POST /v1/claims/{id}/events), one stream shared by
 * every waiter of the claim: opened by the first subscriber, closed when the last one leaves
 * or the claim ends. With the tabs' link (tabs.js) and a tab of the browser following the
 * claim's workspace, no stream is opened: the waiters listen to that tab's feed (its commits
 * of the job's sub-docs and lock news of the job), and get RESYNC when it connects again. A subscription sees every message from its `ready` on, so nothing
 * committed after it subscribed can be missed. The server ends the stream with `event: end`
 * once the claim is over: then the stream is not opened again (subscriptions are dead,
 * `ended` "claim_ended", and waiters wait out their TTL or meet the claim's LeaseLost). A
 * stream that ends otherwise (a server restart) is opened again by the next subscribe().
 */
export class ClaimEvents {
  constructor(api, requestId, token, { signal, workspaceId, link = null, jobId } = {}) {
    this.api = api;
    this.requestId = requestId;
    this.link = link;
    this.jobId = jobId;
    /** The claimed request's workspace, sent with the token (the row's key), if known. */
    this.workspaceId = workspaceId;
    Object.defineProperty(this, "_token", { value: token, enumerable: false });
    this._parent = signal;
    this._subs = new Set();
    this._stream = null; // { controller, ready: Promise<boolean> }
    this._claimEnded = false; // the server said `event: end`: never open the stream again
    /** Streams opened so far (for tests and diagnostics). */
    this.opened = 0;
    /** Times the waiters listened to a tab's shared feed instead (for tests and diagnostics). */
    this.shared = 0;
  }

  /** A new subscription, once the stream is live (`ready`); a dead one if it cannot open. */
  async subscribe() {
    const sub = new Subscription(this);
    if (this._claimEnded) {
      sub._end("claim_ended");
      return sub;
    }
    this._subs.add(sub);
    if (!this._stream) this._stream = this.link && this.workspaceId ? this._openShared() : this._open();
    const ok = await this._stream.ready;
    if (!ok) sub._end(this._claimEnded ? "claim_ended" : "unavailable");
    return sub;
  }

  /** Close the stream (the claim ended). */
  close() {
    for (const sub of [...this._subs]) sub._end("closed");
    this._subs.clear();
    this._stream?.controller.abort();
    this._stream = null;
  }

  _leave(sub) {
    this._subs.delete(sub);
    if (this._subs.size === 0 && this._stream) {
      this._stream.controller.abort();
      this._stream = null;
    }
  }

  /** Whether a message of the workspace's feed is news of this claim's job. */
  _isNews(message) {
    if (!message || typeof message !== "object") return false;
    const job = this.jobId;
    if (message.kind === "lock_released") return job === undefined || message.job_id === job;
    if (message.kind !== "commit") return false;
    const doc = message.sub_doc;
    return job === undefined || (typeof doc === "string" && (doc === `job:${job}` || doc.startsWith(`job:${job}:`)));
  }

  /** Listen to a tab's feed of the claim's workspace; without one, the claim's own stream. */
  _openShared() {
    const controller = new AbortController();
    let resolveReady;
    const ready = new Promise((resolve) => (resolveReady = resolve));
    const stream = { controller, ready };
    const parent = this._parent;
    if (parent) {
      if (parent.aborted) controller.abort();
      else parent.addEventListener("abort", () => controller.abort(), { once: true });
    }
    let watch = null;
    const push = (message) => {
      if (this._stream !== stream) return;
      for (const sub of this._subs) sub._push(message);
    };
    (async () => {
      watch = await this.link.watch(this.workspaceId, {
        signal: controller.signal,
        onEvent: (_name, data) => {
          let message;
          try {
            message = JSON.parse(data);
          } catch {
            return;
          }
          if (this._isNews(message)) push(message);
        },
        onReady: () => push(RESYNC),
        onDown: () => {
          // the holder tab lost its stream or closed: the waiters subscribe again
          if (this._stream !== stream) return;
          this._stream = null;
          watch?.close();
          for (const sub of this._subs) sub._end("ended");
        },
      });
      if (watch === null) {
        if (this._stream === stream && !controller.signal.aborted) {
          this._stream = this._open(); // no tab follows the workspace: the claim's own stream
          resolveReady(await this._stream.ready);
        } else {
          resolveReady(false);
        }
        return;
      }
      if (controller.signal.aborted || this._stream !== stream) {
        watch.close();
        resolveReady(false);
        return;
      }
      this.shared += 1;
      controller.signal.addEventListener("abort", () => watch.close(), { once: true });
      resolveReady(true);
    })();
    return stream;
  }

  _open() {
    const controller = new AbortController();
    const parent = this._parent;
    if (parent) {
      if (parent.aborted) controller.abort();
      else parent.addEventListener("abort", () => controller.abort(), { once: true });
    }
    let resolveReady;
    const ready = new Promise((resolve) => (resolveReady = resolve));
    const stream = { controller, ready };
    this.opened += 1;
    const path = `/v1/claims/${seg(this.requestId)}/events`;
    (async () => {
      let live = false;
      try {
        const response = await this.api.raw("POST", path, {
          body: claimBody(this._token, this.workspaceId),
          signal: controller.signal,
          timeoutMs: 0, // a stream: the keep-alives say it lives; the claim's end closes it
          stream: true, // closed (the connection let go) when the last waiter leaves
        });
        if (response.status !== 200 || !response.body) {
          let body = null;
          try {
            body = await response.json();
          } catch {
            body = null;
          }
          throw errorFor(response.status, body, "claim events");
        }
        for await (const event of sseEvents(response.body)) {
          if (event.event === "ready") {
            live = true;
            resolveReady(true);
            continue;
          }
          if (event.event === "end") {
            this._claimEnded = true; // the claim is over: its stream is not opened again
            break;
          }
          let message;
          try {
            message = JSON.parse(event.data);
          } catch {
            continue;
          }
          if (!message || typeof message !== "object") continue;
          for (const sub of this._subs) if (stream === this._stream) sub._push(message);
        }
      } catch {
        // Closed by us, the claim ended, or the network failed: waiters fall back to the TTL.
      } finally {
        resolveReady(false);
        if (this._claimEnded) controller.abort(); // let the connection go
        if (this._stream === stream) {
          this._stream = null;
          const reason = this._claimEnded ? "claim_ended" : live ? "ended" : "unavailable";
          for (const sub of this._subs) sub._end(reason);
        }
      }
    })();
    return stream;
  }
}

/** One waiter's view of the claim's event stream: a queue of messages since `ready`. */
export class Subscription {
  constructor(events) {
    this._events = events;
    this._queue = [];
    this._wake = null;
    /**
     * null while live; once the stream is gone: "ended" (it closed: subscribe again),
     * "claim_ended" (the server ended it, the claim is over), "unavailable" or "closed".
     */
    this.ended = null;
  }

  _push(message) {
    this._queue.push(message);
    this._wake?.();
  }

  _end(reason) {
    if (this.ended === null) this.ended = reason;
    this._wake?.();
  }

  /**
   * The next message, or null after `timeoutMs` without one, or when the stream is gone
   * (then `ended` says why; a stream that never opened or whose claim ended waits out the
   * timeout: the TTL is the fallback).
   */
  async next(timeoutMs, signal) {
    if (this._queue.length) return this._queue.shift();
    const waitsOut = this.ended === "unavailable" || this.ended === "claim_ended";
    if (this.ended !== null && !waitsOut) return null;
    let timer = null;
    let onAbort = null;
    try {
      await new Promise((resolve, reject) => {
        this._wake = waitsOut ? null : resolve;
        timer = setTimeout(resolve, Math.max(0, timeoutMs));
        if (signal) {
          if (signal.aborted) return reject(new Aborted("aborted"));
          onAbort = () => reject(new Aborted("aborted"));
          signal.addEventListener("abort", onAbort, { once: true });
        }
      });
    } finally {
      this._wake = null;
      clearTimeout(timer);
      if (onAbort) signal.removeEventListener("abort", onAbort);
    }
    return this._queue.length ? this._queue.shift() : null;
  }

  close() {
    this._end("closed");
    this._events._leave(this);
  }
}

/**
 * The lock calls of one claim. `acquire` → `{acquired, lock_token, ttl_ms}` or
 * `{locked, remaining_ms}`; `extend` → held?; `release` → released?. A 409 lease_lost is
 * thrown as LeaseLost (the claim is gone: the cell's lock is not ours to take).
 */
export class ClaimLocks {
  constructor(api, requestId, token, { signal, workspaceId, headers = {} } = {}) {
    this.api = api;
    this.requestId = requestId;
    /** The claimed request's workspace, sent with the token (the row's key), if known. */
    this.workspaceId = workspaceId;
    Object.defineProperty(this, "_token", { value: token, enumerable: false });
    this.signal = signal;
    /** Sent with every lock call: the claim's trace (`traceparent`), when it has one. */
    this.headers = headers;
  }

  _path(suffix) {
    return `/v1/claims/${seg(this.requestId)}/locks${suffix}`;
  }

  async acquire(task, ttlSeconds) {
    const body = { ...claimBody(this._token, this.workspaceId), task };
    if (ttlSeconds !== undefined && ttlSeconds !== null) body.ttl_seconds = ttlSeconds;
    // Safe to repeat: a lost answer's lock is ours but unknown, and expires by its TTL.
    const answer = await this.api.callRetrying("POST", this._path(""), body, { signal: this.signal, what: "acquire lock", headers: this.headers });
    return answer.body;
  }

  async extend(task, lockToken, ttlSeconds) {
    const body = { ...claimBody(this._token, this.workspaceId), task, lock_token: lockToken };
    if (ttlSeconds !== undefined && ttlSeconds !== null) body.ttl_seconds = ttlSeconds;
    const answer = await this.api.callRetrying("POST", this._path("/extend"), body, { signal: this.signal, attempts: 2, what: "extend lock", headers: this.headers });
    return !!answer.body?.held;
  }

  async release(task, lockToken, outcome) {
    // Not tied to the stage's signal: a stage stopped by a lost lease still frees the cell.
    const body = { ...claimBody(this._token, this.workspaceId), task, lock_token: lockToken, outcome };
    const answer = await this.api.callRetrying("POST", this._path("/release"), body, { what: "release lock", headers: this.headers });
    return !!answer.body?.released;
  }
}

/** A claim call's body: the token and, when known, the claimed request's workspace. */
function claimBody(token, workspaceId) {
  const body = { claim_token: token };
  if (workspaceId !== undefined && workspaceId !== null) body.workspace_id = workspaceId;
  return body;
}

function isStored(value) {
  return value !== null && value !== undefined;
}

/**
 * Get the cell's value, paying for `compute()` at most once across every caller.
 * Returns `{value, path, servedBy?, rounds, duplicate?}` with `path` one of "preflight",
 * "waited", "double_check", "computed", "lock_lost".
 *
 * `locks` (ClaimLocks), `events` (ClaimEvents), `jobId`: the claim's; `check()` returns the
 * stored value or null/undefined; `store(value)` may return false for "an earlier value
 * was kept". `guard()` throws when the stage must stop (the context's check()); `signal`
 * aborts waits. `onWait()` is called each time this caller starts waiting for a holder.
 */
export async function computeOnce(task, { locks, events, jobId, check, compute, store, ttlSeconds, guard = () => {}, signal, onWait, waitMarginMs = WAIT_MARGIN_MS }) {
  if (typeof task !== "string" || task.length === 0 || task.length > 200) throw new TypeError("task must be a string of 1..200 characters");
  for (const [name, fn] of [["check", check], ["compute", compute], ["store", store]]) {
    if (typeof fn !== "function") throw new TypeError(`${name} must be a function`);
  }
  guard();
  const first = await check();
  if (isStored(first)) return { value: first, path: "preflight", rounds: 0 };

  let sub = null;
  let rounds = 0;
  const acquire = async () => {
    rounds += 1;
    guard();
    const got = await locks.acquire(task, ttlSeconds);
    if (!got?.acquired && !got?.locked) throw new OnceflowError(`acquire lock: an answer neither acquired nor locked`, { body: got });
    return got;
  };
  try {
    for (;;) {
      let got = await acquire();
      if (got.acquired) return await lead(task, got, { locks, check, compute, store, ttlSeconds, guard, rounds });
      // Someone else is on it: listen first, then look again, then wait.
      if (sub === null || sub.ended !== null) {
        sub?.close();
        sub = await events.subscribe();
        const value = await check();
        if (isStored(value)) return { value, path: "waited", servedBy: "recheck", rounds };
        // A holder that released without a value before the stream was live announced it
        // to no one here: try once more now (its answer's remaining_ms is the fresh wait).
        got = await acquire();
        if (got.acquired) return await lead(task, got, { locks, check, compute, store, ttlSeconds, guard, rounds });
      }
      onWait?.({ task, remainingMs: got.remaining_ms });
      const deadline = Date.now() + Math.max(0, Number(got.remaining_ms) || 0) + waitMarginMs;
      for (;;) {
        const message = await sub.next(deadline - Date.now(), signal);
        if (message === null) break; // the holder's TTL ran out (or the stream is gone): try again
        guard();
        const value = await check(); // any message may be the store's commit
        if (isStored(value)) return { value, path: "waited", servedBy: "broadcast", rounds };
        if (isReleaseOf(message, jobId, task)) break; // released without a value: try again
        if (message.kind === RESYNC.kind) break; // the feed connected again: a release may be missed
      }
    }
  } finally {
    sub?.close();
  }
}

async function lead(task, got, { locks, check, compute, store, ttlSeconds, guard, rounds }) {
  const token = got.lock_token;
  const ttlMs = Number(got.ttl_ms) || 60_000;
  let lost = false;
  let outcome = "abandoned"; // until compute() is called: no provider call to count
  const extender = new AbortController();
  const watchdog = (async () => {
    for (;;) {
      try {
        await sleep(extendIntervalMs(ttlMs), extender.signal);
        if (!(await locks.extend(task, token, ttlSeconds))) {
          lost = true; // refused: the lock is someone else's (or expired)
          return;
        }
      } catch (error) {
        // No answer or a retryable status: the lock may still be ours, try at the next third.
        // Stopped, the claim's lease lost, or a refusal (4xx): stop extending.
        if (extender.signal.aborted || !isRetryable(error)) return;
      }
    }
  })();
  try {
    const again = await check(); // the double-check: stored between the pre-flight and the acquire?
    if (isStored(again)) {
      outcome = "double_check";
      return { value: again, path: "double_check", rounds };
    }
    guard(); // no provider call for a stage that must stop
    outcome = "failed"; // from here a throw is a failed provider call (or a lost value)
    const value = await compute();
    if (!isStored(value)) throw new TypeError("compute() returned null/undefined, which check() would read as 'not stored'");
    guard();
    let held = !lost;
    try {
      held = held && (await locks.extend(task, token, ttlSeconds)); // ours right before the store?
    } catch (error) {
      if (error instanceof LeaseLost) throw error;
      // cannot confirm (no answer): store anyway, the store keeps the first value
    }
    if (!held) {
      const existing = await check();
      if (isStored(existing)) {
        outcome = "computed";
        return { value: existing, path: "lock_lost", rounds, duplicate: true };
      }
    }
    const kept = await store(value);
    outcome = "computed";
    const path = held ? "computed" : "lock_lost";
    if (kept === false) {
      const existing = await check();
      return { value: isStored(existing) ? existing : value, path, rounds, duplicate: true };
    }
    return { value, path, rounds };
  } finally {
    extender.abort();
    await watchdog;
    try {
      await locks.release(task, token, outcome);
    } catch (error) {
      if (!(error instanceof NetworkError || error instanceof OnceflowError)) throw error;
      // not released: it expires by its TTL, and waiters wake then
    }
  }
}
