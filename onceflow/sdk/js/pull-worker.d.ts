import type { Api, ApiKey } from "./transport.js";
import type { ClaimEvents, ClaimLocks } from "./compute.js";
import type { ClaimPermits, Permit, PermitOptions } from "./permit.js";

export * from "./compute.js";
export * from "./permit.js";
export * from "./leader.js";
export * from "./tabs.js";
import type { TabLink } from "./tabs.js";

export type Outcome = "succeeded" | "retry" | "dead" | "cancelled" | "lease_lost";
export const OUTCOMES: readonly Outcome[];

/** A third of the lease, in ms (at least 10). Throws RangeError for a non-positive lease. */
export function heartbeatIntervalMs(leaseSeconds: number): number;
/** "retry" for a request queued again, else its status ("dead", "cancelled"). */
export function failOutcome(row: { status?: string } | null | undefined): string;
/** Throw from a handler to run the request again after `delay` seconds (at most the server's longest retry delay). */
export class RetryLater extends Error {
  constructor(delay?: number, reason?: string);
  readonly delay: number;
  readonly reason: string;
}
/** Throw from a handler to fail the request at once, without retries. */
export class PermanentError extends Error {
  constructor(message?: string);
}
/** How a handler's error is reported (the outcome table every runner shares). */
export function failureOf(
  error: unknown,
  retryOn?: (error: unknown) => boolean,
): { error: { type: string; message: string; traceback?: string[]; delay?: number | null }; retryable: boolean };
export function newWorkerId(): string;

/** The request as the API returns it (ids, stage, input, attempts, …). */
export interface ClaimedRequest {
  request_id: string;
  workspace_id: string;
  job_id: string;
  branch_path: string;
  stage: string;
  input: any;
  worker_class: string;
  attempts: number;
  [field: string]: unknown;
}

export class PullClaim {
  readonly requestId: string;
  readonly leaseSeconds: number;
  readonly leaseExpiresAt: string;
  readonly attempt: number;
  readonly request: ClaimedRequest;
  /** The request's workspace, sent with every later call of the claim (the row's key). */
  readonly workspaceId: string | undefined;
  /** The W3C trace context the request was enqueued under (null when none was stored); its
   * `traceparent` goes with the claim's calls. */
  readonly traceContext: string | null;
}

export interface ApplyAnswer {
  workspace_id: string;
  sub_doc: string;
  op_id: string;
  clock: number;
  duplicate: boolean;
  result: unknown;
  error: unknown;
  committed_at: string;
  [field: string]: unknown;
}

export interface ComputeOnceOptions<T> {
  /** The stored value, or null/undefined for "not stored yet". */
  check: () => T | null | undefined | Promise<T | null | undefined>;
  /** The expensive call (the provider); must not return null/undefined. */
  compute: () => T | Promise<T>;
  /** Store the value (e.g. ctx.applyOp with a key); false means an earlier value was kept. */
  store: (value: T) => unknown;
  ttlSeconds?: number;
  onWait?: (info: { task: string; remainingMs: number }) => void;
}

export type ComputePath = "preflight" | "waited" | "double_check" | "computed" | "lock_lost";
export interface ComputeOutcome<T> {
  value: T;
  path: ComputePath;
  rounds: number;
  servedBy?: "broadcast" | "recheck";
  duplicate?: boolean;
}

