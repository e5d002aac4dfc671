// onceflow SDK — one leader per browser: the tab that holds a Web Lock is the only one that
// claims work for a worker class, so ten open tabs do not claim ten rows of the same work.

/** The prefix of every default leader name. */
export const LEADER_PREFIX = "onceflow:pull-worker:";

/**
 * The Web Lock name a worker of `workerClass` leads under. Web Locks are scoped to the
 * page's origin (and browser profile), so the name only has to tell worker classes — and
 * API servers, when a page talks to more than one — apart. A given `leaderName` is used as
 * is: a non-empty string of at most 500 characters that does not start with "-" (names
 * starting with "-" are reserved by the Web Locks API).
 */
export function leaderName(workerClass, { baseUrl = "", leaderName: given } = {}) {
  if (given !== undefined && given !== null) {
    if (typeof given !== "string" || given.length === 0 || given.length > 500 || given.startsWith("-")) {
      throw new TypeError("leaderName must be a non-empty string (at most 500 characters) not starting with '-'");
    }
    return given;
  }
  if (typeof workerClass !== "string" || workerClass.length === 0) throw new TypeError("workerClass is required");
  const server = String(baseUrl || "").replace(/\/+$/, "");
  return server ? `${LEADER_PREFIX}${workerClass}@${server}` : `${LEADER_PREFIX}${workerClass}`;
}

/** The Web Locks API of this environment, or null (Node, old browsers, insecure contexts). */
export function webLocks(env = globalThis) {
  const locks = env?.navigator?.locks;
  return locks && typeof locks.request === "function" ? locks : null;
}

/**
 * Run `body()` while holding the exclusive Web Lock `name`: waits (as long as it takes) for
 * the tab that holds it to close or stop, then holds it until `body()` settles. Rejects with
 * the abort reason when `signal` aborts before the lock was granted. Without the Web Locks
 * API there is no election: `body()` runs at once (`onLeader(false)` says so) — every such
 * tab then claims, which the queue keeps correct (one claim per row) but not economical.
 */
export async function whileLeader(name, body, { signal, locks = webLocks(), onLeader } = {}) {
  if (!locks) {
    onLeader?.(false);
    return body();
  }
  return locks.request(name, { mode: "exclusive", signal }, async () => {
    onLeader?.(true);
    return body();
  });
}
