// onceflow SDK — the tabs of one browser share the API's connections. A browser keeps at most
// 6 HTTP/1.1 connections per host and profile, and each tab's own event stream and long polls
// would hold one each: with a few tabs open, a claim or a heartbeat waits for a socket until
// its lease lapses. So, between the tabs of one origin (one browser profile):
//
// * the WIRE: every short call (claims, heartbeats, lock calls, ops, reads) is sent while
//   holding the Web Lock `onceflow:wire@<server>`, one call at a time for the whole profile:
//   they reuse one keep-alive connection. Calls queue first on `onceflow:gate@<server>`, then
//   on the wire; heartbeats skip the gate, so a heartbeat waits for at most the one call in
//   flight (and the heartbeats before it), never for the queue of other calls;
// * the FEEDS: a workspace's event stream is held by one tab, the holder of the Web Lock
//   `onceflow:feed@<server>#<workspace>` (every tab following the workspace asks for it; the
//   next in line takes over when the holder closes or crashes), which fans each event out over
//   the BroadcastChannel `onceflow:link@<server>`. Each connection of the holder is an
//   "epoch": a new one (a reconnect, a new holder) makes every follower catch up from the op
//   log by clock, so no commit is lost at a hand-over. A waiting computeOnce listens to the
//   feed of its claim's workspace when a tab of the browser follows it, instead of opening a
//   stream of its own.
//
// The API's event routes carry one workspace per stream: a browser holds one stream per
// workspace its tabs follow (one in the common case), plus the wire. Without the Web Locks
// API or BroadcastChannel (Node, old browsers) nothing is shared: each client calls alone.

/** The Web Lock and channel names of `server` (an origin plus path prefix, no trailing "/"). */
export function linkNames(server) {
  return {
    wire: `onceflow:wire@${server}`,
    gate: `onceflow:gate@${server}`,
    channel: `onceflow:link@${server}`,
    feed: (workspaceId) => `onceflow:feed@${server}#${workspaceId}`,
  };
}

/** The server a `baseUrl` names, absolute ("" = this page's origin). */
export function serverOf(baseUrl, env = globalThis) {
  const base = String(baseUrl || "").replace(/\/+$/, "");
  const here = env?.location?.href;
  if (!here) return base;
  try {
    return new URL(base || "/", here).href.replace(/\/+$/, "");
  } catch {
    return base;
  }
}

const links = new Map(); // server -> TabLink, one per page

/**
 * The page's link to `baseUrl`'s server, shared by every client of the page, or null where
 * tabs cannot share (no Web Locks API or no BroadcastChannel: Node, old browsers).
 */
export function tabLink(baseUrl, env = globalThis) {
  const locks = env?.navigator?.locks;
  const Channel = env?.BroadcastChannel;
  if (!locks || typeof locks.request !== "function" || typeof Channel !== "function") return null;
  const server = serverOf(baseUrl, env);
  let link = links.get(server);
  if (!link) links.set(server, (link = new TabLink(server, { locks, Channel })));
  return link;
}

/** The link of one page (tab) to one server: see the module's comment. */
export class TabLink {
  constructor(server, { locks, Channel }) {
    this.server = server;
    this.names = linkNames(server);
    this.locks = locks;
    this._feeds = new Map(); // workspace -> Feed
    this.channel = new Channel(this.names.channel);
    this.channel.onmessage = (message) => this._dispatch(message.data);
    /** Counters: calls sent on the wire, heartbeats sent past a wire that stayed busy, streams held. */
    this.stats = { sent: 0, bypassed: 0, held: 0 };
  }

