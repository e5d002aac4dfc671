// onceflow SDK — where a WorkspaceClient keeps the ops it has minted and not yet had answered.
// An entry is `{ns, seq, opId, subDoc, op, baseClock, mintedAt}`; `seq` orders a namespace's
// entries (the send order). An entry leaves only when the client has the server's answer.

/**
 * Outbox in memory: for Node, tests, and browsers without IndexedDB. Lost with the page,
 * so nothing is replayed after a reload; `shared` is false (no other tab sees it).
 */
export class MemoryOutbox {
  constructor() {
    this.shared = false;
    this._entries = new Map(); // ns -> Map(seq -> entry)
  }

  async open() {}

  /** Store `entry` after every other of its namespace; returns it with its `seq`. */
  async add(ns, entry) {
    const map = this._ns(ns);
    const seq = map.size ? Math.max(...map.keys()) + 1 : 1;
    const stored = structuredClone({ ...entry, ns, seq });
    map.set(seq, stored);
    return structuredClone(stored);
  }

  /** The namespace's entries in `seq` order (at most `limit`). */
  async list(ns, limit = Infinity) {
    const sorted = [...this._ns(ns).values()].sort((a, b) => a.seq - b.seq);
    return structuredClone(sorted.slice(0, limit));
  }

  async delete(ns, seq) {
    this._ns(ns).delete(seq);
  }

  close() {}

  _ns(ns) {
    if (!this._entries.has(ns)) this._entries.set(ns, new Map());
    return this._entries.get(ns);
  }
}

const DB_NAME = "onceflow-outbox";
const STORE = "ops";

/**
 * Outbox in IndexedDB (database `onceflow-outbox`, store `ops` keyed by `[ns, seq]`): it
 * outlives a reload, and every tab of the origin sees it (`shared` is true), which is why the
 * client drains a namespace under a Web Lock.
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
    this._db = request(this._idb.open(this._name, 1), (req) => {
      req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: ["ns", "seq"] });
    });
    return this._db;
  }

  /** Store `entry` after every other of its namespace, in one transaction (tabs may race). */
  async add(ns, entry) {
    const db = await this.open();
    const tx = db.transaction(STORE, "readwrite");
    const store = tx.objectStore(STORE);
    const range = IDBKeyRange.bound([ns, -Infinity], [ns, Infinity]);
    const last = await request(store.openCursor(range, "prev"));
    const stored = { ...entry, ns, seq: last ? last.value.seq + 1 : 1 };
    store.add(stored);
    await done(tx);
    return stored;
  }

  /** The namespace's entries in `seq` order (at most `limit`). */
  async list(ns, limit = Infinity) {
    const db = await this.open();
    const tx = db.transaction(STORE, "readonly");
    const range = IDBKeyRange.bound([ns, -Infinity], [ns, Infinity]);
    const count = Number.isFinite(limit) ? limit : undefined;
    return request(tx.objectStore(STORE).getAll(range, count));
  }

  async delete(ns, seq) {
    const db = await this.open();
    const tx = db.transaction(STORE, "readwrite");
    tx.objectStore(STORE).delete([ns, seq]);
    await done(tx);
  }

  close() {
    const opened = this._db;
    this._db = null;
    opened?.then((db) => db.close(), () => {});
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