export class PullContext {
  readonly worker: PullWorker;
  readonly claim: PullClaim;
  /** Aborted at the first lease-lost or cancel (reason: LeaseLost or Cancelled), or when the worker stops. */
  readonly signal: AbortSignal;
  readonly request: ClaimedRequest;
  readonly input: any;
  readonly requestId: string;
  readonly attempt: number;
  readonly leaseLost: boolean;
  readonly cancelRequested: boolean;
  /** The claim's workspace event stream (shared by its computeOnce waiters). */
  readonly events: ClaimEvents;
  /** The claim's compute-lock calls. */
  readonly locks: ClaimLocks;
  /** The claim's provider-permit calls. */
  readonly permits: ClaimPermits;
  /** Throws LeaseLost or Cancelled if the stage must stop now. */
  check(): void;
  /** A sub-doc of the request's workspace, read under this claim (409 lease_lost once it is gone). */
  readSubDoc(subDoc: string): Promise<{ workspace_id: string; sub_doc: string; clock: number; state: Record<string, any> }>;
  applyOp(subDoc: string, op: Record<string, unknown>, options: { key?: string; opId?: string }): Promise<ApplyAnswer>;
  then(stage: string, input?: Record<string, unknown>, options?: { branchPath?: string }): void;
  computeOnce<T>(task: string, options: ComputeOnceOptions<T>): Promise<ComputeOutcome<T>>;
  /**
   * A permit of `provider` for one call, under the limits every client shares and the
   * workspace's budgets: with `body`, what it returns (a permit left unsettled is given
   * back); without, the Permit. Throws BudgetExceeded, PermitTimeout.
   */
  permit<T>(provider: string, options: PermitOptions | undefined, body: (permit: Permit) => T | Promise<T>): Promise<T>;
  permit(provider: string, options?: PermitOptions): Promise<Permit>;
}

export type Handler = (ctx: PullContext) => unknown | Promise<unknown>;

export interface PullWorkerOptions {
  baseUrl?: string;
  /** A worker key (it may claim the worker class). */
  /** A key, or a function returning a short-lived worker token (refreshed on 401). */
  apiKey: ApiKey;
  workerClass: string;
  workerId?: string;
  leaseSeconds?: number;
  /** Claim long poll, 0..60 s (default 20); with a shared wire claims are short (every `claimPollMs`). */
  waitSeconds?: number;
  /** Be the one leader per browser for this worker class (Web Locks; default true). */
  leader?: boolean;
  leaderName?: string;
  fetch?: typeof fetch;
  timeoutMs?: number;
  onLeader?: (leading: boolean) => void;
  onOutcome?: (outcome: Outcome) => void;
  /** Whether a handler's error is worth a retry (a Python stage's `retry_on`); default: every
   * error but PermanentError / InvalidRequest. */
  retryOn?: (error: unknown) => boolean;
  /**
   * Share the browser's connections with its other tabs (default true; nothing is shared
   * without Web Locks and BroadcastChannel): calls one at a time on one wire, heartbeats
   * first, claims short (no long poll) — or a given TabLink.
   */
  shareTabs?: boolean | TabLink;
  /**
   * With shareTabs: calls one at a time on the browser's one wire, claims short (default
   * true). false for an API served over HTTP/2 (one connection carries every call): only the
   * event streams are shared, and claims long-poll `waitSeconds`.
   */
  shareWire?: boolean;
  /** With a shared wire, the wait between claims that found nothing (default 1000 ms). */
  claimPollMs?: number;
}
export interface HeartbeatCounts {
  /** Heartbeat calls made. */
  sent: number;
  /** Answered 200. */
  answered: number;
  /** No answer in time, or a status other than 409: sent again, the lease not taken as lost. */
  retried: number;
  /** Answered 409 lease_lost: the only answer that ends a lease. */
  lost: number;
}

export class PullWorker {
  constructor(options: PullWorkerOptions);
  readonly api: Api;
  readonly workerClass: string;
  readonly workerId: string;
  readonly leaseSeconds: number | undefined;
  readonly waitSeconds: number;
  /** The Web Lock name, or null with `leader: false`. */
  readonly leaderName: string | null;
  readonly isLeader: boolean;
  /** The tabs' shared link, or null (each call on its own connection, claims long polls). */
  readonly link: TabLink | null;
  readonly claimPollMs: number;
  readonly heartbeats: HeartbeatCounts;
  /**
   * Claim and run until stop() or `signal`; resolves with how many requests ran. Stopping
   * aborts a running stage's ctx.signal and hands its request back (fail, retryable, retry_in 0).
   */
  run(handler: Handler, options?: { signal?: AbortSignal }): Promise<number>;
  /** One claim (long poll `wait` s) and its run: the outcome, or null when nothing was claimed. */
  runOnce(handler: Handler, options?: { wait?: number; signal?: AbortSignal }): Promise<Outcome | null>;
  claim(wait?: number, signal?: AbortSignal): Promise<PullClaim | null>;
  stop(): void;
}
