// onceflow SDK — the retry-safe op client of one workspace (the design note's layer 3): an op id
// minted before the first send and kept with the op in an outbox until the server answers, so a
// retry, a reload or a reconnect replays the op under the same id and the server applies it once.
// Live commits come over the workspace's event stream, with catch-up from the op log.

import {
  Aborted, Api, HttpError, NetworkError, WaitTimeout, backoffDelay, errorFor, isRetryable,
  newOpId, retryAfterMs, seg, sleep, sseEvents,
} from "./transport.js";
import { IndexedDbOutbox, MemoryOutbox, OutboxError } from "./outbox.js";
import { tabLink } from "./tabs.js";

export { IndexedDbOutbox, MemoryOutbox, OutboxError };

const PAGE = 500; // catch-up page size
const REBASES = 3; // times an op known never to have been applied is re-based and sent again
const LONG_POLL_MAX = 60; // seconds: the most one read's `?wait=` may ask for (the API's bound)
const WAIT_MAX = 3600; // seconds: the longest timeout waitFor takes
const ENDED = new Set(["succeeded", "dead", "cancelled"]);

/**
 * One workspace's op client. Events (it is an EventTarget; `on(name, cb)` is a shorthand):
 * - `applied`: an op was answered (`detail`: `{opId, seq, subDoc, clock, duplicate, applied,
 *   result, error}`), whether or not a promise still waits for it (after a reload none does);
 * - `refused`: the server refused an op for good (`detail`: `{opId, seq, subDoc, error}`);
 * - `pending`: the outbox changed (`detail`: `{count}`);
 * - `unauthorized`: a 401: the op stays and is retried; give a new key with `setApiKey`;
 * - `commit`: a commit of the workspace seen on the event stream (`detail`: its JSON data);
 * - `stream`: the event stream (open while something is subscribed) connected or was lost
 *   (`detail`: `{connected}`); after a loss it reconnects with backoff and catches up;
 * - `error`: a subscriber's callback threw (`detail`: the error), or the outbox failed to list
 *   or delete entries (`detail`: an OutboxError, its `cause` the storage's error): the client
 *   retries with backoff and goes on draining; an op the server answered settles all the same;
 * - `warning`: the default IndexedDB outbox could not be opened, so this client keeps its ops
 *   in memory (`detail`: `{message, error}`): they are not replayed after a reload.
 *
 * Two tabs with the same `clientName` share one outbox namespace (`<clientName>@<workspace>`).
 * With a shared outbox (IndexedDB) the namespace is drained under the Web Lock
 * `onceflow-outbox:<ns>` when `navigator.locks` exists, so one tab sends and no op is sent
 * twice at once; the others add to the outbox, and their promises settle through a
 * BroadcastChannel of the same name. A reloaded tab gets the same namespace and replays it.
 *
 * The tabs of one browser share its connections to the API (tabs.js; `shareTabs: false` opts
 * out): calls go one at a time on one wire, and a workspace's event stream is held by one tab
 * (the others hear its events over a BroadcastChannel, and catch up from the op log by clock
 * whenever the holder connects again or another tab takes over).
 */
