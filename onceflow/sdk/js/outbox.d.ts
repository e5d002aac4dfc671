/** One op minted and not yet answered. `seq` orders its namespace (the send order). */
export interface OutboxEntry {
  ns: string;
  seq: number;
  opId: string;
  subDoc: string;
  op: { type: string; [field: string]: unknown };
  baseClock: number | null;
  mintedAt: number;
}
export type NewOutboxEntry = Omit<OutboxEntry, "ns" | "seq">;
export interface Outbox {
  /** True when other tabs of the origin see it (the client then drains it under a Web Lock). */
  readonly shared: boolean;
  open(): Promise<unknown> | void;
  add(ns: string, entry: NewOutboxEntry): Promise<OutboxEntry>;
  list(ns: string, limit?: number): Promise<OutboxEntry[]>;
  delete(ns: string, seq: number): Promise<void>;
  close(): void;
}
/** In memory: nothing survives a reload. */
export class MemoryOutbox implements Outbox {
  readonly shared: false;
  open(): Promise<void>;
  add(ns: string, entry: NewOutboxEntry): Promise<OutboxEntry>;
  list(ns: string, limit?: number): Promise<OutboxEntry[]>;
  delete(ns: string, seq: number): Promise<void>;
  close(): void;
}
/** IndexedDB database `onceflow-outbox`, store `ops` keyed by `[ns, seq]`. */
export class IndexedDbOutbox implements Outbox {
  constructor(options?: { indexedDB?: IDBFactory; name?: string });
  readonly shared: true;
  open(): Promise<IDBDatabase>;
  add(ns: string, entry: NewOutboxEntry): Promise<OutboxEntry>;
  list(ns: string, limit?: number): Promise<OutboxEntry[]>;
  delete(ns: string, seq: number): Promise<void>;
  close(): void;
}
