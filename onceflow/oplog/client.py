"""The retry-safe client SDK: mint the op id once, keep it through retries, restarts, replays.

``WorkspaceClient.apply`` mints a nanoid op id *before* the first send and
stores the pending op in a durable outbox (a SQLite file), so a crash or a
"tab reload" loses nothing; transport errors are retried with exponential
backoff and jitter under the *same* op id, so the server applies the op once
and every retry gets the original commit clock. An op leaves the outbox only
when the server answered for it. Pending ops are replayed in order before any
new op is sent.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from onceflow.errors import OnceflowError
from onceflow.models.ops import OpModel, parse_op
from onceflow.oplog.store import ApplyResult, OpLog, new_op_id


class TransportError(OnceflowError):
    """The op may or may not have reached the server: retry it with the same op id."""


class Transport(Protocol):
    """How ops reach the server: in-process now, HTTP with the FastAPI integration."""

    def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        op: dict[str, Any],
        op_id: str,
        base_clock: int | None,
    ) -> ApplyResult:
        """Send one op; raise :class:`TransportError` when the outcome is unknown."""
        ...


class InProcessTransport:
    """Calls :meth:`OpLog.apply_op` directly (server-side code, tests)."""

    def __init__(self, oplog: OpLog) -> None:
        self.oplog = oplog

    def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        op: dict[str, Any],
        op_id: str,
        base_clock: int | None,
    ) -> ApplyResult:
        """Apply the op through the op log."""
        return self.oplog.apply_op(workspace_id, sub_doc, op, op_id, base_clock=base_clock)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op_id TEXT NOT NULL UNIQUE,
    workspace_id TEXT NOT NULL,
    sub_doc TEXT NOT NULL,
    op TEXT NOT NULL,
    base_clock INTEGER
)
"""


class WorkspaceClient:
    """A client of one workspace's sub-docs with a durable outbox of pending ops."""

    def __init__(
        self,
        transport: Transport,
        workspace_id: str,
        *,
        outbox: str | Path = ":memory:",
        max_attempts: int = 8,
        backoff_base: float = 0.05,
        backoff_max: float = 5.0,
    ) -> None:
        self.transport = transport
        self.workspace_id = workspace_id
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.retries = 0  # transport errors retried, over this client's life
        # check_same_thread=False + our own lock: one client may be shared by threads.
        self._db = sqlite3.connect(str(outbox), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an acknowledged add survives power loss
        self._db.execute(_SCHEMA)
        self._lock = threading.RLock()

    def apply(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        base_clock: int | None = None,
        send: bool = True,
    ) -> ApplyResult | None:
        """Mint an op id, persist the op, then send it (after any pending ones).

        ``send=False`` only queues it (offline); :meth:`replay` sends it later.
        Raises :class:`TransportError` when retries are exhausted: the op stays
        in the outbox and a later :meth:`replay` sends it with the same op id.
        """
        parsed = parse_op(op)  # refuse a malformed op before it reaches the outbox
        op_id = new_op_id()
        with self._lock:
            self._db.execute(
                "INSERT INTO outbox (op_id, workspace_id, sub_doc, op, base_clock)"
                " VALUES (?, ?, ?, ?, ?)",
                (
                    op_id,
                    self.workspace_id,
                    sub_doc,
                    json.dumps(parsed.model_dump(mode="json")),
                    base_clock,
                ),
            )
            if not send:
                return None
            results = self.replay()
        return next(r for r in results if r.op_id == op_id)

    def pending(self) -> list[dict[str, Any]]:
        """The ops not yet acknowledged, in the order they were made."""
        with self._lock:
            rows = self._db.execute(
                "SELECT op_id, sub_doc, op, base_clock FROM outbox WHERE workspace_id = ?"
                " ORDER BY seq",
                (self.workspace_id,),
            ).fetchall()
        return [
            {"op_id": r[0], "sub_doc": r[1], "op": json.loads(r[2]), "base_clock": r[3]}
            for r in rows
        ]

    def replay(self) -> list[ApplyResult]:
        """Send every pending op in order, each until the server answers; returns the answers.

        A final answer from the server (applied, duplicate, rejected, or an error
        such as :class:`~onceflow.errors.OpIdConflict`) removes the op from the
        outbox; errors are raised after that. Transport errors keep it there.
        """
        results: list[ApplyResult] = []
        with self._lock:
            for item in self.pending():
                try:
                    result = self._send(item)
                except TransportError:
                    raise
                except OnceflowError:
                    self._ack(item["op_id"])
                    raise
                self._ack(item["op_id"])
                results.append(result)
        return results

    def _send(self, item: dict[str, Any]) -> ApplyResult:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self.transport.apply(
                    self.workspace_id,
                    item["sub_doc"],
                    item["op"],
                    item["op_id"],
                    item["base_clock"],
                )
            except TransportError:
                if attempt == self.max_attempts:
                    raise
                self.retries += 1
                delay = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1))
                time.sleep(delay / 2 + random.uniform(0, delay / 2))
        raise AssertionError("unreachable")  # pragma: no cover

    def _ack(self, op_id: str) -> None:
        self._db.execute("DELETE FROM outbox WHERE op_id = ?", (op_id,))

    def close(self) -> None:
        """Close the outbox file (pending ops stay in it)."""
        self._db.close()
