# Over ~400 lines on purpose: WorkspaceClient and its durable outbox are one state
# machine (mint once, retry, replay in order); split, the ordering rules would scatter.
"""The retry-safe client SDK: mint the op id once, keep it through retries, restarts, replays.

``WorkspaceClient.apply`` mints a nanoid op id *before* the first send and
stores the pending op in a durable outbox (a SQLite file), so a crash or a
"tab reload" loses nothing; transport errors are retried with exponential
backoff and jitter under the *same* op id, so the server applies the op once
and every retry gets the original commit clock. An op leaves the outbox only
when the server answered for it. Pending ops are replayed in order before any
new op is sent.

Retention: the client records, per sub-doc, the last commit clock it saw (every
answer, and :meth:`WorkspaceClient.observe` for reads) and sends it with each
op as ``base_clock``. The server refuses an op it no longer knows whose
``base_clock`` is below the op log's horizon (:class:`ReplayTooOld`): it may be
a pruned op coming back. Such an op is *parked* in the same file, never
dropped; the application lists it (:meth:`~WorkspaceClient.parked`), and
discards or resubmits it. An op this client minted and never sent with an
unknown outcome cannot be a replay: refused on its first sends, it is re-based
on the horizon the server reported and sent again, not parked.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from onceflow.errors import DatabaseUnavailable, InvalidRequest, OnceflowError, ReplayTooOld
from onceflow.models.ops import OpModel, parse_op
from onceflow.oplog.store import ApplyResult, OpLog, new_op_id
from onceflow.settings import get_settings

log = logging.getLogger("onceflow.oplog.client")

# Times an op known never to have been applied is re-based on a reported horizon and resent.
_REBASES = 3


class TransportError(OnceflowError):
    """The op may or may not have reached the server: retry it with the same op id."""


class OpsParked(ReplayTooOld):
    """A :meth:`WorkspaceClient.replay` pass parked ops the server refused as too old.

    Raised after the pass: every other pending op was sent. ``parked`` holds the
    ops parked by this pass (as :meth:`WorkspaceClient.parked` lists them),
    ``results`` the answers of the ops that were sent. ``op_id``, ``base_clock``
    and ``horizon`` are the first parked op's.
    """

    def __init__(self, parked: list[dict[str, Any]], results: list[ApplyResult]) -> None:
        first = parked[0]
        super().__init__(first["op_id"], first["base_clock"], int(first["error"]["horizon"]))
        self.parked = parked
        self.results = results
        ids = ", ".join(p["op_id"] for p in parked)
        self.args = (
            f"{len(parked)} op(s) refused as older than the op log's horizon, parked: {ids}; "
            "they may have been applied already: re-read the sub-doc, then "
            "WorkspaceClient.resubmit(op_id) or discard(op_id)",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.parked, self.results))


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
        """Apply the op through the op log.

        A database that did not answer (:class:`DatabaseUnavailable`, a lost
        connection) is this transport's network failure: the op may or may not have
        committed, so it is a :class:`TransportError` — retried with the same op id,
        kept in the outbox — never a final answer.
        """
        try:
            return self.oplog.apply_op(workspace_id, sub_doc, op, op_id, base_clock=base_clock)
        except DatabaseUnavailable as exc:
            raise TransportError(f"database unavailable: {exc}") from exc


_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op_id TEXT NOT NULL UNIQUE,
    workspace_id TEXT NOT NULL,
    sub_doc TEXT NOT NULL,
    op TEXT NOT NULL,
    base_clock INTEGER
)
""",
    # The last commit clock seen per sub-doc: the base_clock of the next op minted.
    """
CREATE TABLE IF NOT EXISTS seen (
    workspace_id TEXT NOT NULL,
    sub_doc TEXT NOT NULL,
    clock INTEGER NOT NULL,
    PRIMARY KEY (workspace_id, sub_doc)
)
""",
    # Ops refused as older than the horizon, kept until the application decides.
    """
CREATE TABLE IF NOT EXISTS parked (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op_id TEXT NOT NULL UNIQUE,
    workspace_id TEXT NOT NULL,
    sub_doc TEXT NOT NULL,
    op TEXT NOT NULL,
    base_clock INTEGER,
    error TEXT NOT NULL
)
""",
)


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
        for statement in _SCHEMA:
            self._db.execute(statement)
        self._lock = threading.RLock()
        # Ops minted here of which no attempt may have been applied (every attempt so far was
        # refused, or none was made). In memory only: after a restart nothing is known new.
        self._unsent: set[str] = set()

    @contextmanager
    def _txn(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ------------------------------------------------------------------ clocks

    def observe(self, sub_doc: str, clock: int) -> None:
        """Record that ``sub_doc`` was seen at commit ``clock`` (e.g. after reading it).

        Answers to this client's ops are recorded on their own; call this for
        reads (``get_sub_doc``, ``ops_since``, broadcasts), so that the next op
        carries a recent ``base_clock``. The recorded clock never goes down.
        """
        if isinstance(clock, bool) or not isinstance(clock, int) or clock < 0:
            raise InvalidRequest("clock must be a non-negative integer")
        with self._lock:
            self._observe(sub_doc, clock)

    def _observe(self, sub_doc: str, clock: int) -> None:
        self._db.execute(
            "INSERT INTO seen (workspace_id, sub_doc, clock) VALUES (?, ?, ?)"
            " ON CONFLICT (workspace_id, sub_doc) DO UPDATE SET clock = max(clock, excluded.clock)",
            (self.workspace_id, sub_doc, clock),
        )

    def seen_clock(self, sub_doc: str) -> int | None:
        """The last commit clock of ``sub_doc`` this client saw (None if never)."""
        with self._lock:
            row = self._db.execute(
                "SELECT clock FROM seen WHERE workspace_id = ? AND sub_doc = ?",
                (self.workspace_id, sub_doc),
            ).fetchone()
        return None if row is None else int(row[0])

    # ------------------------------------------------------------------- writes

    def apply(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        base_clock: int | None = None,
        send: bool = True,
    ) -> ApplyResult | None:
        """Mint an op id, persist the op, then send it (after any pending ones).

        ``base_clock`` defaults to the clock this client last saw of ``sub_doc``
        (:meth:`seen_clock`; none before it saw the sub-doc, and the server then
        takes the op as new). ``send=False`` only queues it (offline);
        :meth:`replay` sends it later. Raises :class:`TransportError` when
        retries are exhausted: the op stays in the outbox and a later
        :meth:`replay` sends it with the same op id. Returns this op's answer;
        other pending ops parked on the way are listed by :meth:`parked`, and
        if this op itself is parked, :class:`OpsParked` is raised.
        """
        # Refuse a malformed op (NaN, too deep, …) before it reaches the outbox.
        parsed = parse_op(op, max_depth=get_settings().max_payload_depth)
        if base_clock is not None and (
            isinstance(base_clock, bool) or not isinstance(base_clock, int) or base_clock < 0
        ):
            raise InvalidRequest("base_clock must be a non-negative integer")
        with self._lock:
            if base_clock is None:
                base_clock = self.seen_clock(sub_doc)
            op_id = self._add(sub_doc, json.dumps(parsed.model_dump(mode="json")), base_clock)
            return self._send_own(op_id, send)

    def _add(self, sub_doc: str, op_json: str, base_clock: int | None) -> str:
        op_id = new_op_id()
        self._db.execute(
            "INSERT INTO outbox (op_id, workspace_id, sub_doc, op, base_clock)"
            " VALUES (?, ?, ?, ?, ?)",
            (op_id, self.workspace_id, sub_doc, op_json, base_clock),
        )
        self._unsent.add(op_id)
        return op_id

    def _send_own(self, op_id: str, send: bool) -> ApplyResult | None:
        if not send:
            return None
        results, parked = self._pass()
        for result in results:
            if result.op_id == op_id:
                if parked:
                    log.warning("%d earlier op(s) parked as too old: see parked()", len(parked))
                return result
        raise OpsParked(parked, results)  # this op was parked (nothing else leaves it out)

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
        An op refused as older than the horizon (:class:`ReplayTooOld`) is moved
        to the parked ops and the pass goes on; after the pass,
        :class:`OpsParked` (a :class:`ReplayTooOld`) is raised, carrying the
        parked ops and the answers of the others.
        """
        with self._lock:
            results, parked = self._pass()
        if parked:
            raise OpsParked(parked, results)
        return results

    def _pass(self) -> tuple[list[ApplyResult], list[dict[str, Any]]]:
        results: list[ApplyResult] = []
        parked: list[dict[str, Any]] = []
        for item in self.pending():
            try:
                result = self._send(item)
            except TransportError:
                raise
            except ReplayTooOld as exc:
                parked.append(self._park(item, exc))
                continue
            except OnceflowError as exc:
                if getattr(exc, "retryable", False):
                    raise  # no answer for this op (a custom transport's blip): keep it
                self._ack(item["op_id"])
                raise
            with self._txn():
                if result.clock is not None:
                    self._observe(item["sub_doc"], result.clock)
                self._ack(item["op_id"])
            results.append(result)
        return results, parked

    def _send(self, item: dict[str, Any]) -> ApplyResult:
        rebases = 0
        attempt = 1
        while True:
            op_id = item["op_id"]
            known_new = op_id in self._unsent
            self._unsent.discard(op_id)  # from here on, this attempt may apply it
            try:
                return self.transport.apply(
                    self.workspace_id, item["sub_doc"], item["op"], op_id, item["base_clock"]
                )
            except ReplayTooOld as exc:
                # A refusal records nothing. If no attempt of this op may have been applied,
                # it is not a replay: re-base it on the horizon the server reported.
                if not known_new or rebases == _REBASES:
                    raise
                rebases += 1
                item = {**item, "base_clock": self._rebase(item, exc.horizon)}
                self._unsent.add(op_id)
            except TransportError:
                if attempt == self.max_attempts:
                    raise
                attempt += 1
                self.retries += 1
                delay = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 2))
                time.sleep(delay / 2 + random.uniform(0, delay / 2))

    def _rebase(self, item: dict[str, Any], horizon: int) -> int:
        base = max(horizon, item["base_clock"] or 0, self.seen_clock(item["sub_doc"]) or 0)
        with self._txn():
            self._observe(item["sub_doc"], horizon)
            self._db.execute(
                "UPDATE outbox SET base_clock = ? WHERE op_id = ?", (base, item["op_id"])
            )
        return base

    def _park(self, item: dict[str, Any], exc: ReplayTooOld) -> dict[str, Any]:
        error = {"type": "ReplayTooOld", "message": str(exc), "horizon": exc.horizon}
        with self._txn():
            self._db.execute(
                "INSERT INTO parked (op_id, workspace_id, sub_doc, op, base_clock, error)"
                " SELECT op_id, workspace_id, sub_doc, op, base_clock, ? FROM outbox"
                " WHERE op_id = ?",
                (json.dumps(error), item["op_id"]),
            )
            self._ack(item["op_id"])
            # The server says the sub-doc is at least at the horizon: new ops base on it.
            self._observe(item["sub_doc"], exc.horizon)
        log.warning(
            "op %s on %s/%s refused as older than the horizon %d: parked",
            item["op_id"], self.workspace_id, item["sub_doc"], exc.horizon,
        )  # fmt: skip
        return {
            "op_id": item["op_id"],
            "sub_doc": item["sub_doc"],
            "op": item["op"],
            "base_clock": item["base_clock"],
            "error": error,
        }

    def _ack(self, op_id: str) -> None:
        self._db.execute("DELETE FROM outbox WHERE op_id = ?", (op_id,))

    # -------------------------------------------------------------- parked ops

    def parked(self) -> list[dict[str, Any]]:
        """Ops the server refused as older than its horizon, oldest first.

        Each may have been applied already (its first answer was lost and its
        log row pruned since): re-read the sub-doc, then :meth:`resubmit` the
        ones still wanted or :meth:`discard` them. Keys: ``op_id``, ``sub_doc``,
        ``op``, ``base_clock``, ``error`` (with the ``horizon``).
        """
        with self._lock:
            rows = self._db.execute(
                "SELECT op_id, sub_doc, op, base_clock, error FROM parked"
                " WHERE workspace_id = ? ORDER BY seq",
                (self.workspace_id,),
            ).fetchall()
        return [
            {
                "op_id": r[0],
                "sub_doc": r[1],
                "op": json.loads(r[2]),
                "base_clock": r[3],
                "error": json.loads(r[4]),
            }
            for r in rows
        ]

    def discard(self, op_id: str) -> None:
        """Forget a parked op (the application decided it is not wanted)."""
        with self._lock:
            gone = self._db.execute(
                "DELETE FROM parked WHERE op_id = ? AND workspace_id = ?",
                (op_id, self.workspace_id),
            ).rowcount
        if gone == 0:
            raise InvalidRequest(f"no parked op {op_id!r} in workspace {self.workspace_id!r}")

    def resubmit(self, op_id: str, *, send: bool = True) -> ApplyResult | None:
        """Send a parked op again as a *new* op: a new op id, based on the clock seen now.

        For the application that checked the sub-doc and still wants the op.
        Returns its answer like :meth:`apply` (None with ``send=False``).
        """
        with self._lock:
            row = self._db.execute(
                "SELECT sub_doc, op FROM parked WHERE op_id = ? AND workspace_id = ?",
                (op_id, self.workspace_id),
            ).fetchone()
            if row is None:
                raise InvalidRequest(f"no parked op {op_id!r} in workspace {self.workspace_id!r}")
            with self._txn():
                self._db.execute("DELETE FROM parked WHERE op_id = ?", (op_id,))
                new_id = self._add(row[0], row[1], self.seen_clock(row[0]))
            return self._send_own(new_id, send)

    def close(self) -> None:
        """Close the outbox file (pending and parked ops stay in it)."""
        self._db.close()