export class WorkspaceClient extends EventTarget {
  /**
   * @param {object} options
   * @param {string} [options.baseUrl] the API's origin ("" = this page's)
   * @param {string} options.apiKey an API key for the workspace (sent as a Bearer header only)
   * @param {string} options.workspaceId
   * @param {MemoryOutbox|IndexedDbOutbox} [options.outbox] default: IndexedDB if present
   * @param {string} [options.clientName] names the outbox namespace with the workspace
   * @param {typeof fetch} [options.fetch]
   * @param {import("./transport.js").BackoffOptions} [options.backoff]
   * @param {boolean} [options.shareTabs] share the browser's connections with its other tabs
   *   (default true; nothing is shared without Web Locks and BroadcastChannel)
   * @param {boolean} [options.shareWire] with shareTabs, send calls one at a time on the
   *   browser's one wire (default true; false for an API served over HTTP/2)
   */
  constructor({ baseUrl = "", apiKey, workspaceId, outbox, clientName = "default", fetch, backoff = {}, shareTabs = true, shareWire = true } = {}) {
    super();
    checkId("workspaceId", workspaceId);
    checkId("clientName", clientName);
    this.workspaceId = workspaceId;
    this.namespace = `${clientName}@${workspaceId}`;
    this.outbox = outbox || (globalThis.indexedDB ? new IndexedDbOutbox() : new MemoryOutbox());
    this._outboxGiven = !!outbox;
    this._baseUrl = baseUrl;
    this._fetch = fetch;
    /** The tabs' shared link (tabs.js), or null: each call and stream of its own. */
    this.link = shareTabs ? (shareTabs === true ? tabLink(baseUrl) : shareTabs) : null;
    this._lane = shareWire ? this.link : null; // HTTP/2: `shareWire: false`, calls need no turn
    this._api = new Api(baseUrl, { apiKey, fetch, lane: this._lane });
    this._feed = null; // this client's following of the shared feed
    this._backoff = backoff;
    this._clocks = new Map(); // sub-doc -> the highest clock seen
    this._waiting = new Map(); // op id -> {resolve, reject}
    // Op ids minted here of which no attempt may have been applied (none made yet, or every one
    // refused as too old). In memory only: an op left by an earlier page load may be a replay.
    // Kept only while this client is its outbox's one sender (`_sole`: an outbox no other tab
    // sees, or the drain's Web Lock held), so that no other tab can have sent one of them.
    this._unsent = new Set();
    this._sole = false;
    this._subs = new Set();
    this._stop = new AbortController();
    this._poked = false;
    this._wake = null;
    this._started = null;
    this._stream = null;
    this._streamStop = null;
    this._streamRetry = null;
    this._channel = null;
    this._onOnline = () => this.retryNow();
  }

  /** Shorthand for addEventListener; the callback gets `event.detail`. Returns an off function. */
  on(name, callback) {
    const listener = (event) => callback(event.detail);
    this.addEventListener(name, listener);
    return () => this.removeEventListener(name, listener);
  }

  /**
   * Open the outbox and start draining it in `seq` order: ops left by an earlier page load
   * go first, under their stored ids and base clocks (answers as `applied`/`refused` events).
   * Called by `applyOp` too; calling it again does nothing. If the default IndexedDB outbox
   * cannot be opened (storage disabled or refused) the client goes on with a MemoryOutbox and
   * sends a `warning` event; a given outbox that cannot be opened rejects with OutboxError,
   * and the next call tries again.
   */
  start() {
    if (this._started) return this._started;
    const started = (this._started = (async () => {
      await this._openOutbox();
      if (this.outbox.shared && typeof BroadcastChannel === "function") {
        this._channel = new BroadcastChannel(`onceflow-outbox:${this.namespace}`);
        this._channel.onmessage = (message) => this._onChannel(message.data);
      }
      globalThis.addEventListener?.("online", this._onOnline);
      const locks = this.outbox.shared ? globalThis.navigator?.locks : null;
      this._sole = !this.outbox.shared;
      const drain = locks
        ? locks.request(`onceflow-outbox:${this.namespace}`, { signal: this._stop.signal }, () => {
          this._sole = true;
          return this._drain();
        })
        : this._drain();
      drain.catch((error) => { if (!this._stop.signal.aborted) this._emit("error", error); });
      this._emitPending();
    })());
    started.catch(() => { if (this._started === started) this._started = null; });
    return started;
  }

  async _openOutbox() {
    try {
      await this.outbox.open();
    } catch (error) {
      if (this._outboxGiven || !(this.outbox instanceof IndexedDbOutbox)) {
        throw new OutboxError(`the outbox could not be opened: ${describe(error)}`, { cause: error });
      }
      this.outbox.close();
      this.outbox = new MemoryOutbox();
      const message = `IndexedDB could not be opened (${describe(error)}): ops are kept in memory only and are not replayed after a reload`;
      this._emit("warning", { message, error });
    }
  }

