// onceflow SDK — the transport every part shares: one fetch wrapper, the error classes,
// backoff with full jitter, op ids and a streaming SSE reader. No dependencies, no build:
// an ES module for browsers (and Node >= 20 for its pure parts).

/** Every error the SDK throws. `status` and `code` come from the API's error body. */
export class OnceflowError extends Error {
  constructor(message, { status = 0, code = "", body = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = new.target.name;
    this.status = status;
    this.code = code;
    this.body = body;
  }
}

/** The network failed or timed out: nothing is known of the server's answer. Retryable. */
export class NetworkError extends OnceflowError {}

/** The server answered with an error (`status`, `code` as in the API's `{detail, code}`). */
export class HttpError extends OnceflowError {}

/** 409 lease_lost: the claim is gone — stop, and write nothing more for it. */
export class LeaseLost extends HttpError {}

/**
 * 402 budget_exceeded: a spend budget of the workspace has no room for a provider call
 * (nothing was reserved). `onExceeded` "fail": the stage fails without retries; "wait": it
 * is retried when the next period starts (`retryAt`, `retryIn` seconds).
 */
export class BudgetExceeded extends HttpError {
  constructor(message, options = {}) {
    super(message, options);
    const body = options.body && typeof options.body === "object" ? options.body : {};
    this.workspaceId = typeof body.workspace_id === "string" ? body.workspace_id : "";
    this.period = typeof body.period === "string" ? body.period : "";
    this.onExceeded = body.on_exceeded === "wait" ? "wait" : "fail";
    this.retryAt = typeof body.retry_at === "string" ? body.retry_at : null;
    this.retryIn = Number.isFinite(body.retry_in) ? body.retry_in : null;
  }

  /** Whether the stage waits for the next period (else it fails at once). */
  get waits() {
    return this.onExceeded === "wait" && this.retryIn !== null;
  }
}

/** A heartbeat said cancel was requested: stop the stage. */
export class Cancelled extends OnceflowError {}

/** The stage (or the client) was stopped by its AbortSignal. */
export class Aborted extends OnceflowError {}

/** `waitFor`'s timeout passed before the request ended; `request`: the request as last read. */
export class WaitTimeout extends OnceflowError {
  constructor(message, { request = null, ...rest } = {}) {
    super(message, rest);
    this.request = request;
  }
}

/** Statuses worth retrying with the same request (the request must be safe to repeat). */
export const RETRYABLE_STATUS = new Set([408, 425, 429, 500, 502, 503, 504]);

/** True for an error that a retry of the same (idempotent) request may cure. */
export function isRetryable(error) {
  if (error instanceof NetworkError) return true;
  return error instanceof HttpError && !(error instanceof LeaseLost) && RETRYABLE_STATUS.has(error.status);
}

/**
 * The delay before retry number `attempt` (0 = the first retry): "full jitter", a uniform
 * draw in [0, min(capMs, baseMs * 2^attempt)], so clients that failed together do not
 * come back together. A server's Retry-After (ms) is a floor.
 */
export function backoffDelay(attempt, { baseMs = 200, capMs = 10_000, random = Math.random, retryAfterMs = 0 } = {}) {
  const ceiling = Math.min(capMs, baseMs * 2 ** Math.max(0, Math.min(attempt, 30)));
  return Math.max(retryAfterMs, Math.floor(random() * ceiling));
}

/**
 * The W3C trace headers of a claim's stored trace context (`traceparent`, then a newline and
 * `tracestate` when there is one): sent on the claim's calls, so the server's spans of them
 * join the trace the request was enqueued under. `{}` when there is none.
 */
export function traceHeaders(traceContext) {
  if (typeof traceContext !== "string" || !traceContext) return {};
  const [parent, state] = traceContext.split("\n", 2);
  if (!/^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$/.test(parent)) return {};
  return state ? { traceparent: parent, tracestate: state } : { traceparent: parent };
}

/** Retry-After (seconds, or an HTTP date) in ms; 0 when absent or unreadable. */
export function retryAfterMs(headers, now = Date.now()) {
  const value = headers && typeof headers.get === "function" ? headers.get("retry-after") : null;
  if (!value) return 0;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const at = Date.parse(value);
  return Number.isFinite(at) ? Math.max(0, at - now) : 0;
}

// nanoid's URL-safe alphabet: 64 symbols, so a random byte's low 6 bits pick one uniformly.
const ALPHABET = "useandom-26T198340PX75pxJACKVERYMINDBUSHWOLF_GQZbfghjklqvwyzrict";

/**
 * A new op id: `size` symbols (default 21: 126 random bits, nanoid's strength) drawn
 * from Web Crypto. Matches the API's op id pattern `^[A-Za-z0-9_-]{16,64}$`.
 */
export function newOpId(size = 21) {
  if (!Number.isInteger(size) || size < 16 || size > 64) throw new RangeError("op id size must be 16..64");
  const bytes = globalThis.crypto.getRandomValues(new Uint8Array(size));
  let id = "";
  for (const byte of bytes) id += ALPHABET[byte & 63];
  return id;
}

/** Wait `ms`, or reject with Aborted as soon as `signal` aborts. */
export function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(new Aborted("aborted"));
    const timer = setTimeout(done, Math.max(0, ms));
    function done() {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }
    function onAbort() {
      clearTimeout(timer);
      reject(new Aborted("aborted"));
    }
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * The error for a non-2xx answer: LeaseLost for 409 lease_lost, BudgetExceeded for 402
 * budget_exceeded, else HttpError.
 */
export function errorFor(status, body, what = "request") {
  const code = body && typeof body.code === "string" ? body.code : "";
  const detail = body && typeof body.detail === "string" ? body.detail : `HTTP ${status}`;
  let Kind = HttpError;
  if (status === 409 && code === "lease_lost") Kind = LeaseLost;
  else if (status === 402 && code === "budget_exceeded") Kind = BudgetExceeded;
  return new Kind(`${what}: ${status} ${code || ""} ${detail}`.replace(/\s+/g, " ").trim(), { status, code, body });
}

/**
 * The API's client: base URL, key, JSON in and out. `call` returns `{status, body, headers}`
 * for every HTTP answer (the caller decides what a status means) and throws NetworkError
 * when there is none (offline, refused, reset, timed out).
 *
 * `apiKey` is a key (a string), or a function returning a short-lived token (or a promise
 * of one) — a worker token the app's back end mints. The function is called for the first
 * call, and again when a call is answered 401 (the token expired): that call is then sent
 * once more with the new token. The server checks the key before it does anything, so
 * a 401 changed nothing and repeating the call is safe; a claim held under the old token
 * is kept (its claim token does not depend on the key). Calls answered 401 together share
 * one refresh.
 */
export class Api {
  constructor(baseUrl, { apiKey, fetch: fetchImpl = globalThis.fetch, timeoutMs = 30_000, lane = null } = {}) {
    const refreshes = typeof apiKey === "function";
    if (!refreshes && (!apiKey || typeof apiKey !== "string")) {
      throw new TypeError("apiKey is required: a key, or a function returning a token");
    }
    this.baseUrl = String(baseUrl || "").replace(/\/+$/, "");
    this.timeoutMs = timeoutMs;
    /**
     * The tabs' shared wire (a TabLink, see tabs.js), or null: with one, each `call` is sent
     * as the one call of the browser profile in flight (streams and long polls, sent with
     * `lane: false`, are not).
     */
    this.lane = lane;
    this._fetch = fetchImpl.bind(globalThis);
    // The key lives in this object only: never in a URL, never logged, never stored.
    const key = { fetchToken: refreshes ? apiKey : null, auth: refreshes ? null : `Bearer ${apiKey}`, pending: null };
    Object.defineProperty(this, "_key", { value: key, enumerable: false });
  }

