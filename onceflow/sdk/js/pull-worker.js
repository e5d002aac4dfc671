// onceflow SDK — a pull worker: a browser tab (or any fetch-capable runtime) that claims
// stage requests of a worker class over HTTP, heartbeats every lease/3, runs the stage's
// handler, and completes or fails the request: the lifecycle of a Celery stage, with the
// claim token kept in memory and sent only in request bodies. It mirrors the Python
// reference client, onceflow/integrations/pull.py.
//
//   const worker = new PullWorker({ apiKey: workerKey, workerClass: "browser" });
//   worker.run(async (ctx) => {
//     const { value } = await ctx.computeOnce("eval:fit", { check, compute, store });
//     return { fit: value };                       // completed, fenced by the claim
//   });
//
// Only one tab per browser works a worker class (the Web Locks API elects it); the others
// wait for it to close. A tab that closes mid-stage stops heartbeating: its lease lapses
// (the database's clock) and another worker claims the request again. The tabs of a browser
// share its connections to the API (tabs.js): short calls one at a time, heartbeats first.

import { Aborted, Api, BudgetExceeded, Cancelled, HttpError, LeaseLost, backoffDelay, errorFor, isRetryable, seg, sleep, traceHeaders } from "./transport.js";
import { ClaimEvents, ClaimLocks, computeOnce } from "./compute.js";
import { ClaimPermits, takePermit, withPermit } from "./permit.js";
import { leaderName, webLocks, whileLeader } from "./leader.js";
import { tabLink } from "./tabs.js";

export { ClaimEvents, ClaimLocks, RESYNC, Subscription, WAIT_MARGIN_MS, computeOnce, extendIntervalMs, isReleaseOf } from "./compute.js";
export { LEADER_PREFIX, leaderName, webLocks, whileLeader } from "./leader.js";
export { TabLink, linkNames, serverOf, tabLink } from "./tabs.js";
export { ASK_PAUSE_MS, ASK_SECONDS, ClaimPermits, PERMIT_TIMEOUT_MS, Permit, PermitTimeout, newPermitId, takePermit, withPermit } from "./permit.js";

/** What runOnce() returns for each way a claimed request can end. */
export const OUTCOMES = Object.freeze(["succeeded", "retry", "dead", "cancelled", "lease_lost"]);

/** The heartbeat interval for a lease of `leaseSeconds`: a third of it (ms). */
export function heartbeatIntervalMs(leaseSeconds) {
  const seconds = Number(leaseSeconds);
  if (!Number.isFinite(seconds) || seconds <= 0) throw new RangeError("lease_seconds must be a positive number");
  return Math.max(10, Math.floor((seconds * 1000) / 3));
}

/** The outcome of a `/fail` answer (the request as stored): queued again is "retry". */
export function failOutcome(row) {
  const status = String(row?.status ?? "");
  return status === "queued" ? "retry" : status;
}

/** Statuses of a request the server refused as sent (400, 413, 422): never worth a retry. */
const REFUSED = new Set([400, 413, 422]);

/**
 * Throw from a handler to run the request again after `delay` seconds (not counted as a
 * crash), as a Python stage raises `RetryLater(delay)`. The server keeps the delay within
 * its longest retry delay (ONCEFLOW_BACKOFF_MAX_SECONDS); a delay that is not a finite
 * number of seconds, or is negative, retries after the backoff.
 */
export class RetryLater extends Error {
  constructor(delay = 0, reason = "") {
    super(reason || `retry in ${delay}s`);
    this.name = "RetryLater";
    this.delay = delay;
    this.reason = reason;
  }
}

/** Throw from a handler to fail the request at once, without retries (e.g. bad data). */
export class PermanentError extends Error {
  constructor(message = "") {
    super(message);
    this.name = "PermanentError";
  }
}

