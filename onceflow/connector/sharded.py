"""The router: one connector over N Postgres databases, each holding some workspaces.

:class:`ShardedConnector` (sync, one :class:`~onceflow.connector.PsycopgConnector` per
shard) and :class:`AsyncShardedConnector` (asyncio, one
:class:`~onceflow.connector.AsyncPsycopgConnector` per shard) run each statement on the
database of the workspace it names — the ``workspace_id`` parameter every statement
about a request, a lock or a sub-doc carries, or the ``workspace_ids`` of a batch (which
must all live on one shard: operations over many workspaces split themselves with
:class:`~onceflow.connector.ShardGroups`). A statement that names a request by its id
alone (a wake-up sent before wake-ups carried the workspace, a client that does not
send it) is routed by looking the id up on each shard (``located`` counts these).
Operations over every workspace (claims by worker class, counts, sweeps, prunes) run per
shard with :class:`~onceflow.connector.OnShard`; a statement that names no workspace and
comes without one is refused (:class:`UnroutedStatement`), so a path that was never
taught about shards fails loudly instead of reading one shard's rows as if they were all.

Both classes share one decision (:class:`_Routing`): the shard a statement's parameters
name, and the look-up of a request id as steps (:func:`locate_steps`) that each class
drives with its own runner (``run`` / ``arun``), so only the I/O differs.

A transaction is pinned to the shard of its first statement; a later statement of
another shard raises :class:`CrossShardTransaction` and the transaction rolls back. No
transaction ever spans two databases: a workspace's writes are atomic, nothing else
needs to be (docs/sharding.md, section 3).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    ExitStack,
    asynccontextmanager,
    contextmanager,
)
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine

from onceflow.connector.aio import AsyncPsycopgConnector
from onceflow.connector.run import arun, run
from onceflow.connector.steps import (
    AsyncConnector,
    Connector,
    OnShard,
    Query,
    Steps,
    _call_safely,
    one_row,
)
from onceflow.connector.sync import PsycopgConnector
from onceflow.db import get_engine, redact_url
from onceflow.errors import DatabaseUnavailable, InvalidRequest, ShardMismatch
from onceflow.shards import IDENTITY_SQL, ShardMap, identity_problem

log = logging.getLogger("onceflow.db")

#: Where a request named by id alone lives: its workspace (ix_wpr_request_id).
LOCATE = Query(
    "shards.locate",
    "SELECT workspace_id FROM workspace_process_requests WHERE request_id = %(request_id)s LIMIT 1",
)

_LOCATED_CACHE = 4096

C = TypeVar("C")


class UnroutedStatement(InvalidRequest):
    """A statement named no workspace on a database split by workspace: it must run per
    shard (``OnShard``) or name the workspace. A bug in the caller, never a user's input."""


