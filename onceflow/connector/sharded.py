"""The router: one connector over N Postgres databases, each holding some workspaces.

:class:`ShardedConnector` runs each statement on the database of the workspace it
names — the ``workspace_id`` parameter every statement about a request, a lock or a
sub-doc carries, or the ``workspace_ids`` of a batch (which must all live on one shard:
operations over many workspaces split themselves with
:class:`~onceflow.connector.ShardGroups`). A statement that names a request by its id
alone (a wake-up sent before wake-ups carried the workspace, a client that does not
send it) is routed by looking the id up on each shard (:attr:`ShardedConnector.located`
counts these). Operations over every workspace (claims by worker class, counts, sweeps,
prunes) run per shard with :class:`~onceflow.connector.OnShard`; a statement that names
no workspace and comes without one is refused (:class:`UnroutedStatement`), so a path
that was never taught about shards fails loudly instead of reading one shard's rows
as if they were all.

A :class:`~onceflow.connector.Transaction` is pinned to the shard of its first
statement; a later statement of another shard raises :class:`CrossShardTransaction`
and the transaction rolls back. No transaction ever spans two databases: a workspace's
writes are atomic, nothing else needs to be (docs/sharding.md, section 3).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from onceflow.connector.steps import Connector, Query, _call_safely
from onceflow.connector.sync import PsycopgConnector
from onceflow.db import get_engine
from onceflow.errors import DatabaseUnavailable, InvalidRequest
from onceflow.shards import ShardMap

log = logging.getLogger("onceflow.db")

#: Where a request named by id alone lives: its workspace (ix_wpr_request_id).
LOCATE = Query(
    "shards.locate",
    "SELECT workspace_id FROM workspace_process_requests WHERE request_id = %(request_id)s LIMIT 1",
)

_LOCATED_CACHE = 4096


class UnroutedStatement(InvalidRequest):
    """A statement named no workspace on a database split by workspace: it must run per
    shard (``OnShard``) or name the workspace. A bug in the caller, never a user's input."""


class CrossShardTransaction(InvalidRequest):
    """A transaction reached a second shard: one transaction stays within one workspace."""


class _Routed:
    """Each statement on the connector :meth:`_on` picks for it."""

    def _on(self, query: Query, params: Mapping[str, Any]) -> Connector:
        raise NotImplementedError

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return self._on(query, params).fetch_one(query, params)

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self._on(query, params).fetch_all(query, params)

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return self._on(query, params).execute(query, params)


class ShardedConnector(_Routed):
    """Statements routed to the shard of the workspace they name (see the module)."""

    pooled = True

    def __init__(self, shard_map: ShardMap, connectors: Sequence[Connector]) -> None:
        if len(connectors) != len(shard_map):
            raise ValueError("one connector per shard of the map")
        self.shard_map = shard_map
        self.shard_connectors: tuple[Connector, ...] = tuple(connectors)
        #: Statements routed by looking their request id up on the shards (see module).
        self.located = 0
        self._where: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_map(cls, shard_map: ShardMap) -> ShardedConnector:
        """One :class:`PsycopgConnector` per shard, on this process's engine for its URL."""
        return cls(shard_map, [PsycopgConnector(get_engine(url)) for url in shard_map.urls])

    # ------------------------------------------------------------------ routing

    def shard_index(self, query: Query, params: Mapping[str, Any]) -> int:
        """The shard ``query`` runs on, from the workspace its parameters name."""
        ws = params.get("workspace_id")
        if isinstance(ws, str) and ws:
            return self.shard_map.shard_of(ws)
        spaces = params.get("workspace_ids")
        if isinstance(spaces, list | tuple) and spaces:
            shards = {self.shard_map.shard_of(w) for w in spaces}
            if len(shards) > 1:
                raise UnroutedStatement(
                    f"{query.name}: the workspaces of one statement live on "
                    f"{len(shards)} shards; split it per shard (ShardGroups)"
                )
            return shards.pop()
        rid = params.get("request_id") or params.get("fence")
        if isinstance(rid, str) and rid:
            return self._locate(rid)
        raise UnroutedStatement(
            f"{query.name} names no workspace: on a database split by workspace it runs "
            "per shard (OnShard) or with its workspace"
        )

    def _locate(self, request_id: str) -> int:
        """The shard holding ``request_id`` (looked up on each; 0 when none has it, where
        the statement then finds nothing, as it would on one database)."""
        with self._lock:
            self.located += 1
            known = self._where.get(request_id)
        if known is not None:
            return known
        failed: DatabaseUnavailable | None = None
        for index, shard in enumerate(self.shard_connectors):
            try:
                row = shard.fetch_one(LOCATE, {"request_id": request_id})
            except DatabaseUnavailable as exc:  # this shard is down: maybe it is elsewhere
                failed = exc
                continue
            if row is not None:
                with self._lock:
                    self._where[request_id] = index
                    while len(self._where) > _LOCATED_CACHE:
                        self._where.popitem(last=False)
                return index
        if failed is not None:
            raise failed  # not found where we could look: it may be on the shard that failed
        return 0

    def _on(self, query: Query, params: Mapping[str, Any]) -> Connector:
        return self.shard_connectors[self.shard_index(query, params)]

    # ------------------------------------------------------------------ Connector

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        pinned = _Pinned(self)
        with ExitStack() as stack:
            pinned.stack = stack
            yield pinned
        for fn in pinned.callbacks:  # committed: the stack closed without an error
            _call_safely(fn)

    def after_commit(self, fn: Callable[[], object]) -> None:
        _call_safely(fn)  # every statement here commits on its own


class _Pinned(_Routed):
    """A transaction of a :class:`ShardedConnector`: opened on the shard of its first
    statement, refusing any other shard after that."""

    pooled = False

    def __init__(self, outer: ShardedConnector) -> None:
        self.outer = outer
        self.stack: ExitStack | None = None
        self.index: int | None = None
        self.inner: Connector | None = None
        self.callbacks: list[Callable[[], object]] = []

    def _on(self, query: Query, params: Mapping[str, Any]) -> Connector:
        index = self.outer.shard_index(query, params)
        if self.inner is None:
            assert self.stack is not None  # noqa: S101 - set by ShardedConnector.transaction
            self.index = index
            self.inner = self.stack.enter_context(self.outer.shard_connectors[index].transaction())
        elif index != self.index:
            raise CrossShardTransaction(
                f"{query.name}: a transaction on shard {self.index} reached shard {index}; "
                "one transaction stays within one workspace"
            )
        return self.inner

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        # A savepoint: only once the shard is known (its first statement ran).
        if self.inner is None:
            raise CrossShardTransaction(
                "a nested transaction before any statement: its shard is not known"
            )
        with self.inner.transaction() as tx:
            yield tx

    def after_commit(self, fn: Callable[[], object]) -> None:
        self.callbacks.append(fn)


def connector_for(shard_map: ShardMap) -> Connector:
    """A connector for ``shard_map``: the plain pooled one for one database, the router
    for several."""
    if len(shard_map) == 1:
        return PsycopgConnector(get_engine(shard_map.urls[0]))
    return ShardedConnector.from_map(shard_map)


__all__ = [
    "LOCATE",
    "CrossShardTransaction",
    "ShardedConnector",
    "UnroutedStatement",
    "connector_for",
]