/**
 * How a handler's error is reported: `{error, retryable}` — the outcome table of every
 * onceflow runner. A RetryLater is reported with its `delay` (the server turns it into the
 * retry's due time); a BudgetExceeded with its budget's `on_exceeded` and `retry_in` (a
 * "wait" budget's stage runs again when the period turns, a "fail" one's never); a PermanentError, an InvalidRequest, an error with
 * `retryable === false` or `permanent === true`, or a request the server refused as sent
 * (400, 413, 422: a result over its payload limit) is never retried; any other error is
 * retried after the backoff, unless `retryOn(error)` (the worker's option, as a Python
 * stage's `retry_on`) says no.
 */
export function failureOf(error, retryOn) {
  const name = error?.name || error?.constructor?.name || typeof error;
  const message = String(error?.message ?? error).slice(0, 2000);
  if (error instanceof RetryLater || (name === "RetryLater" && error?.delay !== undefined)) {
    const delay = Number.isFinite(error.delay) && error.delay >= 0 ? error.delay : null;
    return { error: { type: "RetryLater", message: String(error.reason || message).slice(0, 2000), delay }, retryable: true };
  }
  if (error instanceof BudgetExceeded) {
    const report = { type: "BudgetExceeded", message, on_exceeded: error.waits ? "wait" : "fail", retry_in: error.retryIn, retry_at: error.retryAt };
    return { error: report, retryable: error.waits };
  }
  if (error instanceof HttpError && REFUSED.has(error.status)) {
    // The server refused what was sent (a result over its payload limit…): sending it again
    // cannot help — the Python client's InvalidRequest.
    return { error: { type: "InvalidRequest", message }, retryable: false };
  }
  let permanent = error?.retryable === false || error?.permanent === true || name === "PermanentError" || name === "InvalidRequest";
  if (!permanent && error?.retryable !== true && typeof retryOn === "function") {
    try {
      permanent = !retryOn(error);
    } catch {
      permanent = false; // a retry is the safe side
    }
  }
  const report = { type: name, message };
  if (typeof error?.stack === "string") report.traceback = error.stack.split("\n").slice(0, 30);
  return { error: report, retryable: !permanent };
}

