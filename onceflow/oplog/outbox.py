"""The retry-safe client's rules and durable outbox, without I/O to the server (sans-I/O).

:class:`Outbox` is one state machine — mint the op id once, persist the op
before the first send, retry transport errors with backoff under the same id,
replay pending ops in order, re-base an op never sent, park a replay refused as
older than the horizon — written once as generators of :class:`Send` and
:class:`~onceflow.connector.Sleep` steps. :class:`~onceflow.oplog.WorkspaceClient`
drives them with a sync transport, :class:`~onceflow.oplog.AsyncWorkspaceClient`
with an async one (see :mod:`onceflow.oplog.client`).
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

from onceflow.connector import Sleep
from onceflow.errors import InvalidRequest, OnceflowError, ReplayTooOld
from onceflow.models.ops import OpModel, parse_op
from onceflow.oplog.records import ApplyResult, new_op_id
from onceflow.settings import get_settings

log = logging.getLogger("onceflow.oplog.client")

R = TypeVar("R")

# Times an op known never to have been applied is re-based on a reported horizon and resent.
_REBASES = 3


class TransportError(OnceflowError):
    """The op may or may not have reached the server: retry it with the same op id."""


class OpsParked(ReplayTooOld):
    """A client's ``replay`` pass parked ops the server refused as too old.

    Raised after the pass: every other pending op was sent. ``parked`` holds the
    ops parked by this pass (as :meth:`~onceflow.oplog.WorkspaceClient.parked` lists them),
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


@dataclass(frozen=True, slots=True)
class Send:
    """A step of the client's rules: send this op through the transport.

    Answers the transport's :class:`ApplyResult`; the transport's error (e.g.
    :class:`TransportError`) is thrown into the rules at the ``yield``.
    """

    workspace_id: str
    sub_doc: str
    op: dict[str, Any]
    op_id: str
    base_clock: int | None


#: What the client's rules yield: send an op, or wait (:class:`~onceflow.connector.Sleep`).
ClientStep: TypeAlias = Send | Sleep
ClientSteps: TypeAlias = Generator[ClientStep, Any, R]


#: The pending ops, and the parked ones (with the refusal), of one workspace, oldest first.
_PENDING = "SELECT op_id, sub_doc, op, base_clock FROM outbox WHERE workspace_id = ? ORDER BY seq"
_PARKED = (
    "SELECT op_id, sub_doc, op, base_clock, error FROM parked WHERE workspace_id = ? ORDER BY seq"
)


