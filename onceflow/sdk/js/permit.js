// onceflow SDK — provider permits for a pull worker: a tab shares a provider's limits
// (requests, tokens and calls in flight per window, cooling after a 429) and the workspace's
// budgets with every Celery stage, agent and script, the server holding the permit for the
// claim (POST /v1/claims/{id}/permits, …/permits/{permitId}/settle, /rate-limited, /release).
//
//   const answer = await ctx.permit("openai", { tokens: 1500 }, async (permit) => {
//     const reply = await callTheApi();
//     if (reply.status === 429) {
//       await permit.rateLimited(reply.retryAfter);   // every client waits it out
//       throw new RetryLater(reply.retryAfter);
//     }
//     await permit.settle({ inputTokens: reply.usage.input, outputTokens: reply.usage.output });
//     return reply.text;
//   });
//
// Asking long-polls the server (at most 20 s an ask) and asks again, with the same permit id
// (a lost answer is never a second permit), at most a second after each refusal (so the
// workspace keeps counting as waiting for its fair share), until `timeoutMs`: PermitTimeout
// (retryable). A
// budget's refusal throws BudgetExceeded (the stage then fails, or waits for the next
// period). A body that returns or throws without a settle gives the permit back: "unsettled"
// (its estimate stays counted: the call may have been made) or "failed". A closed tab's
// permit frees its slot at the provider's permit TTL.

import { Aborted, NetworkError, OnceflowError, errorFor, isRetryable, retryAfterMs, seg, sleep } from "./transport.js";

/** The longest one ask waits on the server (its long poll, seconds). */
export const ASK_SECONDS = 20;
/** The default bound of a permit's wait, as Python's `provider.permit` (ms). */
export const PERMIT_TIMEOUT_MS = 60_000;
/**
 * The longest pause between two asks (ms), whatever the server's hint (which for a request
 * or token limit can be most of a window): the workspace counts as waiting for its fair
 * share only while it keeps asking, and the server's long poll does the waiting.
 */
export const ASK_PAUSE_MS = 1_000;

/** No permit was granted within `timeoutMs`: the provider stayed busy. Retryable. */
export class PermitTimeout extends OnceflowError {
  constructor(provider, timeoutMs, reason = "") {
    super(`no permit from provider ${provider} within ${timeoutMs} ms${reason ? ` (last refused by: ${reason})` : ""}`);
    this.provider = provider;
    this.timeoutMs = timeoutMs;
    this.reason = reason;
    this.retryable = true;
  }
}