  /**
   * Apply `op` to `subDoc` once. The op id is minted and stored with the op (and its base
   * clock) in the outbox before the first send; it is retried under that id on no answer and
   * on 408/425/429/5xx (Retry-After honoured), until the server answers. Resolves with the
   * answer (also for an op the state rejected: `applied: false`, `error` set); rejects with
   * HttpError on a refusal (any other 4xx, e.g. 400/403/404/413/422, 409 op_id_conflict or
   * replay_too_old: the op is dropped; an op this client minted and has not sent yet, while
   * the one sender of its outbox, is no replay: refused as too old, it is re-based on the
   * reported horizon and sent again), with Aborted on `close()` (the op stays for the next
   * start), with TypeError on bad input (nothing stored), with OutboxError when the outbox
   * cannot store the op (quota, storage refused: nothing is sent). A 401 is no answer about the op:
   * it stays in the outbox (and blocks the ones after it), an `unauthorized` event is sent
   * and it is retried with backoff, under a new key once `setApiKey` gives one.
   * @param {string} subDoc
   * @param {{type: string, [field: string]: unknown}} op
   * @param {{baseClock?: number|null}} [options] default: the last clock this client saw for
   *   `subDoc` (answers, commits, `read`, `subscribe`); 0 if it never saw the sub-doc, so that a
   *   replay of even a first op whose log row was pruned is refused, never applied twice
   * @returns {Promise<{opId: string, seq: number, subDoc: string, clock: number|null,
   *   duplicate: boolean, applied: boolean, result: unknown, error: unknown}>}
   */
  async applyOp(subDoc, op, { baseClock } = {}) {
    checkId("subDoc", subDoc);
    if (op === null || typeof op !== "object" || Array.isArray(op) || typeof op.type !== "string" || !op.type) {
      throw new TypeError('op must be an object with a string "type", e.g. {type: "cell.set", column, value}');
    }
    if (baseClock != null && !(Number.isSafeInteger(baseClock) && baseClock >= 0)) {
      throw new TypeError("baseClock must be a non-negative integer");
    }
    const body = JSON.parse(JSON.stringify(op)); // the JSON that will be sent, fixed now
    if (this._stop.signal.aborted) throw new Aborted("the client is closed");
    await this.start();
    // No read here: the op is stored before anything can lose it, and calls keep their order.
    if (baseClock == null) baseClock = this._clocks.get(subDoc) ?? 0;
    const opId = newOpId();
    const answer = new Promise((resolve, reject) => this._waiting.set(opId, { resolve, reject }));
    if (this._sole) this._unsent.add(opId);
    try {
      await this.outbox.add(this.namespace, { opId, subDoc, op: body, baseClock, mintedAt: Date.now() });
    } catch (error) {
      this._waiting.delete(opId);
      this._unsent.delete(opId);
      throw new OutboxError(`the op was not stored in the outbox, so it was not sent: ${describe(error)}`, { cause: error });
    }
    this._emitPending();
    this._channel?.postMessage({ kind: "added" });
    this._poke();
    return answer;
  }

  /** The outbox's entries (ops not yet answered), in send order. */
  pending() {
    return this.start().then(() => this.outbox.list(this.namespace));
  }

  /** The sub-doc's `{state, clock}` (and its clock becomes the next ops' base clock). */
  async read(subDoc) {
    checkId("subDoc", subDoc);
    const { body } = await this._api.callRetrying("GET", this._docPath(subDoc), undefined, { signal: this._stop.signal });
    this._seen(subDoc, body.clock);
    return { state: body.state, clock: body.clock };
  }

