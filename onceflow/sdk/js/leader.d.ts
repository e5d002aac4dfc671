export const LEADER_PREFIX: string;
/** The Web Lock name of a worker class's leader (a given name: non-empty, not starting with "-"). */
export function leaderName(workerClass: string, options?: { baseUrl?: string; leaderName?: string | null }): string;
/** navigator.locks, or null where the Web Locks API is missing. */
export function webLocks(env?: unknown): LockManager | null;
/** Run `body` while holding the exclusive Web Lock `name` (at once, with no election, without Web Locks). */
export function whileLeader<T>(
  name: string,
  body: () => Promise<T>,
  options?: { signal?: AbortSignal; locks?: LockManager | null; onLeader?: (leading: boolean) => void },
): Promise<T>;
