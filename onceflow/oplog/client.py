"""The retry-safe client SDK: mint the op id once, keep it through retries, restarts, replays.

``WorkspaceClient.apply`` mints a nanoid op id *before* the first send and
stores the pending op in a durable outbox (a SQLite file), so a crash or a
"tab reload" loses nothing; transport errors are retried with exponential
backoff and jitter under the *same* op id, so the server applies the op once
and every retry gets the original commit clock. An op leaves the outbox only
when the server answered for it. Pending ops are replayed in order before any
new op is sent.

Retention: the client records, per sub-doc, the last commit clock it saw (every
answer, and :meth:`WorkspaceClient.observe` for reads) and sends it with each op
as ``base_clock`` (0 on a sub-doc it never saw). The server refuses an op it no
longer knows whose ``base_clock`` is below the op log's horizon
(:class:`ReplayTooOld`): it may be a pruned op coming back. Such an op is
*parked* in the same file, never dropped; the application lists it
(:meth:`~WorkspaceClient.parked`), and discards or resubmits it. An op this
client minted and never sent with an unknown outcome cannot be a replay: refused
on its first sends, it is re-based on the horizon the server reported and sent
again, not parked.

:class:`AsyncWorkspaceClient` is the same client for asyncio: both drive the one
set of rules in :class:`~onceflow.oplog.outbox.Outbox` (generators of "send this
op" / "wait" steps), through a :class:`Transport` or an :class:`AsyncTransport`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from onceflow.connector import Sleep
from onceflow.connector.trampoline import ado_step, adrive, do_step, drive
from onceflow.errors import DatabaseUnavailable
from onceflow.models.ops import OpModel
from onceflow.oplog.outbox import ClientSteps, OpsParked, Outbox, Send, TransportError
from onceflow.oplog.records import ApplyResult
from onceflow.oplog.store import AsyncOpLog, OpLog

R = TypeVar("R")
TransportT = TypeVar("TransportT")


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
        with _unknown_outcome():
            return self.oplog.apply_op(workspace_id, sub_doc, op, op_id, base_clock=base_clock)


# Transport's twin for asyncio (alike by shape): a protocol's async methods are declared, not made.
class AsyncTransport(Protocol):
    """How ops reach the server from an event loop (:class:`AsyncWorkspaceClient`)."""

    async def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        op: dict[str, Any],
        op_id: str,
        base_clock: int | None,
    ) -> ApplyResult:
        """Send one op; raise :class:`TransportError` when the outcome is unknown."""
        ...


class AsyncInProcessTransport:
    """Awaits :meth:`AsyncOpLog.apply_op` directly (server-side asyncio code, tests)."""

    def __init__(self, oplog: AsyncOpLog) -> None:
        self.oplog = oplog

    async def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        op: dict[str, Any],
        op_id: str,
        base_clock: int | None,
    ) -> ApplyResult:
        """Apply the op through the op log (see :meth:`InProcessTransport.apply`)."""
        with _unknown_outcome():
            return await self.oplog.apply_op(
                workspace_id, sub_doc, op, op_id, base_clock=base_clock
            )


@contextmanager
def _unknown_outcome() -> Iterator[None]:
    # A database that did not answer may or may not have committed the op.
    try:
        yield
    except DatabaseUnavailable as exc:
        raise TransportError(f"database unavailable: {exc}") from exc


# Same shape as Outbox.__init__ on purpose: the client passes the outbox's options on.
class OutboxClient(Generic[TransportT]):
    """What both clients hold: a transport, one workspace, the durable outbox of its ops."""

    def __init__(
        self,
        transport: TransportT,
        workspace_id: str,
        *,
        outbox: str | Path = ":memory:",
        max_attempts: int = 8,
        backoff_base: float = 0.05,
        backoff_max: float = 5.0,
    ) -> None:
        self.transport = transport
        self.workspace_id = workspace_id
        self.outbox = Outbox(
            workspace_id,
            outbox,
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
        )

    @property
    def retries(self) -> int:
        """Transport errors retried, over this client's life."""
        return self.outbox.retries

    def close(self) -> None:
        """Close the outbox file (pending and parked ops stay in it)."""
        self.outbox.close()