  /**
   * The request `requestId` of this workspace once it has ended (`succeeded`, `dead` or
   * `cancelled`), as the API reads it (`GET /v1/workspaces/{ws}/requests/{id}`). Each read is a
   * long poll (`?wait=`, up to 60 s) that the server answers as soon as the request ends, woken
   * by the database; reads repeat until it has ended or `timeout` seconds have passed, then
   * rejects with WaitTimeout (its `request`: the request as last read). No such request: HttpError
   * (status 404). A read without an answer is retried with backoff, as `read` is.
   * @param {string} requestId
   * @param {{timeout?: number, signal?: AbortSignal}} [options] `timeout` in seconds, in (0, 3600]
   *   (default 60); `signal` stops the wait (Aborted), as `close()` does
   * @returns {Promise<object>} the request (`request_id`, `status`, `result`, `error`, …)
   */
  async waitFor(requestId, { timeout = 60, signal } = {}) {
    checkId("requestId", requestId);
    if (typeof timeout !== "number" || !Number.isFinite(timeout) || timeout <= 0 || timeout > WAIT_MAX) {
      throw new TypeError(`timeout must be a number of seconds in (0, ${WAIT_MAX}]`);
    }
    const stop = signal ? AbortSignal.any([signal, this._stop.signal]) : this._stop.signal;
    const path = `/v1/workspaces/${seg(this.workspaceId)}/requests/${seg(requestId)}`;
    const deadline = Date.now() + timeout * 1000;
    for (;;) {
      const wait = Math.max(0, Math.min(LONG_POLL_MAX, (deadline - Date.now()) / 1000));
      const { body } = await this._api.callRetrying("GET", `${path}?wait=${wait.toFixed(3)}`, undefined, {
        signal: stop,
        backoff: this._backoff,
        what: `wait for request ${requestId}`,
        timeoutMs: wait * 1000 + this._api.timeoutMs, // the server holds the read up to `wait`
        lane: false, // a long poll: not on the tabs' shared wire (it would hold it)
      });
      if (ENDED.has(body?.status)) return body;
      if (Date.now() >= deadline) {
        throw new WaitTimeout(`request ${requestId} did not end within ${timeout} s`, { request: body });
      }
    }
  }

  /** The highest clock this client has seen for `subDoc` (undefined if none). */
  clockOf(subDoc) {
    return this._clocks.get(subDoc);
  }

  /** Use another key from now on (after a 401: the ops waiting are retried with it). */
  setApiKey(apiKey) {
    this._api = new Api(this._baseUrl, { apiKey, fetch: this._fetch, lane: this._lane });
    this.retryNow();
  }

  /** Cut the waits before a resend and a reconnect short (done on the browser's `online` too). */
  retryNow() {
    this._poke();
    this._streamRetry?.abort();
  }

  /**
   * Call `onCommit` once per commit of `subDoc` with a clock above `since`, in clock order
   * (default `since`: the sub-doc's clock now, so only new commits). Each commit is read from the
   * op log (`{opId, clock, subDoc, opType, payload, result, fence, committedAt}`): after
   * the stream's `ready`, after every reconnect, and on every live commit the client
   * catches up from the last clock it delivered, so none is missed or delivered twice.
   * @returns {() => void} unsubscribe
   */
  subscribe(subDoc, onCommit, { since } = {}) {
    checkId("subDoc", subDoc);
    if (typeof onCommit !== "function") throw new TypeError("onCommit must be a function");
    if (since != null && !(Number.isSafeInteger(since) && since >= 0)) throw new TypeError("since must be a non-negative integer");
    const sub = { subDoc, onCommit, last: since ?? null, busy: null, again: false, active: true };
    this._subs.add(sub);
    this._catchUp(sub);
    if (this.link) {
      this._feed ??= this.link.follow(this.workspaceId, {
        open: (stop, emit) => this._hold(stop, emit),
        onReady: () => this._onFeed("ready"),
        onEvent: (name, data) => this._onFeed("event", name, data),
        onDown: () => this._onFeed("down"),
      });
    } else {
      this._stream ??= this._follow();
    }
    return () => {
      sub.active = false;
      this._subs.delete(sub);
      if (this._subs.size) return;
      this._streamStop?.abort();
      this._feed?.close();
      this._feed = null;
    };
  }

