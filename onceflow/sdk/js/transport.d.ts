export interface ErrorOptions {
  status?: number;
  code?: string;
  body?: unknown;
  cause?: unknown;
}
/** Every error the SDK throws. */
export class OnceflowError extends Error {
  constructor(message: string, options?: ErrorOptions);
  readonly status: number;
  readonly code: string;
  readonly body: unknown;
}
/** No answer from the server (offline, refused, reset, timed out). Retryable. */
export class NetworkError extends OnceflowError {}
/** An error answer: `status` and the API's `code`. */
export class HttpError extends OnceflowError {
  retryAfterMs?: number;
}
/** 409 lease_lost: the claim is gone; write nothing more for it. */
export class LeaseLost extends HttpError {}
/**
 * 402 budget_exceeded: a spend budget of the workspace has no room for a provider call
 * (nothing reserved). "fail": the stage fails without retries; "wait": it is retried when
 * the next period starts.
 */
export class BudgetExceeded extends HttpError {
  readonly workspaceId: string;
  readonly period: string;
  readonly onExceeded: "fail" | "wait";
  readonly retryAt: string | null;
  readonly retryIn: number | null;
  /** Whether the stage waits for the next period (else it fails at once). */
  readonly waits: boolean;
}
/** Cancel was requested for the running stage. */
export class Cancelled extends OnceflowError {}
/** Stopped by an AbortSignal. */
export class Aborted extends OnceflowError {}
/** `waitFor`'s timeout passed first; `request`: the request as last read. */
export class WaitTimeout extends OnceflowError {
  constructor(message: string, options?: ErrorOptions & { request?: StageRequest | null });
  readonly request: StageRequest | null;
}
/** A request as the API reads it (`GET /v1/workspaces/{ws}/requests/{id}`). */
export interface StageRequest {
  request_id: string;
  workspace_id: string;
  status: "queued" | "running" | "succeeded" | "dead" | "cancelled";
  result: unknown;
  error: unknown;
  [field: string]: unknown;
}

export const RETRYABLE_STATUS: ReadonlySet<number>;
export function isRetryable(error: unknown): boolean;
export interface BackoffOptions {
  baseMs?: number;
  capMs?: number;
  random?: () => number;
  retryAfterMs?: number;
}
export function backoffDelay(attempt: number, options?: BackoffOptions): number;
export function retryAfterMs(headers: { get(name: string): string | null } | null | undefined, now?: number): number;
/** A new op id (default 21 URL-safe symbols from Web Crypto). */
export function newOpId(size?: number): string;
export function sleep(ms: number, signal?: AbortSignal): Promise<void>;
export function errorFor(status: number, body: unknown, what?: string): HttpError;
export function seg(value: string): string;

export interface Answer<T = any> {
  status: number;
  body: T | null;
  headers: Headers;
}
/**
 * A key, or a function returning a short-lived token (or a promise of one): called for the
 * first call and again when a call is answered 401, which is then sent once more.
 */
export type ApiKey = string | (() => string | Promise<string>);
export interface ApiOptions {
  apiKey: ApiKey;
  fetch?: typeof fetch;
  timeoutMs?: number;
  /** The tabs' shared wire (a TabLink): each `call` is then the browser profile's one call in flight. */
  lane?: { send<T>(task: () => Promise<T>, options?: { priority?: "high" | "normal"; signal?: AbortSignal; waitMs?: number }): Promise<T> } | null;
}
export interface CallOptions {
  signal?: AbortSignal;
  timeoutMs?: number;
  headers?: Record<string, string>;
  /** false: not on the shared wire (a long poll); default true when the Api has a lane. */
  lane?: boolean;
  /** "high" (heartbeats): before every other call waiting for the wire, and fetch's priority. */
  priority?: "high" | "low" | "auto";
  /** The longest wait for the wire; then the call is sent beside it. */
  laneWaitMs?: number;
  /** A stream: aborting `signal` after the headers closes its body (the connection) too. */
  stream?: boolean;
}
/** The `traceparent` (and `tracestate`) headers of a claim's stored trace context; `{}` for none. */
export function traceHeaders(traceContext: string | null | undefined): Record<string, string>;
export interface RetryOptions extends CallOptions {
  attempts?: number;
  backoff?: BackoffOptions;
  what?: string;
  onRetry?: (error: unknown, attempt: number) => void;
}
export class Api {
  constructor(baseUrl: string, options: ApiOptions);
  readonly baseUrl: string;
  readonly lane: ApiOptions["lane"];
  raw(method: string, path: string, options?: CallOptions & { body?: unknown; headers?: Record<string, string> }): Promise<Response>;
  call<T = any>(method: string, path: string, body?: unknown, options?: CallOptions): Promise<Answer<T>>;
  callRetrying<T = any>(method: string, path: string, body?: unknown, options?: RetryOptions): Promise<Answer<T>>;
}
export interface SseEvent {
  event: string;
  data: string;
  id: string | null;
}
export function sseEvents(chunks: AsyncIterable<Uint8Array> | ReadableStream<Uint8Array>): AsyncGenerator<SseEvent>;