class WorkspaceClient(OutboxClient[Transport]):
    """A client of one workspace's sub-docs with a durable outbox of pending ops.

    Thread-safe: threads sharing one client send one at a time. The rules are
    :class:`Outbox`'s, shared with :class:`AsyncWorkspaceClient`.
    """

    def _run(self, steps: ClientSteps[R]) -> R:
        """Drive the rules' steps: the transport sends, ``time.sleep`` waits."""
        with self.outbox.lock:
            return drive(steps, self._do)

    def _do(self, step: Send | Sleep) -> Any:
        if isinstance(step, Send):
            return self.transport.apply(*_args(step))
        return do_step(step)

    # ------------------------------------------------------------------ clocks

    def observe(self, sub_doc: str, clock: int) -> None:
        """Record that ``sub_doc`` was seen at commit ``clock`` (e.g. after reading it).

        Answers to this client's ops are recorded on their own; call this for
        reads (``get_sub_doc``, ``ops_since``, broadcasts), so that the next op
        carries a recent ``base_clock``. The recorded clock never goes down.
        """
        self.outbox.observe(sub_doc, clock)

    def seen_clock(self, sub_doc: str) -> int | None:
        """The last commit clock of ``sub_doc`` this client saw (None if never)."""
        return self.outbox.seen_clock(sub_doc)

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
        (:meth:`seen_clock`; 0 before it saw the sub-doc, so that a replay of even a
        first op whose log row was pruned is refused, never applied twice; an op this
        process has not sent yet that is refused as too old is re-based on the
        reported horizon and sent again). ``send=False`` only queues it (offline);
        :meth:`replay` sends it later. Raises :class:`TransportError` when
        retries are exhausted: the op stays in the outbox and a later
        :meth:`replay` sends it with the same op id. Returns this op's answer;
        other pending ops parked on the way are listed by :meth:`parked`, and
        if this op itself is parked, :class:`OpsParked` is raised.
        """
        return self._run(self.outbox.apply(sub_doc, op, base_clock=base_clock, send=send))

    def pending(self) -> list[dict[str, Any]]:
        """The ops not yet acknowledged, in the order they were made."""
        return self.outbox.pending()

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
        return self._run(self.outbox.replay())

    # -------------------------------------------------------------- parked ops

    def parked(self) -> list[dict[str, Any]]:
        """Ops the server refused as older than its horizon, oldest first.

        Each may have been applied already (its first answer was lost and its
        log row pruned since): re-read the sub-doc, then :meth:`resubmit` the
        ones still wanted or :meth:`discard` them. Keys: ``op_id``, ``sub_doc``,
        ``op``, ``base_clock``, ``error`` (with the ``horizon``).
        """
        return self.outbox.parked()

    def discard(self, op_id: str) -> None:
        """Forget a parked op (the application decided it is not wanted)."""
        self.outbox.discard(op_id)

    def resubmit(self, op_id: str, *, send: bool = True) -> ApplyResult | None:
        """Send a parked op again as a *new* op: a new op id, based on the clock seen now.

        For the application that checked the sub-doc and still wants the op.
        Returns its answer like :meth:`apply` (None with ``send=False``).
        """
        return self._run(self.outbox.resubmit(op_id, send=send))


class AsyncWorkspaceClient(OutboxClient[AsyncTransport]):
    """:class:`WorkspaceClient` for asyncio: the same rules (:class:`Outbox`), awaited.

    Ops go through an :class:`AsyncTransport` (:class:`AsyncInProcessTransport`,
    :class:`~onceflow.oplog.http.AsyncHttpTransport`), backoff waits with
    ``asyncio.sleep``, and the outbox file (SQLite, fsynced) is read and written in a
    worker thread, so the event loop never blocks on it. Calls on one client run one
    at a time; use a client from one event loop.
    """

    _turn: asyncio.Lock | None = None  # made on first use, inside the event loop

    async def _run(self, steps: ClientSteps[R]) -> R:
        """Drive the rules' steps: advanced in a worker thread (the outbox file), the
        transport sends, ``asyncio.sleep`` waits; one call at a time."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            return await adrive(steps, self._ado, off_loop=self.outbox.lock)

    async def _ado(self, step: Send | Sleep) -> Any:
        if isinstance(step, Send):
            return await self.transport.apply(*_args(step))
        return await ado_step(step)

    async def observe(self, sub_doc: str, clock: int) -> None:
        """:meth:`WorkspaceClient.observe`."""
        await asyncio.to_thread(self.outbox.observe, sub_doc, clock)

    async def seen_clock(self, sub_doc: str) -> int | None:
        """:meth:`WorkspaceClient.seen_clock`."""
        return await asyncio.to_thread(self.outbox.seen_clock, sub_doc)

    async def apply(
        self,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        *,
        base_clock: int | None = None,
        send: bool = True,
    ) -> ApplyResult | None:
        """:meth:`WorkspaceClient.apply`: the op id minted once, retried under it."""
        return await self._run(self.outbox.apply(sub_doc, op, base_clock=base_clock, send=send))

    async def pending(self) -> list[dict[str, Any]]:
        """:meth:`WorkspaceClient.pending`."""
        return await asyncio.to_thread(self.outbox.pending)

    async def replay(self) -> list[ApplyResult]:
        """:meth:`WorkspaceClient.replay`."""
        return await self._run(self.outbox.replay())

    async def parked(self) -> list[dict[str, Any]]:
        """:meth:`WorkspaceClient.parked`."""
        return await asyncio.to_thread(self.outbox.parked)

    async def discard(self, op_id: str) -> None:
        """:meth:`WorkspaceClient.discard`."""
        await asyncio.to_thread(self.outbox.discard, op_id)

    async def resubmit(self, op_id: str, *, send: bool = True) -> ApplyResult | None:
        """:meth:`WorkspaceClient.resubmit`."""
        return await self._run(self.outbox.resubmit(op_id, send=send))

    async def aclose(self) -> None:
        """:meth:`~OutboxClient.close`, off the event loop."""
        await asyncio.to_thread(self.outbox.close)


def _args(step: Send) -> tuple[str, str, dict[str, Any], str, int | None]:
    return step.workspace_id, step.sub_doc, step.op, step.op_id, step.base_clock


__all__ = [
    "AsyncInProcessTransport",
    "AsyncTransport",
    "AsyncWorkspaceClient",
    "InProcessTransport",
    "OpsParked",
    "Outbox",
    "Transport",
    "TransportError",
    "WorkspaceClient",
]