  /** Stop sending and following; waiting promises reject with Aborted (their ops stay stored). */
  close() {
    this._stop.abort();
    this._streamStop?.abort();
    this._feed?.close();
    this._feed = null;
    this._wake?.();
    globalThis.removeEventListener?.("online", this._onOnline);
    this._channel?.close();
    for (const { reject } of this._waiting.values()) reject(new Aborted("the client was closed; the op stays in the outbox"));
    this._waiting.clear();
    this.outbox.close();
  }

  // ---------------------------------------------------------------------------- sending

  /**
   * Send the outbox's first entry until answered, delete it, settle it; again, until close().
   * A storage error (list or delete) is retried with backoff: the loop goes on. An answered op
   * settles (once) even when its deletion fails; the deletion is then retried, not the send.
   */
  async _drain() {
    const signal = this._stop.signal;
    let answered = null; // the op id answered and settled whose deletion failed
    for (let failures = 0; !signal.aborted; ) {
      try {
        this._poked = false;
        const [entry] = await this.outbox.list(this.namespace, 1);
        if (!entry) {
          await this._nap(Infinity);
          continue;
        }
        if (entry.opId === answered) {
          await this.outbox.delete(this.namespace, entry.seq, entry.opId);
        } else {
          const outcome = await this._send(entry);
          let deleteError = null;
          await this.outbox.delete(this.namespace, entry.seq, entry.opId).catch((error) => { deleteError = error; });
          answered = entry.opId;
          const settled = this._settle(entry, outcome);
          this._channel?.postMessage({ kind: "settled", opId: entry.opId, ...settled });
          if (deleteError) throw deleteError;
        }
        answered = null;
        failures = 0;
        this._emitPending();
      } catch (error) {
        if (signal.aborted) return;
        this._emit("error", new OutboxError(`the outbox could not be drained (retrying): ${describe(error)}`, { cause: error }));
        try {
          await this._nap(backoffDelay(failures++, this._backoff));
        } catch {
          return; // closed
        }
      }
    }
  }

  /**
   * Send until the server answers: `{answer}` or `{error}` (a refusal). Throws only Aborted.
   * An op no attempt of which may have been applied, refused as too old, is no replay: it is
   * re-based on the horizon the server reported and sent again (in memory: after a reload the
   * stored entry is a possible replay).
   */
  async _send(entry) {
    const path = `${this._docPath(entry.subDoc)}/ops`;
    const body = { op_id: entry.opId, op: entry.op, base_clock: entry.baseClock ?? null };
    for (let attempt = 0, rebases = 0; ; attempt++) {
      let error;
      const knownNew = this._unsent.delete(entry.opId); // from here on, this attempt may apply it
      try {
        const got = await this._api.call("POST", path, body, { signal: this._stop.signal });
        if (got.status < 300) return { answer: got.body || {} };
        error = errorFor(got.status, got.body, `op ${entry.opId}`);
        error.retryAfterMs = retryAfterMs(got.headers);
        const horizon = got.body?.horizon;
        if (knownNew && error.code === "replay_too_old" && Number.isSafeInteger(horizon) && rebases < REBASES) {
          rebases++;
          this._seen(entry.subDoc, horizon);
          body.base_clock = Math.max(horizon, body.base_clock ?? 0, this._clocks.get(entry.subDoc) ?? 0);
          this._unsent.add(entry.opId); // a refusal records nothing
          continue;
        }
        if (got.status === 401) this._emit("unauthorized", { opId: entry.opId, error });
        else if (!isRetryable(error)) return { error };
      } catch (caught) {
        if (!(caught instanceof NetworkError)) throw caught;
        error = caught;
      }
      await this._nap(backoffDelay(attempt, { ...this._backoff, retryAfterMs: error.retryAfterMs || 0 }));
    }
  }

