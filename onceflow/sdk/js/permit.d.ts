import type { Api } from "./transport.js";
import { OnceflowError } from "./transport.js";

/** The longest one ask waits on the server (its long poll, seconds). */
export const ASK_SECONDS: number;
/** The default bound of a permit's wait (ms). */
export const PERMIT_TIMEOUT_MS: number;
/** The longest pause between two asks (ms), whatever the server's hint. */
export const ASK_PAUSE_MS: number;

/** No permit was granted within `timeoutMs`: the provider stayed busy. Retryable. */
export class PermitTimeout extends OnceflowError {
  constructor(provider: string, timeoutMs: number, reason?: string);
  readonly provider: string;
  readonly timeoutMs: number;
  /** The last refusal: cooling, state_lost, concurrency, rpm, tpm, share, pending, no answer. */
  readonly reason: string;
  readonly retryable: true;
}

/** A fresh permit id (32 hex digits). */
export function newPermitId(): string;

export interface PermitGranted {
  granted: true;
  permit_id: string;
  provider: string;
  granted_at_ms: number;
  expires_in_ms: number;
}
export interface PermitBusy {
  granted: false;
  reason: string;
  retry_after_ms: number;
}

/** The permit calls of one claim (POST /v1/claims/{id}/permits, …/{permitId}/settle, /rate-limited, /release). */
export class ClaimPermits {
  /** `workspaceId`: the claimed request's workspace, sent with the token (the row's key);
   * `headers`: sent with every permit call (the claim's `traceparent`). */
  constructor(api: Api, requestId: string, token: string, options?: { signal?: AbortSignal; workspaceId?: string; headers?: Record<string, string> });
  readonly workspaceId: string | undefined;
  /** One ask, a long poll of `waitSeconds`; throws BudgetExceeded (402), LeaseLost (409). */
  ask(provider: string, options: { tokens?: number; permitId: string; cellKey?: string; waitSeconds?: number }): Promise<PermitGranted | PermitBusy>;
  send(permitId: string, action: "settle" | "rate-limited" | "release", body: Record<string, unknown>): Promise<unknown>;
}

export interface PermitUsage {
  inputTokens: number;
  outputTokens: number;
}

export type PermitOutcome = "ok" | "rate_limited" | "unused" | "failed" | "unsettled";

/** A permit the server holds for the claim. */
export class Permit {
  readonly provider: string;
  readonly permitId: string;
  /** When it was granted, on the Redis clock (ms since the epoch). */
  readonly grantedAtMs: number;
  /** Its TTL: not settled by then, its slot is freed for others. */
  readonly expiresInMs: number;
  readonly outcome: PermitOutcome | null;
  readonly settled: boolean;
  /** The call's usage: the estimate corrected, the slot freed, the ledger row written. */
  settle(usage: PermitUsage, options?: { model?: string }): Promise<void>;
  /** The provider answered 429: every client waits `retryAfter` seconds (else the provider's cooldown). */
  rateLimited(retryAfter?: number | null): Promise<void>;
  /** No call was made: the slot and the estimate's tokens come back, nothing recorded. */
  release(): Promise<void>;
  /** Left without a settle: "failed" or "unsettled" (the estimate stays counted). */
  leave(failed: boolean): Promise<void>;
}

export interface PermitOptions {
  /** The call's estimate of input plus output tokens (reserved until the settle). */
  tokens?: number;
  /** The compute-lock cell the call is made for (recorded in the ledger). */
  cellKey?: string;
  /** The bound of the wait (default 60 000 ms): then PermitTimeout. */
  timeoutMs?: number;
}

export function takePermit(
  permits: ClaimPermits,
  provider: string,
  options?: PermitOptions & { guard?: () => void; signal?: AbortSignal },
): Promise<Permit>;

export function withPermit<T>(
  permits: ClaimPermits,
  provider: string,
  options: (PermitOptions & { guard?: () => void; signal?: AbortSignal }) | undefined,
  body: (permit: Permit) => T | Promise<T>,
): Promise<T>;