/** A random worker id: `tab:<random>` (shown as `claimed_by`). */
export function newWorkerId() {
  const bytes = globalThis.crypto.getRandomValues(new Uint8Array(6));
  return "tab:" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** A claim held over HTTP. The token is a secret: kept off enumeration, never logged. */
export class PullClaim {
  constructor(data) {
    this.requestId = data.request_id;
    this.leaseSeconds = Number(data.lease_seconds);
    /** When the claim was sent (this clock, ms): its lease runs at least until then + lease. */
    this.sentAt = Number.isFinite(data.sentAt) ? data.sentAt : Date.now();
    this.leaseExpiresAt = data.lease_expires_at;
    this.attempt = Number(data.attempt);
    this.request = data.request;
    /** The request's workspace: sent with every later call of the claim (the row's key). */
    this.workspaceId = typeof data.request?.workspace_id === "string" && data.request.workspace_id ? data.request.workspace_id : undefined;
    /** The W3C trace context the request was enqueued under (null when none was stored):
     * its `traceparent` goes with the claim's calls, so they join the request's trace. */
    this.traceContext = typeof data.trace_context === "string" && data.trace_context ? data.trace_context : null;
    Object.defineProperty(this, "token", { value: data.claim_token, enumerable: false });
  }
}

/** What names a claim in a body: its token and, when known, its request's workspace. */
function claimBody(claim) {
  const body = { claim_token: claim.token };
  if (claim.workspaceId !== undefined) body.workspace_id = claim.workspaceId;
  return body;
}

/** What the handler gets: the request, the lease's state, fenced writes, hand-offs, locks. */
export class PullContext {
  constructor(worker, claim) {
    this.worker = worker;
    this.claim = claim;
    this._controller = new AbortController();
    /** Aborted at the first lease-lost or cancel (its `reason` is LeaseLost or Cancelled). */
    this.signal = this._controller.signal;
    this._then = [];
    this._stop = null; // the reason the stage must stop, once known
    const named = { signal: this.signal, workspaceId: claim.workspaceId, headers: traceHeaders(claim.traceContext) };
    const jobId = claim.request?.job_id;
    this.events = new ClaimEvents(worker.api, claim.requestId, claim.token, { ...named, link: worker.link, jobId });
    this.locks = new ClaimLocks(worker.api, claim.requestId, claim.token, named);
    this.permits = new ClaimPermits(worker.api, claim.requestId, claim.token, named);
  }

  get request() {
    return this.claim.request;
  }
  get input() {
    return this.claim.request?.input;
  }
  get requestId() {
    return this.claim.requestId;
  }
  get attempt() {
    return this.claim.attempt;
  }
  get leaseLost() {
    return this._stop instanceof LeaseLost;
  }
  get cancelRequested() {
    return this._stop instanceof Cancelled;
  }

  /** Throw LeaseLost or Cancelled if the stage must stop now. */
  check() {
    if (this._stop) throw this._stop;
  }

  /** Stop the stage: abort `signal` with `reason` (the first reason wins). */
  _halt(reason) {
    if (this._stop) return;
    this._stop = reason;
    this._controller.abort(reason);
  }

  /**
   * Write an op to a sub-doc of the request's workspace, fenced by this claim. `key` names
   * the write within the stage: its op id derives from (request, key), so a retried stage
   * joins its first write. Returns the API's answer (`{op_id, clock, duplicate, ...}`).
   */
  async applyOp(subDoc, op, { key, opId } = {}) {
    this.check();
    if (!key && !opId) throw new TypeError("applyOp needs a key (or an opId), so that a retried write is applied once");
    const body = { sub_doc: subDoc, op };
    if (key) body.key = key;
    if (opId) body.op_id = opId;
    return this.worker._claimCall(this, "ops", body);
  }

  /**
   * Read a sub-doc of the request's workspace (`{workspace_id, sub_doc, clock, state}`) under
   * this claim — the pre-flight and double-check reads of a stage (a worker key has no
   * workspace scope: this is its only read). A live claim only: 409 lease_lost otherwise.
   */
  async readSubDoc(subDoc) {
    this.check();
    return this.worker._claimCall(this, "sub-docs", { sub_doc: subDoc });
  }

  /** Hand off to a next stage, enqueued in the same transaction as the completion. */
  then(stage, input = {}, { branchPath } = {}) {
    if (typeof stage !== "string" || !stage) throw new TypeError("stage is required");
    const item = { stage, input: input ?? {} };
    if (branchPath !== undefined && branchPath !== null) item.branch_path = branchPath;
    this._then.push(item);
  }

  /**
   * A permit of `provider` (a name the server declares) for one call, under the provider's
   * limits shared with every client and the workspace's budgets (see permit.js). With
   * `body`, `await ctx.permit(provider, {tokens, cellKey, timeoutMs}, async (permit) => …)`
   * is what the body returns (a permit left without a settle is given back); without, a
   * Promise of the Permit (settle, rateLimited or release it). Throws BudgetExceeded when a
   * budget refuses, PermitTimeout (retryable) when none is granted in `timeoutMs`.
   */
  permit(provider, { tokens = 0, cellKey, timeoutMs } = {}, body) {
    const options = { tokens, cellKey, timeoutMs, guard: () => this.check(), signal: this.signal };
    if (timeoutMs === undefined) delete options.timeoutMs;
    if (body === undefined) return takePermit(this.permits, provider, options);
    return withPermit(this.permits, provider, options, body);
  }

  /**
   * The compute-lock protocol for one expensive call on the request's job (see compute.js):
   * `{value, path}` with path "preflight", "waited", "double_check", "computed" or "lock_lost".
   */
  computeOnce(task, { check, compute, store, ttlSeconds, onWait } = {}) {
    return computeOnce(task, {
      locks: this.locks,
      events: this.events,
      jobId: this.request?.job_id,
      check,
      compute,
      store,
      ttlSeconds,
      onWait,
      guard: () => this.check(),
      signal: this.signal,
    });
  }
}

/** Claims and runs requests of one worker class over onceflow's HTTP API. */
export class PullWorker {
  constructor({ baseUrl = "", apiKey, workerClass, workerId, leaseSeconds, waitSeconds = 20, leader = true, leaderName: name, fetch, timeoutMs = 30_000, onLeader, onOutcome, retryOn, shareTabs = true, shareWire = true, claimPollMs = 1_000 } = {}) {
    if (typeof workerClass !== "string" || !workerClass) throw new TypeError("workerClass is required");
    if (!(Number.isFinite(waitSeconds) && waitSeconds >= 0 && waitSeconds <= 60)) throw new RangeError("waitSeconds must be 0..60");
    if (leaseSeconds !== undefined && !(Number.isFinite(leaseSeconds) && leaseSeconds > 0)) throw new RangeError("leaseSeconds must be a positive number");
    if (!(Number.isFinite(claimPollMs) && claimPollMs >= 0)) throw new RangeError("claimPollMs must be a number of ms >= 0");
    /**
     * The tabs' shared link to the server (tabs.js), or null (`shareTabs: false`, or no Web
     * Locks / BroadcastChannel): with it, a waiting computeOnce listens to the browser's one
     * stream of its workspace, and — unless `shareWire: false` (an API served over HTTP/2,
     * where calls share one connection anyway) — calls go one at a time on the browser's
     * one wire, and claims are short (no long poll holding a connection): tried every
     * `claimPollMs`.
     */
    this.link = shareTabs ? (shareTabs === true ? tabLink(baseUrl) : shareTabs) : null;
    this.claimPollMs = claimPollMs;
    const options = { apiKey, timeoutMs, lane: shareWire ? this.link : null };
    if (fetch) options.fetch = fetch;
    this.api = new Api(baseUrl, options);
    /**
     * Heartbeats of this worker: `sent` (calls made), `answered` (200), `retried` (no answer
     * in time, or a status that is not lease_lost: sent again at once), `lost` (409
     * lease_lost: the only answer that ends a lease).
     */
    this.heartbeats = { sent: 0, answered: 0, retried: 0, lost: 0 };
    this.workerClass = workerClass;
    this.workerId = workerId || newWorkerId();
    this.leaseSeconds = leaseSeconds;
    this.waitSeconds = waitSeconds;
    this.leaderName = leader ? leaderName(workerClass, { baseUrl, leaderName: name }) : null;
    /** True while this instance holds the leadership (always false with `leader: false`). */
    this.isLeader = false;
    this._onLeader = onLeader;
    this._onOutcome = onOutcome;
    if (retryOn !== undefined && typeof retryOn !== "function") throw new TypeError("retryOn must be a function");
    this._retryOn = retryOn;
    this._stopper = new AbortController();
  }

  /** Ask run() to return: stops waiting for leadership, a claim's long poll, a backoff. */
  stop() {
    this._stopper.abort(new Aborted("the worker was stopped"));
  }

  /**
   * Claim and run requests until stop() or `signal` aborts; resolves with how many ran.
   * With `leader` (the default) this tab first waits to be the one leader of the browser
   * for this worker class. Transport errors and retryable statuses back off with full
   * jitter and go on; other errors (a 401, a 403) reject.
   */
  async run(handler, { signal } = {}) {
    if (typeof handler !== "function") throw new TypeError("handler must be a function");
    const stop = this._combined(signal);
    const loop = () => this._loop(handler, stop);
    try {
      if (!this.leaderName) return await loop();
      return await whileLeader(this.leaderName, loop, {
        signal: stop,
        locks: webLocks(),
        onLeader: (leading) => {
          this.isLeader = leading;
          this._onLeader?.(leading);
        },
      });
    } catch (error) {
      if (stop.aborted) return this._runs ?? 0;
      throw error;
    } finally {
      this.isLeader = false;
    }
  }

  async _loop(handler, stop) {
    this._runs = 0;
    let failures = 0;
    while (!stop.aborted) {
      let outcome;
      try {
        // On a shared wire a claim is a short call: a long poll would hold the one connection.
        outcome = await this.runOnce(handler, { wait: this.api.lane ? 0 : this.waitSeconds, signal: stop });
        failures = 0;
      } catch (error) {
        if (stop.aborted || error instanceof Aborted) break;
        if (!isRetryable(error)) throw error;
        try {
          await sleep(backoffDelay(failures++, { retryAfterMs: error.retryAfterMs || 0 }), stop);
        } catch {
          break;
        }
        continue;
      }
      if (outcome !== null) {
        this._runs += 1;
        this._onOutcome?.(outcome);
      } else if (this.api.lane) {
        try {
          await sleep(this.claimPollMs, stop);
        } catch {
          break;
        }
      }
    }
    return this._runs;
  }

  /** Claim the next due request (long poll up to `wait` s), or null. Not retried. */
  async claim(wait = 0, signal) {
    const body = { worker_id: this.workerId };
    if (this.leaseSeconds !== undefined) body.lease_seconds = this.leaseSeconds;
    if (wait) body.wait = wait;
    const path = `/v1/worker-classes/${seg(this.workerClass)}/claims`;
    // A claim whose answer was lost is left to lapse: its lease runs out, someone claims it.
    const sentAt = Date.now();
    const lane = !(wait > 0); // a long poll is not sent on the tabs' shared wire
    const answer = await this.api.call("POST", path, body, { signal, timeoutMs: this.api.timeoutMs + wait * 1000, lane });
    if (answer.status === 204) return null;
    if (answer.status !== 201) throw errorFor(answer.status, answer.body, "claim");
    return new PullClaim({ ...answer.body, sentAt });
  }

  /**
   * Claim one request and run `handler(ctx)` on it: the outcome ("succeeded", "retry",
   * "dead", "cancelled", "lease_lost"), or null when nothing was claimed.
   */
  async runOnce(handler, { wait = 0, signal } = {}) {
    const claim = await this.claim(wait, signal);
    if (claim === null) return null;
    const ctx = new PullContext(this, claim);
    const input = claim.request?.input;
    if (input && typeof input === "object" && input.onceflow_unreadable === true && "reason" in input) {
      // a value stored before the depth limit: it never will run
      return this._fail(ctx, { type: "PermanentError", message: `input cannot be read: ${input.reason}` }, false);
    }
    const onStop = () => ctx._halt(new Aborted("the worker was stopped"));
    signal?.addEventListener("abort", onStop, { once: true });
    const beat = this._heartbeat(ctx);
    try {
      const result = await handler(ctx);
      ctx.check();
      await this._claimCall(ctx, "complete", { result: result === undefined ? null : result, then: ctx._then });
      return "succeeded";
    } catch (error) {
      const reason = ctx._stop || error;
      if (reason instanceof LeaseLost) return "lease_lost";
      if (reason instanceof Cancelled) return this._fail(ctx, { type: "Cancelled" }, false);
      if (reason instanceof Aborted) {
        // Stopped by its page: hand the request back now rather than after the lease.
        return this._fail(ctx, { type: "Aborted", message: "the worker was stopped" }, true, 0);
      }
      const { error: report, retryable } = failureOf(error, this._retryOn);
      return this._fail(ctx, report, retryable);
    } finally {
      signal?.removeEventListener("abort", onStop);
      beat.stop();
      ctx.events.close();
    }
  }

  // ------------------------------------------------------------------ helpers

  _combined(signal) {
    if (!signal) return this._stopper.signal;
    if (typeof AbortSignal.any === "function") return AbortSignal.any([signal, this._stopper.signal]);
    const both = new AbortController();
    for (const s of [signal, this._stopper.signal]) {
      if (s.aborted) both.abort(s.reason);
      else s.addEventListener("abort", () => both.abort(s.reason), { once: true });
    }
    return both.signal;
  }

  /**
   * A fenced call on the claim, retried on no answer and 5xx (each is safe to repeat: a
   * read, a heartbeat extends the same lease, an op joins its op id, and a completion or failure
   * that landed makes its repeat 409 lease_lost — never a second write). A 409 lease_lost
   * stops the stage (ctx.signal aborts) and is thrown as LeaseLost.
   */
  async _claimCall(ctx, action, body) {
    const path = `/v1/claims/${seg(ctx.claim.requestId)}/${action}`;
    const stageCall = action === "ops" || action === "sub-docs" || action === "heartbeat";
    try {
      const answer = await this.api.callRetrying("POST", path, { ...claimBody(ctx.claim), ...body }, {
        signal: stageCall ? ctx.signal : undefined,
        what: action,
        headers: traceHeaders(ctx.claim.traceContext),
      });
      return answer.body;
    } catch (error) {
      if (error instanceof LeaseLost) ctx._halt(error);
      if (error instanceof Aborted && ctx._stop) throw ctx._stop;
      throw error;
    }
  }

  async _fail(ctx, error, retryable, retryIn) {
    const body = { error, retryable };
    if (retryIn !== undefined) body.retry_in = retryIn;
    try {
      return failOutcome(await this._claimCall(ctx, "fail", body));
    } catch (caught) {
      if (caught instanceof LeaseLost) return "lease_lost";
      throw caught;
    }
  }

  /**
   * Extends the lease every lease/3 until stopped; halts the stage at lease-lost or cancel.
   * Each beat is given one interval to be answered; a beat without an answer (a timeout — it
   * may have waited for a socket the whole time —, a network error) or with a status other
   * than 200 and 409 is not a lost lease: it is sent again at once (short backoff), on the
   * tabs' wire before every other call (`priority: "high"`), while the lease holds as this
   * client knows it (a beat sent at t and answered 200 holds it until t + lease at least),
   * and after that at most one interval apart. Only a 409 lease_lost answer ends the lease.
   */
  _heartbeat(ctx) {
    const stopper = new AbortController();
    const interval = heartbeatIntervalMs(ctx.claim.leaseSeconds);
    const leaseMs = ctx.claim.leaseSeconds * 1000;
    const path = `/v1/claims/${seg(ctx.claim.requestId)}/heartbeat`;
    const headers = traceHeaders(ctx.claim.traceContext);
    const counts = this.heartbeats;
    let leaseUntil = ctx.claim.sentAt + leaseMs;
    (async () => {
      let next = ctx.claim.sentAt + interval;
      while (!stopper.signal.aborted && !ctx._stop) {
        try {
          await sleep(next - Date.now(), stopper.signal);
        } catch {
          return;
        }
        for (let attempt = 0; !ctx._stop; attempt++) {
          const sentAt = Date.now();
          let answer = null;
          try {
            counts.sent += 1;
            // On the shared wire it waits for the call in flight at most while the lease leaves
            // time to spare; then it is sent beside it (a call that hangs must not cost the lease).
            const laneWaitMs = Math.max(interval, leaseUntil - sentAt - interval / 2);
            answer = await this.api.call("POST", path, claimBody(ctx.claim), {
              signal: stopper.signal, timeoutMs: interval, headers, priority: "high", laneWaitMs,
            });
          } catch (error) {
            if (error instanceof Aborted || stopper.signal.aborted) return;
            // no answer in time: the lease may still hold, send it again
          }
          if (answer?.status === 200) {
            counts.answered += 1;
            leaseUntil = Math.max(leaseUntil, sentAt + leaseMs);
            if (answer.body?.cancel_requested) ctx._halt(new Cancelled(`request ${ctx.claim.requestId}: cancel requested`));
            next = sentAt + interval;
            break;
          }
          if (answer !== null) {
            const error = errorFor(answer.status, answer.body, "heartbeat");
            if (error instanceof LeaseLost) {
              counts.lost += 1;
              ctx._halt(error);
              return;
            }
          }
          counts.retried += 1;
          const cap = Date.now() < leaseUntil ? Math.max(20, interval / 4) : interval;
          try {
            await sleep(backoffDelay(attempt, { baseMs: 20, capMs: cap }), stopper.signal);
          } catch {
            return;
          }
        }
      }
    })();
    return { stop: () => stopper.abort() };
  }
}
