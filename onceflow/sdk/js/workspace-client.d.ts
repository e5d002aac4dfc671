import type { TabLink } from "./tabs.js";
import type { ApiKey, BackoffOptions, HttpError, StageRequest } from "./transport.js";
import type { Outbox, OutboxEntry } from "./outbox.js";
export { IndexedDbOutbox, MemoryOutbox, OutboxError } from "./outbox.js";
export type { Outbox, OutboxEntry, NewOutboxEntry } from "./outbox.js";

export interface Op {
  type: string;
  [field: string]: unknown;
}
/** The server's answer to an op (a replay has the original clock and `duplicate: true`). */
export interface OpAnswer {
  opId: string;
  seq: number;
  subDoc: string;
  /** The commit clock; null when the op was recorded as rejected by the state (`applied: false`). */
  clock: number | null;
  duplicate: boolean;
  applied: boolean;
  result: unknown;
  error: unknown;
}
export interface OpRefusal {
  opId: string;
  seq: number;
  subDoc: string;
  error: HttpError;
}
/** One applied op, read from the op log. */
export interface Commit {
  opId: string;
  clock: number;
  subDoc: string;
  opType: string;
  payload: Op;
  result: unknown;
  fence: string | null;
  committedAt: string;
}
/** The `commit` event's data as broadcast by the server. */
export interface CommitNotice {
  kind: "commit";
  workspace_id: string;
  sub_doc: string;
  clock: number;
  op_id: string;
  type: string;
}
export interface WorkspaceClientEvents {
  applied: OpAnswer;
  refused: OpRefusal;
  pending: { count: number };
  unauthorized: { opId: string; error: HttpError };
  commit: CommitNotice;
  stream: { connected: boolean };
  /**
   * A subscriber's callback threw (its error), or the outbox could not be listed or deleted
   * from (an OutboxError, `cause`: the storage's error): the client retries with backoff and
   * keeps draining; an op the server answered settles even while its deletion is retried.
   */
  error: unknown;
  /**
   * The default IndexedDB outbox could not be opened (storage disabled or refused): this client
   * keeps its ops in memory; they are retried while the page lives but not replayed after a reload.
   */
  warning: { message: string; error: unknown };
}
export interface WorkspaceClientOptions {
  /** The API's origin; "" (default) = this page's. */
  baseUrl?: string;
  apiKey: ApiKey;
  workspaceId: string;
  /**
   * Default: an IndexedDbOutbox where IndexedDB exists (a MemoryOutbox, with a `warning` event,
   * if it cannot be opened), else a MemoryOutbox. A given outbox that cannot be opened makes
   * `start()` reject with OutboxError (the next call tries again).
   */
  outbox?: Outbox;
  /** With the workspace, names the outbox namespace `<clientName>@<workspaceId>`. */
  clientName?: string;
  fetch?: typeof fetch;
  backoff?: BackoffOptions;
  /**
   * Share the browser's connections with its other tabs (default true; nothing is shared
   * without Web Locks and BroadcastChannel): calls one at a time on one wire, and one event
   * stream per workspace for the browser, held by one tab — or a given TabLink.
   */
  shareTabs?: boolean | TabLink;
  /** With shareTabs: calls one at a time on the browser's one wire (default true; false over HTTP/2). */
  shareWire?: boolean;
}
export class WorkspaceClient extends EventTarget {
  constructor(options: WorkspaceClientOptions);
  readonly workspaceId: string;
  /** The tabs' shared link, or null. */
  readonly link: TabLink | null;
  /** `<clientName>@<workspaceId>`; also the Web Lock / BroadcastChannel name after `onceflow-outbox:`. */
  readonly namespace: string;
  /** Replaced by a MemoryOutbox when the default IndexedDB outbox cannot be opened. */
  readonly outbox: Outbox;
  on<K extends keyof WorkspaceClientEvents>(name: K, callback: (detail: WorkspaceClientEvents[K]) => void): () => void;
  start(): Promise<void>;
  /**
   * Rejects with HttpError on a refusal, Aborted on `close()`, TypeError on bad input, and
   * OutboxError when the op could not be stored (nothing was sent).
   */
  applyOp(subDoc: string, op: Op, options?: { baseClock?: number | null }): Promise<OpAnswer>;
  pending(): Promise<OutboxEntry[]>;
  read(subDoc: string): Promise<{ state: Record<string, unknown>; clock: number }>;
  /**
   * The request once it has ended (succeeded, dead or cancelled): long polls of its read
   * (`?wait=`, answered as soon as it ends) until then or `timeout` seconds (default 60, at most
   * 3600). Rejects with WaitTimeout, HttpError (404: no such request), Aborted, TypeError.
   */
  waitFor(requestId: string, options?: { timeout?: number; signal?: AbortSignal }): Promise<StageRequest>;
  clockOf(subDoc: string): number | undefined;
  setApiKey(apiKey: ApiKey): void;
  retryNow(): void;
  subscribe(subDoc: string, onCommit: (commit: Commit) => void, options?: { since?: number }): () => void;
  close(): void;
}