/** A fresh permit id: 32 hex digits (a uuid4's 122 random bits and more). */
export function newPermitId() {
  const bytes = globalThis.crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// Constructor alike by shape to ClaimLocks' on purpose: each takes the claim's parts, no more.
/**
 * The permit calls of one claim. `ask` → `{granted: true, granted_at_ms, expires_in_ms}` or
 * `{granted: false, reason, retry_after_ms}`; `send(permitId, action, body)` settles,
 * reports a 429 or releases. A 409 lease_lost is thrown as LeaseLost, a 402 as
 * BudgetExceeded.
 */
export class ClaimPermits {
  // A constructor keeping its arguments (alike by shape with ClaimEvents'): nothing to share.
  constructor(api, requestId, token, { signal, workspaceId, headers = {} } = {}) {
    this.api = api;
    this.requestId = requestId;
    /** The claimed request's workspace, sent with the token (the row's key), if known. */
    this.workspaceId = workspaceId;
    Object.defineProperty(this, "_token", { value: token, enumerable: false });
    this.signal = signal;
    /** Sent with every permit call: the claim's trace (`traceparent`), when it has one. */
    this.headers = headers;
  }

  _body() {
    const body = { claim_token: this._token };
    if (this.workspaceId !== undefined && this.workspaceId !== null) body.workspace_id = this.workspaceId;
    return body;
  }

  /** One ask (a long poll of `waitSeconds`); not retried here: the caller asks again. */
  async ask(provider, { tokens = 0, permitId, cellKey, waitSeconds = 0 } = {}) {
    const body = { ...this._body(), provider, tokens, permit_id: permitId, wait_seconds: waitSeconds };
    if (cellKey !== undefined && cellKey !== null) body.cell_key = cellKey;
    const path = `/v1/claims/${seg(this.requestId)}/permits`;
    // A long poll is not sent on the tabs' shared wire (it would hold it): a connection of its own.
    const lane = !(waitSeconds > 0);
    const answer = await this.api.call("POST", path, body, { signal: this.signal, timeoutMs: this.api.timeoutMs + waitSeconds * 1000, headers: this.headers, lane });
    if (answer.status === 200) return { ...answer.body, granted: true };
    if (answer.status === 429) {
      // The provider is busy (provider_busy), or the key's request rate is spent.
      const ms = Number.isFinite(answer.body?.retry_after_ms) ? answer.body.retry_after_ms : retryAfterMs(answer.headers);
      return { granted: false, reason: String(answer.body?.reason || answer.body?.code || "busy"), retry_after_ms: ms };
    }
    throw errorFor(answer.status, answer.body, "permit");
  }

  /** `settle`, `rate-limited` or `release` a permit: safe to repeat, so retried. */
  async send(permitId, action, body) {
    // Not tied to the stage's signal: a stage stopped by a lost lease still gives it back.
    const path = `/v1/claims/${seg(this.requestId)}/permits/${seg(permitId)}/${action}`;
    const answer = await this.api.callRetrying("POST", path, { ...this._body(), ...body }, { what: `permit ${action}`, headers: this.headers });
    return answer.body;
  }
}

function tokenCount(name, value) {
  if (!Number.isSafeInteger(value) || value < 0) throw new TypeError(`${name} must be a whole number of tokens, not negative`);
  return value;
}

/** A permit the server holds for the claim: settle it, report a 429, or release it. */
export class Permit {
  constructor(permits, provider, permitId, answer) {
    this._permits = permits;
    this.provider = provider;
    this.permitId = permitId;
    /** When it was granted, on the Redis clock (ms since the epoch). */
    this.grantedAtMs = Number(answer.granted_at_ms);
    /** Its TTL: not settled by then, its slot is freed for others. */
    this.expiresInMs = Number(answer.expires_in_ms);
    /** null until settled: "ok", "rate_limited", "unused", "failed" or "unsettled". */
    this.outcome = null;
    // A settle, report or release sent without an answer: the server may have applied it,
    // so only the same one may finish the permit (sent again on leaving).
    this._pending = null;
  }

  get settled() {
    return this.outcome !== null;
  }

  async _send(action, body, outcome) {
    if (this.outcome !== null) throw new OnceflowError(`permit ${this.permitId} is already settled (${this.outcome})`);
    const sent = { action, body, outcome };
    if (this._pending !== null && JSON.stringify(this._pending) !== JSON.stringify(sent)) {
      throw new OnceflowError(`permit ${this.permitId} was sent ${this._pending.action} ${JSON.stringify(this._pending.body)} without an answer; only the same may be sent again`);
    }
    try {
      await this._permits.send(this.permitId, action, body);
    } catch (error) {
      if (isRetryable(error)) this._pending = sent; // it may have landed: sent again on leaving
      throw error;
    }
    this._pending = null;
    this.outcome = outcome;
  }

  /** The call's usage `{inputTokens, outputTokens}`: the estimate corrected, the slot freed, the ledger row written. */
  settle({ inputTokens, outputTokens } = {}, { model } = {}) {
    const usage = { input_tokens: tokenCount("inputTokens", inputTokens), output_tokens: tokenCount("outputTokens", outputTokens) };
    const body = { usage };
    if (model !== undefined && model !== null) body.model = model;
    return this._send("settle", body, "ok");
  }

  /** The provider answered 429: every client waits `retryAfter` seconds (else the provider's cooldown). */
  rateLimited(retryAfter) {
    if (retryAfter !== undefined && retryAfter !== null && !(Number.isFinite(retryAfter) && retryAfter >= 0)) {
      throw new TypeError("retryAfter must be a number of seconds, not negative");
    }
    return this._send("rate-limited", { retry_after: retryAfter ?? null }, "rate_limited");
  }

  /** No call was made: the slot and the estimate's tokens come back, nothing recorded. */
  release() {
    return this._send("release", { outcome: "unused" }, "unused");
  }

  /**
   * Left without a settle: "failed" (the body threw) or "unsettled" (estimate counted). A
   * settle (or report, or release) that got no answer is sent again as it was instead: the
   * call's usage is recorded, not lost to a release.
   */
  leave(failed) {
    if (this._pending !== null) {
      const { action, body, outcome } = this._pending;
      return this._send(action, body, outcome);
    }
    const outcome = failed ? "failed" : "unsettled";
    return this._send("release", { outcome }, outcome);
  }
}

/**
 * Ask until granted: a Permit, PermitTimeout after `timeoutMs`, BudgetExceeded when a
 * budget refuses. `guard()` throws when the stage must stop (checked before each ask);
 * `signal` aborts the wait.
 */
export async function takePermit(permits, provider, { tokens = 0, cellKey, timeoutMs = PERMIT_TIMEOUT_MS, guard = () => {}, signal } = {}) {
  if (typeof provider !== "string" || provider.length === 0 || provider.length > 200) throw new TypeError("provider must be a provider's name (1..200 characters)");
  tokenCount("tokens", tokens);
  if (!(Number.isFinite(timeoutMs) && timeoutMs >= 0)) throw new RangeError("timeoutMs must be a number of ms, not negative");
  const permitId = newPermitId();
  const deadline = Date.now() + timeoutMs;
  let reason = "";
  for (;;) {
    guard();
    const waitSeconds = Math.max(0, Math.min(ASK_SECONDS, (deadline - Date.now()) / 1000));
    let pauseMs;
    try {
      const got = await permits.ask(provider, { tokens, permitId, cellKey, waitSeconds });
      if (got.granted) return new Permit(permits, provider, permitId, got);
      reason = got.reason;
      pauseMs = Math.min(Number(got.retry_after_ms) || 0, ASK_PAUSE_MS);
    } catch (error) {
      if (!(error instanceof NetworkError)) throw error;
      reason = "no answer"; // ask again: the same permit id is the same permit
      pauseMs = 500;
    }
    const left = deadline - Date.now();
    if (left <= 0) throw new PermitTimeout(provider, timeoutMs, reason);
    await sleep(Math.min(pauseMs, left), signal);
  }
}

/**
 * `body(permit)` under a permit of `provider`: what it returns. A body that returns or
 * throws without settling gives the permit back ("unsettled" or "failed").
 */
export async function withPermit(permits, provider, options, body) {
  if (typeof body !== "function") throw new TypeError("the permit's body must be a function");
  const permit = await takePermit(permits, provider, options);
  let failed = true;
  try {
    const result = await body(permit);
    failed = false;
    return result;
  } finally {
    if (!permit.settled) {
      try {
        await permit.leave(failed);
      } catch (error) {
        // Not given back: its slot is freed at the permit's TTL all the same.
        if (!failed && !(error instanceof Aborted)) throw error;
      }
    }
  }
}