  /** The Authorization header: the key, or the current token (fetched first if none). */
  async _authorization() {
    const key = this._key;
    return key.auth ?? (await this._refresh(null));
  }

  /** A new token unless one newer than `stale` is already there (one refresh at a time). */
  async _refresh(stale) {
    const key = this._key;
    if (key.auth !== null && key.auth !== stale) return key.auth;
    if (key.pending === null) {
      key.pending = (async () => {
        try {
          const token = await key.fetchToken();
          if (!token || typeof token !== "string") throw new TypeError("apiKey() must return a token (a string)");
          key.auth = `Bearer ${token}`;
          return key.auth;
        } finally {
          key.pending = null;
        }
      })();
    }
    return key.pending;
  }

  /** `fetch` with the key, a timeout, and an optional caller signal; with a token function,
   * a 401 gets a fresh token and one more try. */
  async raw(method, path, options = {}) {
    const auth = await this._authorization();
    const response = await this._send(method, path, auth, options);
    if (response.status !== 401 || this._key.fetchToken === null) return response;
    let fresh;
    try {
      fresh = await this._refresh(auth);
    } catch (error) {
      throw new HttpError(`${method} ${path}: 401 and no new token (${error?.message || error})`, { status: 401, code: "unauthorized", cause: error });
    }
    await response.body?.cancel?.().catch(() => {});
    return this._send(method, path, fresh, options);
  }

  async _send(method, path, auth, { body, signal, timeoutMs = this.timeoutMs, headers = {}, priority, stream = false } = {}) {
    const controller = new AbortController();
    const onAbort = () => controller.abort(signal.reason);
    if (signal?.aborted) throw new Aborted("aborted");
    signal?.addEventListener("abort", onAbort, { once: true });
    const timer = timeoutMs > 0 ? setTimeout(() => controller.abort(new Error("timeout")), timeoutMs) : null;
    let answered = false;
    try {
      const init = { method, headers: { Authorization: auth, ...headers }, signal: controller.signal, cache: "no-store" };
      // "high" (heartbeats): the browser gives the next free socket to it before the others.
      if (priority) init.priority = priority;
      if (body !== undefined) {
        init.body = JSON.stringify(body);
        init.headers["Content-Type"] = "application/json";
      }
      const response = await this._fetch(this.baseUrl + path, init);
      answered = true;
      return response;
    } catch (error) {
      if (signal?.aborted) throw new Aborted("aborted", { cause: error });
      throw new NetworkError(`${method} ${path}: no answer (${error?.message || error})`, { cause: error });
    } finally {
      if (timer !== null) clearTimeout(timer);
      // A stream (`stream: true`, its own signal) stays tied to `signal` while its body is
      // read: aborting it then closes the connection, not only the wait for the headers.
      if (!(stream && answered)) signal?.removeEventListener("abort", onAbort);
    }
  }

