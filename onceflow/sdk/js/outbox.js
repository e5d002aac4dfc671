// onceflow SDK — where a WorkspaceClient keeps the ops it has minted and not yet had answered.
// An entry is `{ns, seq, opId, subDoc, op, baseClock, mintedAt}`; `seq` orders a namespace's
// entries (the send order) and is never given twice in a namespace, even after the namespace
// empties, so a late delete of an answered entry cannot hit a newer op. An entry leaves only
// when the client has the server's answer.

import { OnceflowError } from "./transport.js";

/** The outbox could not be opened, or could not store, list or delete an entry (`cause`). */
export class OutboxError extends OnceflowError {}

/**
 * Outbox in memory: for Node, tests, and browsers without IndexedDB. Lost with the page,
 * so nothing is replayed after a reload; `shared` is false (no other tab sees it).
 */
export class MemoryOutbox {
  constructor() {
    this.shared = false;
    this._entries = new Map(); // ns -> Map(seq -> entry)
    this._next = new Map(); // ns -> the next seq
  }

  async open() {}

  /** Store `entry` after every other of its namespace; returns it with its `seq`. */
  async add(ns, entry) {
    const map = this._ns(ns);
    const seq = this._next.get(ns) ?? 1;
    this._next.set(ns, seq + 1);
    const stored = structuredClone({ ...entry, ns, seq });
    map.set(seq, stored);
    return structuredClone(stored);
  }

  /** The namespace's entries in `seq` order (at most `limit`). */
  async list(ns, limit = Infinity) {
    const sorted = [...this._ns(ns).values()].sort((a, b) => a.seq - b.seq);
    return structuredClone(sorted.slice(0, limit));
  }

  /** Delete the entry `seq` (only if its op id is `opId`, when given); true if one was deleted. */
  async delete(ns, seq, opId) {
    const map = this._ns(ns);
    const entry = map.get(seq);
    if (!entry || (opId !== undefined && entry.opId !== opId)) return false;
    return map.delete(seq);
  }

  close() {}

  _ns(ns) {
    if (!this._entries.has(ns)) this._entries.set(ns, new Map());
    return this._entries.get(ns);
  }
}

const DB_NAME = "onceflow-outbox";
const STORE = "ops";
const NEXT = "next"; // the key [ns, "next"] holds the namespace's next seq (strings sort after numbers)

/**
 * Outbox in IndexedDB (database `onceflow-outbox`, store `ops` keyed by `[ns, seq]`; the
 * record at `[ns, "next"]` keeps the namespace's next seq): it outlives a reload, and every
 * tab of the origin sees it (`shared` is true), which is why the client drains a namespace
 * under a Web Lock. A connection that fails to open or that the browser closes is opened
 * again on the next call.
 */
export class IndexedDbOutbox {
  constructor({ indexedDB = globalThis.indexedDB, name = DB_NAME } = {}) {
    if (!indexedDB) throw new TypeError("IndexedDB is not available: use a MemoryOutbox");
    this.shared = true;
    this._idb = indexedDB;
    this._name = name;
    this._db = null;
  }

  open() {
    if (this._db) return this._db;
    const opening = request(this._idb.open(this._name, 1), (req) => {
      req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: ["ns", "seq"] });
    });
    this._db = opening;
    const forget = () => { if (this._db === opening) this._db = null; };
    opening.then((db) => {
      db.onclose = forget; // closed by the browser (storage cleared, disk error)
      db.onversionchange = () => { db.close(); forget(); }; // let a newer version open
    }, forget); // a failed open is tried again next time
    return opening;
  }

  /** Store `entry` after every other of its namespace, in one transaction (tabs may race). */
  async add(ns, entry) {
    const tx = await this._transaction("readwrite");
    const store = tx.objectStore(STORE);
    const range = IDBKeyRange.bound([ns, -Infinity], [ns, Infinity]);
    const [last, next] = await Promise.all([request(store.openCursor(range, "prev")), request(store.get([ns, NEXT]))]);
    const seq = Math.max(next?.next ?? 1, last ? last.value.seq + 1 : 1);
    const stored = { ...entry, ns, seq };
    store.add(stored);
    store.put({ ns, seq: NEXT, next: seq + 1 });
    await done(tx);
    return stored;
  }

  /** The namespace's entries in `seq` order (at most `limit`). */
  async list(ns, limit = Infinity) {
    const tx = await this._transaction("readonly");
    const range = IDBKeyRange.bound([ns, -Infinity], [ns, Infinity]);
    const count = Number.isFinite(limit) ? limit : undefined;
    return request(tx.objectStore(STORE).getAll(range, count));
  }

  /** Delete the entry `seq` (only if its op id is `opId`, when given); true if one was deleted. */
  async delete(ns, seq, opId) {
    const tx = await this._transaction("readwrite");
    const store = tx.objectStore(STORE);
    const entry = await request(store.get([ns, seq]));
    const deleting = !!entry && (opId === undefined || entry.opId === opId);
    if (deleting) store.delete([ns, seq]);
    await done(tx);
    return deleting;
  }

  close() {
    const opened = this._db;
    this._db = null;
    opened?.then((db) => db.close(), () => {});
  }

  /** A transaction on the store; a connection found closing is replaced once. */
  async _transaction(mode) {
    for (let attempt = 0; ; attempt++) {
      const opening = this.open();
      const db = await opening;
      try {
        return db.transaction(STORE, mode);
      } catch (error) {
        if (error?.name !== "InvalidStateError" || attempt) throw error;
        if (this._db === opening) this._db = null;
      }
    }
  }
}

function request(req, setup) {
  return new Promise((resolve, reject) => {
    setup?.(req);
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

function done(tx) {
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve();
    tx.onerror = tx.onabort = () => reject(tx.error || new Error("IndexedDB transaction aborted"));
  });
}