class Outbox:
    """The client's durable outbox and its rules, without I/O to the server (sans-I/O).

    The SQLite file holds the pending ops, the clock seen per sub-doc and the parked
    ops. :meth:`apply`, :meth:`replay` and :meth:`resubmit` are the rules — mint the op
    id once, retry with backoff under the same id, re-base a never-sent op, park a
    refused replay — written once as generators of :class:`Send` and
    :class:`~onceflow.connector.Sleep` steps, driven by
    :class:`~onceflow.oplog.WorkspaceClient` (a sync transport) and
    :class:`~onceflow.oplog.AsyncWorkspaceClient` (an async one). A driver holds
    :attr:`lock` while it advances them; the other methods take it themselves.
    """

    def __init__(
        self,
        workspace_id: str,
        outbox: str | Path = ":memory:",
        *,
        max_attempts: int = 8,
        backoff_base: float = 0.05,
        backoff_max: float = 5.0,
    ) -> None:
        self.workspace_id = workspace_id
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.retries = 0  # transport errors retried, over this outbox's life
        # check_same_thread=False + our own lock: one client may be shared by threads.
        self._db = sqlite3.connect(str(outbox), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an acknowledged add survives power loss
        for statement in _SCHEMA:
            self._db.execute(statement)
        self.lock = threading.RLock()
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
        """See :meth:`~onceflow.oplog.WorkspaceClient.observe`."""
        if isinstance(clock, bool) or not isinstance(clock, int) or clock < 0:
            raise InvalidRequest("clock must be a non-negative integer")
        with self.lock:
            self._observe(sub_doc, clock)

    def _observe(self, sub_doc: str, clock: int) -> None:
        self._db.execute(
            "INSERT INTO seen (workspace_id, sub_doc, clock) VALUES (?, ?, ?)"
            " ON CONFLICT (workspace_id, sub_doc) DO UPDATE SET clock = max(clock, excluded.clock)",
            (self.workspace_id, sub_doc, clock),
        )

    def seen_clock(self, sub_doc: str) -> int | None:
        """The last commit clock of ``sub_doc`` this client saw (None if never)."""
        with self.lock:
            row = self._db.execute(
                "SELECT clock FROM seen WHERE workspace_id = ? AND sub_doc = ?",
                (self.workspace_id, sub_doc),
            ).fetchone()
        return None if row is None else int(row[0])

    def _base_clock(self, sub_doc: str) -> int:
        # The base_clock of an op minted now: the clock seen, 0 on a sub-doc never seen. Never
        # None: the server takes an op without one as new, so a replay of it whose log row was
        # pruned would be applied a second time. An op based on 0 that this process has not
        # sent yet is refused only as too old, and then re-based on the horizon (_send).
        seen = self.seen_clock(sub_doc)
        return 0 if seen is None else seen

    # ------------------------------------------------------------------- rules

    def apply(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        base_clock: int | None = None,
        send: bool = True,
    ) -> ClientSteps[ApplyResult | None]:
        """The steps of :meth:`~onceflow.oplog.WorkspaceClient.apply`."""
        # Refuse a malformed op (NaN, too deep, …) before it reaches the outbox.
        parsed = parse_op(op, max_depth=get_settings().max_payload_depth)
        if base_clock is not None and (
            isinstance(base_clock, bool) or not isinstance(base_clock, int) or base_clock < 0
        ):
            raise InvalidRequest("base_clock must be a non-negative integer")
        if base_clock is None:
            base_clock = self._base_clock(sub_doc)
        op_id = self._add(sub_doc, json.dumps(parsed.model_dump(mode="json")), base_clock)
        return (yield from self._send_own(op_id, send))

    def _add(self, sub_doc: str, op_json: str, base_clock: int | None) -> str:
        op_id = new_op_id()
        self._db.execute(
            "INSERT INTO outbox (op_id, workspace_id, sub_doc, op, base_clock)"
            " VALUES (?, ?, ?, ?, ?)",
            (op_id, self.workspace_id, sub_doc, op_json, base_clock),
        )
        self._unsent.add(op_id)
        return op_id

    def _send_own(self, op_id: str, send: bool) -> ClientSteps[ApplyResult | None]:
        if not send:
            return None
        results, parked = yield from self._pass()
        for result in results:
            if result.op_id == op_id:
                if parked:
                    log.warning("%d earlier op(s) parked as too old: see parked()", len(parked))
                return result
        raise OpsParked(parked, results)  # this op was parked (nothing else leaves it out)

    def pending(self) -> list[dict[str, Any]]:
        """The ops not yet acknowledged, in the order they were made."""
        return self._listed(_PENDING)

    def replay(self) -> ClientSteps[list[ApplyResult]]:
        """The steps of :meth:`~onceflow.oplog.WorkspaceClient.replay`."""
        results, parked = yield from self._pass()
        if parked:
            raise OpsParked(parked, results)
        return results

    def _pass(self) -> ClientSteps[tuple[list[ApplyResult], list[dict[str, Any]]]]:
        results: list[ApplyResult] = []
        parked: list[dict[str, Any]] = []
        for item in self.pending():
            try:
                result = yield from self._send(item)
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

    def _send(self, item: dict[str, Any]) -> ClientSteps[ApplyResult]:
        rebases = 0
        attempt = 1
        while True:
            op_id = item["op_id"]
            known_new = op_id in self._unsent
            self._unsent.discard(op_id)  # from here on, this attempt may apply it
            try:
                result: ApplyResult = yield Send(
                    self.workspace_id, item["sub_doc"], item["op"], op_id, item["base_clock"]
                )
                return result
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
                yield Sleep(delay / 2 + random.uniform(0, delay / 2))

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
        """See :meth:`~onceflow.oplog.WorkspaceClient.parked`."""
        return self._listed(_PARKED)

    def _listed(self, query: str) -> list[dict[str, Any]]:
        """This workspace's ops of one table (pending or parked) as dicts, oldest first."""
        with self.lock:
            rows = self._db.execute(query, (self.workspace_id,)).fetchall()
        listed = []
        for r in rows:
            op = {"op_id": r[0], "sub_doc": r[1], "op": json.loads(r[2]), "base_clock": r[3]}
            if len(r) > 4:  # a parked op: why the server refused it
                op["error"] = json.loads(r[4])
            listed.append(op)
        return listed

    def discard(self, op_id: str) -> None:
        """Forget a parked op (the application decided it is not wanted)."""
        with self.lock:
            gone = self._db.execute(
                "DELETE FROM parked WHERE op_id = ? AND workspace_id = ?",
                (op_id, self.workspace_id),
            ).rowcount
        if gone == 0:
            raise InvalidRequest(f"no parked op {op_id!r} in workspace {self.workspace_id!r}")

    def resubmit(self, op_id: str, *, send: bool = True) -> ClientSteps[ApplyResult | None]:
        """The steps of :meth:`~onceflow.oplog.WorkspaceClient.resubmit`."""
        row = self._db.execute(
            "SELECT sub_doc, op FROM parked WHERE op_id = ? AND workspace_id = ?",
            (op_id, self.workspace_id),
        ).fetchone()
        if row is None:
            raise InvalidRequest(f"no parked op {op_id!r} in workspace {self.workspace_id!r}")
        with self._txn():
            self._db.execute("DELETE FROM parked WHERE op_id = ?", (op_id,))
            new_id = self._add(row[0], row[1], self._base_clock(row[0]))
        return (yield from self._send_own(new_id, send))

    def close(self) -> None:
        """Close the outbox file (pending and parked ops stay in it)."""
        self._db.close()