  /**
   * One JSON call: `{status, body, headers}`; the body is null when empty or not JSON. With a
   * lane, sent (and read) on the tabs' shared wire unless `lane: false` (a long poll);
   * `priority: "high"` goes before the other calls waiting, and `laneWaitMs` bounds the wait
   * for the wire (then the call is sent beside it).
   */
  async call(method, path, body, options = {}) {
    const { lane = true, laneWaitMs, ...rest } = options;
    if (!this.lane || lane === false) return this._call(method, path, body, rest);
    try {
      return await this.lane.send(() => this._call(method, path, body, rest), {
        priority: rest.priority, signal: rest.signal, waitMs: laneWaitMs,
      });
    } catch (error) {
      // stopped while waiting for the wire (the lock's request rejects with the signal's reason)
      if (rest.signal?.aborted && !(error instanceof Aborted)) throw new Aborted("aborted", { cause: error });
      throw error;
    }
  }

  async _call(method, path, body, options) {
    const response = await this.raw(method, path, { ...options, body });
    let parsed = null;
    try {
      const text = await response.text();
      parsed = text ? JSON.parse(text) : null;
    } catch (error) {
      if (options.signal?.aborted) throw new Aborted("aborted", { cause: error });
      if (!(error instanceof SyntaxError)) throw new NetworkError(`${method} ${path}: the answer was cut`, { cause: error });
    }
    return { status: response.status, body: parsed, headers: response.headers };
  }

  /**
   * A call that is safe to repeat, retried on no answer and on RETRYABLE_STATUS with
   * backoff and jitter, up to `attempts` tries (Infinity: until `signal` aborts). Returns
   * the first other answer; throws errorFor() for a non-2xx one.
   */
  async callRetrying(method, path, body, { signal, attempts = 5, backoff = {}, what, onRetry, timeoutMs, headers, lane } = {}) {
    for (let attempt = 0; ; attempt++) {
      let error;
      try {
        const answer = await this.call(method, path, body, { signal, timeoutMs, headers, lane });
        if (answer.status < 300) return answer;
        error = errorFor(answer.status, answer.body, what || `${method} ${path}`);
        error.retryAfterMs = retryAfterMs(answer.headers);
      } catch (caught) {
        error = caught;
      }
      if (!isRetryable(error) || attempt + 1 >= attempts) throw error;
      onRetry?.(error, attempt);
      await sleep(backoffDelay(attempt, { ...backoff, retryAfterMs: error.retryAfterMs || 0 }), signal);
    }
  }
}

/** One percent-encoded path segment (ids may hold `/`, `:` and other reserved characters). */
export function seg(value) {
  return encodeURIComponent(String(value));
}

/**
 * The events of a `text/event-stream` body, parsed as the HTML standard says (fields
 * `event`, `data`, `id`; comments and `retry` ignored; CRLF, LF or CR line ends; an event
 * is dispatched at a blank line, one without data is not). Yields `{event, data, id}`
 * with `event` defaulting to "message". Works on any async iterable of Uint8Array chunks
 * (a fetch body in browsers and in Node).
 */
export async function* sseEvents(chunks) {
  const decoder = new TextDecoder();
  let buffer = "";
  let event = "";
  let data = [];
  let id = null;
  let pendingCR = false;
  for await (const chunk of iterate(chunks)) {
    let text = decoder.decode(chunk, { stream: true });
    if (pendingCR && text.startsWith("\n")) text = text.slice(1);
    pendingCR = false;
    buffer += text;
    let match;
    while ((match = /\r\n|\r|\n/.exec(buffer)) !== null) {
      if (match[0] === "\r" && match.index === buffer.length - 1) {
        pendingCR = true; // a CR at the chunk's end may be the first half of CRLF
      }
      const line = buffer.slice(0, match.index);
      buffer = buffer.slice(match.index + match[0].length);
      if (line === "") {
        if (data.length) yield { event: event || "message", data: data.join("\n"), id };
        event = "";
        data = [];
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
      else if (field === "id" && !value.includes("\0")) id = value;
    }
  }
}

async function* iterate(chunks) {
  if (chunks && typeof chunks.getReader === "function" && !(Symbol.asyncIterator in chunks)) {
    const reader = chunks.getReader();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        yield value;
      }
    } finally {
      reader.releaseLock();
    }
  } else {
    yield* chunks;
  }
}