class AmbiguousRequestId(InvalidRequest):
    """A request named by its id alone, and the id names requests of several workspaces
    (ids callers chose, reused): it must be addressed with its workspace."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(
            f"request id {request_id!r} names requests of several workspaces: "
            "address it with its workspace"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id,))


class CrossShardTransaction(InvalidRequest):
    """A transaction reached a second shard: one transaction stays within one workspace."""


def route(shard_map: ShardMap, query: Query, params: Mapping[str, Any]) -> int | str:
    """The shard ``query`` runs on, from the workspace its parameters name — or, for a
    statement that names a request by its id alone, that id (to be looked up: see
    :func:`locate_steps`). Anything else is :class:`UnroutedStatement`."""
    ws = params.get("workspace_id")
    if isinstance(ws, str) and ws:
        return shard_map.shard_of(ws)
    spaces = params.get("workspace_ids")
    if isinstance(spaces, list | tuple) and spaces:
        shards = {shard_map.shard_of(w) for w in spaces}
        if len(shards) > 1:
            raise UnroutedStatement(
                f"{query.name}: the workspaces of one statement live on "
                f"{len(shards)} shards; split it per shard (ShardGroups)"
            )
        return shards.pop()
    rid = params.get("request_id") or params.get("fence")
    if isinstance(rid, str) and rid:
        return rid
    raise UnroutedStatement(
        f"{query.name} names no workspace: on a database split by workspace it runs "
        "per shard (OnShard) or with its workspace"
    )


def locate_steps(shards: int, request_id: str) -> Steps[int | None]:
    """The shard holding ``request_id``, looked up on each of ``shards``; None when none has
    it. An id found on two shards (ids callers chose, reused across workspaces) names
    neither: :class:`AmbiguousRequestId`. A shard that cannot be reached is skipped; its
    error is raised when no other shard had it (the request may live there)."""
    failed: DatabaseUnavailable | None = None
    found: list[int] = []
    for index in range(shards):
        try:
            row = yield OnShard(index, one_row(LOCATE, {"request_id": request_id}))
        except DatabaseUnavailable as exc:  # this shard is down: maybe it is elsewhere
            failed = exc
            continue
        if row is not None:
            found.append(index)
    if len(found) > 1:
        raise AmbiguousRequestId(request_id)
    if found:
        return found[0]
    if failed is not None:
        raise failed  # not found where we could look: it may be on the shard that failed
    return None


class _Routing(Generic[C]):
    """What both routers share: the map, one connector per shard, and the routing decision
    with its cache of located request ids. The I/O (the look-up) is the subclass's."""

    pooled = True

    def __init__(self, shard_map: ShardMap, connectors: Sequence[C]) -> None:
        if len(connectors) != len(shard_map):
            raise ValueError("one connector per shard of the map")
        self.shard_map = shard_map
        self.shard_connectors: tuple[C, ...] = tuple(connectors)
        #: Statements routed by looking their request id up on the shards (see module).
        self.located = 0
        self._where: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _route(self, query: Query, params: Mapping[str, Any]) -> int | str:
        """The shard index, or the request id still to be looked up (not in the cache)."""
        where = route(self.shard_map, query, params)
        if isinstance(where, int):
            return where
        with self._lock:
            self.located += 1
            known = self._where.get(where)
        return where if known is None else known

    def _locate(self, request_id: str) -> Steps[int]:
        """The look-up of ``request_id`` (steps, run on this router by its own runner);
        a shard found is remembered. 0 when no shard has it: the statement then finds
        nothing there, as it would on one database."""
        index = yield from locate_steps(len(self.shard_connectors), request_id)
        if index is None:
            return 0
        with self._lock:
            self._where[request_id] = index
            while len(self._where) > _LOCATED_CACHE:
                self._where.popitem(last=False)
        return index

    def after_commit(self, fn: Callable[[], object]) -> None:
        _call_safely(fn)  # every statement here commits on its own


class _Pin:
    """A transaction of a router: opened on the shard of its first statement, refusing any
    other shard after that; its after-commit callbacks run once the router's commits."""

    pooled = False

    def __init__(self) -> None:
        self.index: int | None = None
        self.callbacks: list[Callable[[], object]] = []

    def _same(self, query: Query, index: int) -> None:
        if index != self.index:
            raise CrossShardTransaction(
                f"{query.name}: a transaction on shard {self.index} reached shard {index}; "
                "one transaction stays within one workspace"
            )

    @staticmethod
    def _unknown() -> CrossShardTransaction:
        return CrossShardTransaction(
            "a nested transaction before any statement: its shard is not known"
        )

    def after_commit(self, fn: Callable[[], object]) -> None:
        self.callbacks.append(fn)


# ---------------------------------------------------------------------- shard identity

#: The shard's identity row (migration 0009, written by ``onceflow migrate``).
IDENTITY = Query("shards.identity", IDENTITY_SQL)


def _refuse_unless(
    row: Mapping[str, Any] | None, index: int, shard_map: ShardMap, url: Any
) -> None:
    problem = identity_problem(row, index, shard_map)
    if problem is not None:
        raise ShardMismatch(f"database {redact_url(url)} {problem}")


