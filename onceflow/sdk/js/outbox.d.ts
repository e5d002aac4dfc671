import { OnceflowError } from "./transport.js";

/** The outbox could not be opened, or could not store, list or delete an entry (`cause`). */
export class OutboxError extends OnceflowError {}

/**
 * One op minted and not yet answered. `seq` orders its namespace (the send order) and is
 * never given twice in a namespace, even after the namespace empties.
 */
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
  /** Delete entry `seq`, only if its op id is `opId` when given; true if one was deleted. */
  delete(ns: string, seq: number, opId?: string): Promise<boolean>;
  close(): void;
}
/** In memory: nothing survives a reload. */
export class MemoryOutbox implements Outbox {
  readonly shared: false;
  open(): Promise<void>;
  add(ns: string, entry: NewOutboxEntry): Promise<OutboxEntry>;
  list(ns: string, limit?: number): Promise<OutboxEntry[]>;
  delete(ns: string, seq: number, opId?: string): Promise<boolean>;
  close(): void;
}
// Same members as MemoryOutbox on purpose: a declared class lists what it implements.
/**
 * IndexedDB database `onceflow-outbox`, store `ops` keyed by `[ns, seq]` (the record at
 * `[ns, "next"]` keeps the namespace's next seq). A connection that failed to open or that
 * the browser closed is opened again on the next call.
 */
export class IndexedDbOutbox implements Outbox {
  constructor(options?: { indexedDB?: IDBFactory; name?: string });
  readonly shared: true;
  open(): Promise<IDBDatabase>;
  add(ns: string, entry: NewOutboxEntry): Promise<OutboxEntry>;
  list(ns: string, limit?: number): Promise<OutboxEntry[]>;
  delete(ns: string, seq: number, opId?: string): Promise<boolean>;
  close(): void;
}