  /**
   * Run `task` (one short call: send it and read its answer) as the one call of this browser
   * profile on the wire. `priority: "high"` (heartbeats) skips the queue of other calls.
   * `signal` stops the wait (the task is not run). With `waitMs`, a call that has not got the
   * wire after that long is sent at once beside it (a heartbeat must not wait on a call that
   * hangs: a second connection, for a moment, is better than a lapsed lease).
   */
  async send(task, { priority = "normal", signal, waitMs = Infinity } = {}) {
    const gave = new AbortController();
    const stop = signal ? anySignal([signal, gave.signal]) : gave.signal;
    const timer = Number.isFinite(waitMs) ? setTimeout(() => gave.abort(), Math.max(0, waitMs)) : null;
    let granted = false;
    const onWire = () => this.locks.request(this.names.wire, { signal: stop }, () => {
      granted = true;
      clearTimeout(timer);
      this.stats.sent += 1;
      return task();
    });
    try {
      return await (priority === "high" ? onWire() : this.locks.request(this.names.gate, { signal: stop }, onWire));
    } catch (error) {
      if (granted || !gave.signal.aborted || signal?.aborted) throw error;
      this.stats.bypassed += 1;
      return task();
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * Follow workspace `workspaceId`'s events as a tab able to open its stream (it holds a key
   * for the workspace): this page asks for the feed's Web Lock, and while it holds it,
   * `open(signal, emit)` holds the stream until `signal` aborts, calling `emit("ready")` at
   * each connection's `ready`, `emit("event", name, data)` per event and `emit("down")` when
   * the connection is lost. Every follower of the browser (this page's included) gets
   * `onReady()` at each new connection (catch up then), `onEvent(name, data)`, `onDown()`.
   * Returns `{close()}`.
   */
  follow(workspaceId, { open, onEvent, onReady, onDown }) {
    const feed = this._feed(workspaceId);
    const listener = { onEvent, onReady, onDown };
    const opener = { open };
    feed.listeners.add(listener);
    feed.openers.add(opener);
    if (!feed.asking) this._ask(feed);
    if (!feed.live) this.channel.postMessage({ t: "ask", ws: workspaceId });
    return {
      close: () => {
        feed.listeners.delete(listener);
        feed.openers.delete(opener);
        if (feed.holding?.opener === opener || feed.openers.size === 0) feed.stop?.abort();
      },
    };
  }

  /**
   * Listen to workspace `workspaceId`'s feed if a tab of this browser holds it: resolves with
   * `{close()}` once the feed is live (its listener gets `onEvent`, and `onReady` at each
   * LATER connection: events may have been missed then), or null if no tab follows the
   * workspace, or none said it is live within `timeoutMs`.
   */
  async watch(workspaceId, { onEvent, onReady, onDown, signal, timeoutMs = 2_000 } = {}) {
    const feed = this._feed(workspaceId);
    if (!feed.holding) {
      let state;
      try {
        state = await this.locks.query();
      } catch {
        return null;
      }
      if (!(state?.held || []).some((lock) => lock.name === feed.lockName)) return null;
    }
    if (!feed.live) {
      this.channel.postMessage({ t: "ask", ws: workspaceId });
      const live = await new Promise((resolve) => {
        const done = (value) => {
          clearTimeout(timer);
          feed.waiters.delete(wake);
          signal?.removeEventListener("abort", onAbort);
          resolve(value);
        };
        const wake = () => done(true);
        const onAbort = () => done(false);
        const timer = setTimeout(() => done(false), timeoutMs);
        feed.waiters.add(wake);
        if (signal?.aborted) done(false);
        else signal?.addEventListener("abort", onAbort, { once: true });
      });
      if (!live || !feed.live) return null;
    }
    const listener = { onEvent, onReady, onDown };
    feed.listeners.add(listener);
    return { close: () => feed.listeners.delete(listener) };
  }

  /** Stop everything of this page's link (a test's teardown; pages just close). */
  close() {
    for (const feed of this._feeds.values()) {
      feed.openers.clear();
      feed.listeners.clear();
      feed.stop?.abort();
    }
    this.channel.close();
    for (const [server, link] of links) if (link === this) links.delete(server);
  }

  // ------------------------------------------------------------------ the feeds

  _feed(workspaceId) {
    let feed = this._feeds.get(workspaceId);
    if (!feed) {
      feed = {
        ws: workspaceId, lockName: this.names.feed(workspaceId), live: false, epoch: null,
        listeners: new Set(), openers: new Set(), waiters: new Set(),
        asking: false, holding: null, stop: null,
      };
      this._feeds.set(workspaceId, feed);
    }
    return feed;
  }

  /** Ask for the feed's Web Lock; while held, hold the stream with this page's first opener. */
  _ask(feed) {
    feed.asking = true;
    const stop = (feed.stop = new AbortController());
    this.locks
      .request(feed.lockName, { signal: stop.signal }, async () => {
        const [opener] = feed.openers;
        if (!opener || stop.signal.aborted) return;
        feed.holding = { opener, epoch: null };
        this.stats.held += 1;
        const emit = (what, name, data) => this._emit(feed, what, name, data);
        try {
          await opener.open(stop.signal, emit);
          if (!stop.signal.aborted) feed.openers.delete(opener); // it gave up (e.g. a 403)
        } catch {
          feed.openers.delete(opener); // it failed: the next follower takes over
        } finally {
          if (feed.holding?.epoch) this._send({ t: "down", ws: feed.ws, epoch: feed.holding.epoch });
          feed.holding = null;
        }
      })
      .catch(() => {}) // aborted while waiting: this page no longer follows
      .finally(() => {
        feed.asking = false;
        if (feed.stop === stop) feed.stop = null;
        if (feed.openers.size) this._ask(feed); // its opener left, others of this page remain
      });
  }

  /** The holder's news, to this page's followers and the other tabs'. */
  _emit(feed, what, name, data) {
    if (!feed.holding) return;
    if (what === "ready") {
      feed.holding.epoch = newEpoch();
      this._send({ t: "ready", ws: feed.ws, epoch: feed.holding.epoch });
    } else if (what === "event") {
      this._send({ t: "event", ws: feed.ws, event: name, data });
    } else if (what === "down" && feed.holding.epoch) {
      const epoch = feed.holding.epoch;
      feed.holding.epoch = null;
      this._send({ t: "down", ws: feed.ws, epoch });
    }
  }

  _send(message) {
    this._dispatch(message);
    this.channel.postMessage(message);
  }

  _dispatch(message) {
    if (!message || typeof message !== "object" || typeof message.ws !== "string") return;
    const feed = this._feeds.get(message.ws);
    if (!feed) return;
    if (message.t === "ask") {
      if (feed.holding?.epoch) this.channel.postMessage({ t: "ready", ws: feed.ws, epoch: feed.holding.epoch });
    } else if (message.t === "ready") {
      if (message.epoch === feed.epoch && feed.live) return;
      feed.epoch = message.epoch;
      feed.live = true;
      for (const wake of [...feed.waiters]) wake();
      for (const listener of [...feed.listeners]) call(listener.onReady);
    } else if (message.t === "event") {
      for (const listener of [...feed.listeners]) call(listener.onEvent, message.event, message.data);
    } else if (message.t === "down") {
      if (message.epoch !== feed.epoch) return;
      feed.live = false;
      for (const listener of [...feed.listeners]) call(listener.onDown);
    }
  }
}

function call(fn, ...args) {
  if (typeof fn !== "function") return;
  try {
    fn(...args);
  } catch {
    // a listener's error is its own: the others still hear the news
  }
}

function newEpoch() {
  const bytes = globalThis.crypto.getRandomValues(new Uint8Array(8));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** AbortSignal.any, or its equivalent where it is missing. */
export function anySignal(signals) {
  if (typeof AbortSignal.any === "function") return AbortSignal.any(signals);
  const both = new AbortController();
  for (const s of signals) {
    if (s.aborted) both.abort(s.reason);
    else s.addEventListener("abort", () => both.abort(s.reason), { once: true });
  }
  return both.signal;
}