class _CheckedShard(PsycopgConnector):
    """Shard ``index``'s pooled connections; before its first statement in this process it
    checks that the database is that shard of ``shard_map`` (its ``onceflow_shard`` row):
    a database reached through a map that names it otherwise is refused
    (:class:`~onceflow.errors.ShardMismatch`), never written to."""

    # A constructor keeping its arguments (alike by shape with others): nothing to share.
    def __init__(self, engine: Engine, index: int, shard_map: ShardMap) -> None:
        super().__init__(engine)
        self.index = index
        self.shard_map = shard_map
        self.checked = False

    def _check(self) -> None:
        if not self.checked:
            _refuse_unless(super().fetch_one(IDENTITY, {}), self.index, self.shard_map,
                           self.engine.url)  # fmt: skip
            self.checked = True

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        self._check()
        return super().fetch_one(query, params)

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        self._check()
        return super().fetch_all(query, params)

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        self._check()
        return super().execute(query, params)

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        self._check()
        with super().transaction() as tx:
            yield tx


class _CheckedAsyncShard(AsyncPsycopgConnector):
    """:class:`_CheckedShard` for the asyncio router."""

    def __init__(self, url: str, index: int, shard_map: ShardMap, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.index = index
        self.shard_map = shard_map
        self.checked = False

    async def _check(self) -> None:
        if not self.checked:
            row = await super().fetch_one(IDENTITY, {})
            _refuse_unless(row, self.index, self.shard_map, self.url)
            self.checked = True

    async def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        await self._check()
        return await super().fetch_one(query, params)

    async def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        await self._check()
        return await super().fetch_all(query, params)

    async def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        await self._check()
        return await super().execute(query, params)

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnector]:
        return self._checked_transaction()

    @asynccontextmanager
    async def _checked_transaction(self) -> AsyncIterator[AsyncConnector]:
        await self._check()
        async with super().transaction() as tx:
            yield tx


# ---------------------------------------------------------------------------- sync


class _Statements:
    """A statement runs on the connector :meth:`_on` picks for it (router, transaction)."""

    def _on(self, query: Query, params: Mapping[str, Any]) -> Connector:
        raise NotImplementedError

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return self._on(query, params).fetch_one(query, params)

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self._on(query, params).fetch_all(query, params)

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return self._on(query, params).execute(query, params)


class _AsyncStatements:
    """:class:`_Statements` on an event loop."""

    async def _on(self, query: Query, params: Mapping[str, Any]) -> AsyncConnector:
        raise NotImplementedError

    async def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return await (await self._on(query, params)).fetch_one(query, params)

    async def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return await (await self._on(query, params)).fetch_all(query, params)

    async def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return await (await self._on(query, params)).execute(query, params)


class ShardedConnector(_Statements, _Routing[PsycopgConnector]):
    """Statements routed to the shard of the workspace they name (see the module)."""

    @classmethod
    def from_map(
        cls, shard_map: ShardMap, engines: Sequence[Engine] | None = None
    ) -> ShardedConnector:
        """One pooled connector per shard: on ``engines`` (one per shard, in order), else on
        this process's engine for each URL; each checks its database is that shard."""
        pools = engines if engines is not None else [get_engine(url) for url in shard_map.urls]
        if len(pools) != len(shard_map):
            raise ValueError("one engine per shard of the map")
        return cls(
            shard_map,
            [_CheckedShard(engine, index, shard_map) for index, engine in enumerate(pools)],
        )

    def shard_index(self, query: Query, params: Mapping[str, Any]) -> int:
        """The shard ``query`` runs on, from the workspace its parameters name (or, for a
        request named by id alone, the shard found holding it)."""
        where = self._route(query, params)
        return where if isinstance(where, int) else run(self, self._locate(where))

    def _on(self, query: Query, params: Mapping[str, Any]) -> Connector:
        return self.shard_connectors[self.shard_index(query, params)]

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        with ExitStack() as stack:
            pinned = _Pinned(self, stack)
            yield pinned
        for fn in pinned.callbacks:  # committed: the stack closed without an error
            _call_safely(fn)


class _Pinned(_Statements, _Pin):
    """A transaction of a :class:`ShardedConnector` (see :class:`_Pin`)."""

    def __init__(self, outer: ShardedConnector, stack: ExitStack) -> None:
        super().__init__()
        self.outer = outer
        self.stack = stack
        self.inner: Connector | None = None

    def _on(self, query: Query, params: Mapping[str, Any]) -> Connector:
        index = self.outer.shard_index(query, params)
        if self.inner is None:
            shard = self.outer.shard_connectors[index]
            self.inner = self.stack.enter_context(shard.transaction())
            self.index = index
        else:
            self._same(query, index)
        return self.inner

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        # A savepoint: only once the shard is known (its first statement ran).
        if self.inner is None:
            raise self._unknown()
        with self.inner.transaction() as tx:
            yield tx