  _settle(entry, { answer, error }) {
    const base = { opId: entry.opId, seq: entry.seq, subDoc: entry.subDoc };
    const waiting = this._waiting.get(entry.opId);
    this._waiting.delete(entry.opId);
    if (answer) {
      this._seen(entry.subDoc, answer.clock);
      const detail = {
        ...base, clock: answer.clock ?? null, duplicate: !!answer.duplicate, applied: !!answer.applied,
        result: answer.result ?? null, error: answer.error ?? null,
      };
      this._emit("applied", detail);
      waiting?.resolve(detail);
      return { detail };
    }
    this._emit("refused", { ...base, error });
    waiting?.reject(error);
    const { message, status, code, body } = error;
    return { error: { message, status, code, body } };
  }

  _onChannel(message) {
    if (message?.kind === "added") this._poke();
    if (message?.kind !== "settled") return;
    const waiting = this._waiting.get(message.opId);
    if (message.detail) this._seen(message.detail.subDoc, message.detail.clock);
    if (waiting) {
      this._waiting.delete(message.opId);
      if (message.detail) waiting.resolve(message.detail);
      else waiting.reject(new HttpError(message.error.message, message.error));
    }
    this._emitPending();
  }

  /** Wait `ms` or until poked; rejects with Aborted on close. */
  _nap(ms) {
    if (this._poked) {
      this._poked = false;
      return Promise.resolve();
    }
    return new Promise((resolve, reject) => {
      const signal = this._stop.signal;
      let timer = null;
      const end = (abort) => {
        clearTimeout(timer);
        signal.removeEventListener("abort", onAbort);
        if (this._wake === wake) this._wake = null;
        if (abort) reject(new Aborted("aborted"));
        else resolve();
      };
      const onAbort = () => end(true);
      const wake = () => { this._poked = false; end(false); };
      if (signal.aborted) return onAbort();
      if (Number.isFinite(ms)) timer = setTimeout(end, ms, false);
      signal.addEventListener("abort", onAbort, { once: true });
      this._wake = wake;
    });
  }

  _poke() {
    this._poked = true;
    this._wake?.();
  }

  // ---------------------------------------------------------------------------- following

  /** Follow the workspace alone: this client's own stream (no link shared with other tabs). */
  async _follow() {
    await this._hold(null, (what, name, data) => this._onFeed(what, name, data));
    this._stream = null;
    if (this._subs.size && !this._stop.signal.aborted) this._stream = this._follow();
  }

  /**
   * Hold the workspace's event stream while something is subscribed, until `stop` aborts or
   * the client closes: `emit("ready")` at each connection's `ready`, `emit("event", name,
   * data)` per event, `emit("down")` when a connection is lost; it reconnects with backoff.
   * Alone, `emit` is this client's own `_onFeed`; with the tabs' link, the link's fan-out.
   */
  async _hold(stop, emit) {
    const path = `/v1/workspaces/${seg(this.workspaceId)}/events`;
    let connected = false;
    for (let attempt = 0; this._subs.size && !this._stop.signal.aborted && !stop?.aborted; attempt++) {
      const streamStop = (this._streamStop = new AbortController());
      const onStop = () => streamStop.abort();
      stop?.addEventListener("abort", onStop, { once: true });
      const signal = streamStop.signal;
      try {
        const response = await this._api.raw("GET", path, { signal, timeoutMs: 0, stream: true, headers: { Accept: "text/event-stream" } });
        if (!response.ok) {
          const error = errorFor(response.status, await response.json().catch(() => null), "event stream");
          if (!isRetryable(error) && response.status !== 401) {
            this._emit("error", error); // 403/404: retrying will not help
            break;
          }
        } else {
          for await (const event of sseEvents(response.body)) {
            if (event.event === "ready") {
              attempt = -1; // connected: the next reconnect starts from a short wait
              connected = true;
              emit("ready");
            } else {
              emit("event", event.event, event.data);
            }
          }
        }
      } catch {
        if (signal.aborted || this._stop.signal.aborted) break; // else the stream broke: reconnect
      } finally {
        stop?.removeEventListener("abort", onStop);
        if (connected) {
          connected = false;
          emit("down");
        }
      }
      const wait = new AbortController(); // cut short by retryNow() (the browser's `online`)
      const onEnd = () => wait.abort();
      this._stop.signal.addEventListener("abort", onEnd, { once: true });
      stop?.addEventListener("abort", onEnd, { once: true });
      this._streamRetry = wait;
      await sleep(backoffDelay(Math.max(0, attempt), this._backoff), wait.signal).catch(() => {});
      this._stop.signal.removeEventListener("abort", onEnd);
      stop?.removeEventListener("abort", onEnd);
      if (this._stop.signal.aborted || stop?.aborted) break;
    }
  }

