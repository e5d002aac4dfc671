/** The Web Lock and BroadcastChannel names of a server (`onceflow:wire@…`, `onceflow:feed@…#<workspace>`). */
export function linkNames(server: string): {
  wire: string;
  gate: string;
  channel: string;
  feed: (workspaceId: string) => string;
};
/** The server a `baseUrl` names, absolute ("" = this page's origin). */
export function serverOf(baseUrl: string, env?: unknown): string;
/** The page's link to `baseUrl`'s server (one per page), or null without Web Locks / BroadcastChannel. */
export function tabLink(baseUrl: string, env?: unknown): TabLink | null;
export function anySignal(signals: AbortSignal[]): AbortSignal;

export interface TabLinkStats {
  /** Calls sent on the shared wire from this page. */
  sent: number;
  /** Heartbeats sent beside the wire because it stayed busy past their wait. */
  bypassed: number;
  /** Times this page held a workspace's event stream for the browser. */
  held: number;
}
/**
 * The tabs of one browser profile share the API's connections: one call at a time on the
 * wire (heartbeats first), one event stream per followed workspace held by an elected tab
 * (Web Locks) and fanned out over a BroadcastChannel, handed over when its tab closes.
 */
export class TabLink {
  constructor(server: string, options: { locks: LockManager; Channel: typeof BroadcastChannel });
  readonly server: string;
  readonly stats: TabLinkStats;
  send<T>(task: () => Promise<T>, options?: { priority?: "high" | "normal"; signal?: AbortSignal; waitMs?: number }): Promise<T>;
  follow(
    workspaceId: string,
    handlers: {
      open: (signal: AbortSignal, emit: (what: "ready" | "event" | "down", name?: string, data?: string) => void) => Promise<void>;
      onEvent?: (name: string, data: string) => void;
      onReady?: () => void;
      onDown?: () => void;
    },
  ): { close(): void };
  watch(
    workspaceId: string,
    handlers?: { onEvent?: (name: string, data: string) => void; onReady?: () => void; onDown?: () => void; signal?: AbortSignal; timeoutMs?: number },
  ): Promise<{ close(): void } | null>;
  close(): void;
}