# --------------------------------------------------------------------------- async


class AsyncShardedConnector(_AsyncStatements, _Routing[AsyncPsycopgConnector]):
    """:class:`ShardedConnector` for asyncio: one :class:`AsyncPsycopgConnector` per shard
    (a psycopg pool per event loop each, nothing connects until a statement runs there),
    the same routing. Close a loop's pools with :meth:`aclose`."""

    @classmethod
    def from_map(cls, shard_map: ShardMap, *, max_size: int | None = None) -> AsyncShardedConnector:
        """One :class:`AsyncPsycopgConnector` per shard URL of ``shard_map``."""
        return cls(
            shard_map,
            [
                _CheckedAsyncShard(url, index, shard_map, max_size=max_size)
                for index, url in enumerate(shard_map.urls)
            ],
        )

    async def shard_index(self, query: Query, params: Mapping[str, Any]) -> int:
        """:meth:`ShardedConnector.shard_index`, the look-up awaited."""
        where = self._route(query, params)
        return where if isinstance(where, int) else await arun(self, self._locate(where))

    async def _on(self, query: Query, params: Mapping[str, Any]) -> AsyncPsycopgConnector:
        return self.shard_connectors[await self.shard_index(query, params)]

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnector]:
        return self._transaction()

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnector]:
        async with AsyncExitStack() as stack:
            pinned = _AsyncPinned(self, stack)
            yield pinned
        for fn in pinned.callbacks:  # committed: the stack closed without an error
            _call_safely(fn)

    async def aclose(self) -> None:
        """Close this event loop's pool of every shard (each tried; the first error raised
        once all were)."""
        done = await asyncio.gather(
            *(shard.aclose() for shard in self.shard_connectors), return_exceptions=True
        )
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome


# _Pinned's twin for asyncio (alike by shape): the same fields, on async connectors.
class _AsyncPinned(_AsyncStatements, _Pin):
    """A transaction of an :class:`AsyncShardedConnector` (see :class:`_Pin`)."""

    def __init__(self, outer: AsyncShardedConnector, stack: AsyncExitStack) -> None:
        super().__init__()
        self.outer = outer
        self.stack = stack
        self.inner: AsyncConnector | None = None

    async def _on(self, query: Query, params: Mapping[str, Any]) -> AsyncConnector:
        index = await self.outer.shard_index(query, params)
        if self.inner is None:
            shard = self.outer.shard_connectors[index]
            self.inner = await self.stack.enter_async_context(shard.transaction())
            self.index = index
        else:
            self._same(query, index)
        return self.inner

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnector]:
        return self._savepoint()

    @asynccontextmanager
    async def _savepoint(self) -> AsyncIterator[AsyncConnector]:
        # A savepoint: only once the shard is known (its first statement ran).
        if self.inner is None:
            raise self._unknown()
        async with self.inner.transaction() as tx:
            yield tx


def connector_for(shard_map: ShardMap) -> Connector:
    """A connector for ``shard_map``: the plain pooled one for one database, the router
    for several."""
    if len(shard_map) == 1:
        return PsycopgConnector(get_engine(shard_map.urls[0]))
    return ShardedConnector.from_map(shard_map)


def async_connector_for(
    shard_map: ShardMap, *, max_size: int | None = None
) -> AsyncPsycopgConnector | AsyncShardedConnector:
    """:func:`connector_for` for asyncio: an :class:`AsyncPsycopgConnector` for one
    database, the router for several."""
    if len(shard_map) == 1:
        return AsyncPsycopgConnector(shard_map.urls[0], max_size=max_size)
    return AsyncShardedConnector.from_map(shard_map, max_size=max_size)


__all__ = [
    "LOCATE",
    "AsyncShardedConnector",
    "CrossShardTransaction",
    "ShardedConnector",
    "UnroutedStatement",
    "async_connector_for",
    "connector_for",
    "locate_steps",
    "route",
]
