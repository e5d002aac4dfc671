import type { TabLink } from "./tabs.js";
import type { Api } from "./transport.js";

export const WAIT_MARGIN_MS: number;
export function extendIntervalMs(ttlMs: number): number;
export function isReleaseOf(message: unknown, jobId: string, task: string): boolean;
/** What a waiter gets when the shared feed it listens to connected again: try the lock at once. */
export const RESYNC: Readonly<{ kind: "resync" }>;

export class Subscription {
  /**
   * null while live; once the stream is gone: "ended" (it closed: subscribe again),
   * "claim_ended" (the server sent `event: end`: the claim is over, the stream is not
   * opened again), "unavailable" or "closed".
   */
  readonly ended: null | "ended" | "claim_ended" | "unavailable" | "closed";
  next(timeoutMs: number, signal?: AbortSignal): Promise<Record<string, unknown> | null>;
  close(): void;
}

/**
 * The claimed request's workspace events (POST /v1/claims/{id}/events), shared by its
 * waiters. Ends for good at the server's `event: end` (the claim is over).
 */
export class ClaimEvents {
  /** `workspaceId`: the claimed request's workspace, sent with the token (the row's key). */
  /**
   * With `link` (the tabs' TabLink) and a tab of the browser following the claim's workspace,
   * the waiters hear that tab's feed (news of `jobId` only) and no stream is opened.
   */
  constructor(api: Api, requestId: string, token: string, options?: { signal?: AbortSignal; workspaceId?: string; link?: TabLink | null; jobId?: string });
  readonly workspaceId: string | undefined;
  /** Claim streams opened so far. */
  readonly opened: number;
  /** Times the waiters listened to a tab's shared feed instead of a stream of their own. */
  readonly shared: number;
  subscribe(): Promise<Subscription>;
  close(): void;
}

export interface AcquireAnswer {
  acquired: boolean;
  locked: boolean;
  job_id: string;
  task: string;
  lock_token?: string | null;
  ttl_ms?: number | null;
  remaining_ms?: number | null;
}

/** The lock calls of one claim (POST /v1/claims/{id}/locks, /extend, /release). */
export class ClaimLocks {
  /** `workspaceId`: the claimed request's workspace, sent with the token (the row's key);
   * `headers`: sent with every lock call (the claim's `traceparent`). */
  constructor(api: Api, requestId: string, token: string, options?: { signal?: AbortSignal; workspaceId?: string; headers?: Record<string, string> });
  readonly workspaceId: string | undefined;
  acquire(task: string, ttlSeconds?: number): Promise<AcquireAnswer>;
  extend(task: string, lockToken: string, ttlSeconds?: number): Promise<boolean>;
  release(task: string, lockToken: string, outcome: "computed" | "double_check" | "failed" | "abandoned"): Promise<boolean>;
}

export interface ComputeOnceArgs<T> {
  locks: ClaimLocks;
  events: ClaimEvents;
  jobId: string;
  check: () => T | null | undefined | Promise<T | null | undefined>;
  compute: () => T | Promise<T>;
  store: (value: T) => unknown;
  ttlSeconds?: number;
  guard?: () => void;
  signal?: AbortSignal;
  onWait?: (info: { task: string; remainingMs: number }) => void;
  waitMarginMs?: number;
}

export function computeOnce<T>(
  task: string,
  args: ComputeOnceArgs<T>,
): Promise<{
  value: T;
  path: "preflight" | "waited" | "double_check" | "computed" | "lock_lost";
  rounds: number;
  servedBy?: "broadcast" | "recheck";
  duplicate?: boolean;
}>;