  /** The stream's news (this client's own, or the tabs' shared feed's). */
  _onFeed(what, name, data) {
    if (what === "ready") {
      this._emit("stream", { connected: true });
      for (const sub of this._subs) this._catchUp(sub);
    } else if (what === "down") {
      this._emit("stream", { connected: false });
    } else if (what === "event" && name === "commit") {
      let commit;
      try {
        commit = JSON.parse(data);
      } catch {
        return;
      }
      this._onCommit(commit);
    }
  }

  _onCommit(data) {
    this._seen(data.sub_doc, data.clock);
    this._emit("commit", data);
    for (const sub of this._subs) if (sub.subDoc === data.sub_doc && !(data.clock <= sub.last)) this._catchUp(sub);
  }

  /** Deliver `sub`'s commits above its last clock, page by page; one catch-up at a time. */
  async _catchUp(sub) {
    if (sub.busy) {
      sub.again = true;
      return;
    }
    sub.busy = (async () => {
      do {
        sub.again = false;
        if (sub.last == null) {
          const { body } = await this._api.callRetrying("GET", this._docPath(sub.subDoc), undefined, {
            signal: this._stop.signal, attempts: Infinity, backoff: this._backoff,
          });
          sub.last ??= body.clock;
        }
        for (;;) {
          const query = `?since=${sub.last}&limit=${PAGE}`;
          const { body } = await this._api.callRetrying("GET", `${this._docPath(sub.subDoc)}/ops${query}`, undefined, {
            signal: this._stop.signal, attempts: Infinity, backoff: this._backoff,
          });
          for (const op of body.ops) {
            if (!sub.active || op.clock <= sub.last) continue;
            sub.last = op.clock;
            this._seen(sub.subDoc, op.clock);
            const commit = {
              opId: op.op_id, clock: op.clock, subDoc: sub.subDoc, opType: op.op_type, payload: op.payload,
              result: op.result, fence: op.fence, committedAt: op.committed_at,
            };
            try {
              sub.onCommit(commit);
            } catch (error) {
              this._emit("error", error);
            }
          }
          if (body.ops.length < PAGE || !sub.active) break;
        }
      } while (sub.again && sub.active);
    })();
    try {
      await sub.busy;
    } catch (error) {
      if (!(error instanceof Aborted)) this._emit("error", error);
    } finally {
      sub.busy = null;
    }
  }

  // ---------------------------------------------------------------------------- small parts

  _docPath(subDoc) {
    return `/v1/workspaces/${seg(this.workspaceId)}/sub-docs/${seg(subDoc)}`;
  }

  _seen(subDoc, clock) {
    if (Number.isSafeInteger(clock) && !(clock <= this._clocks.get(subDoc))) this._clocks.set(subDoc, clock);
  }

  _emit(name, detail) {
    this.dispatchEvent(new CustomEvent(name, { detail }));
  }

  _emitPending() {
    this.outbox.list(this.namespace).then(
      (entries) => this._emit("pending", { count: entries.length }),
      () => {},
    );
  }
}

function describe(error) {
  return error instanceof Error ? `${error.name}: ${error.message}` : String(error);
}

function checkId(name, value) {
  if (typeof value !== "string" || !value) throw new TypeError(`${name} must be a non-empty string`);
  if (value.length > 200) throw new TypeError(`${name} is ${value.length} characters, over the limit of 200`);
  // eslint-disable-next-line no-control-regex
  if (/[\u0000-\u001f\u007f-\u009f]/.test(value)) throw new TypeError(`${name} contains control characters`);
}
