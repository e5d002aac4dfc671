"""Steps: what an operation yields (named statements, a transaction, a sleep …), the
connector protocols that run them, and small helpers for writing operations.

:class:`Call` and :class:`Sleep` are the steps every generator of steps shares (the
compute lock's, the op-log client's): they and the loop that runs them are
:mod:`onceflow.connector.trampoline`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar

from sqlalchemy import TextClause

from onceflow.connector.trampoline import Call, Sleep
from onceflow.db import is_disconnect, render

log = logging.getLogger("onceflow.db")

R = TypeVar("R")


# ------------------------------------------------------------------ statements and steps


@dataclass(frozen=True, slots=True)
class Query:
    """A named statement, written for psycopg (``%(name)s`` placeholders; lists bind as arrays).

    ``name`` is how logs, traces and benchmarks count it (``queue.claim``, ``oplog.apply``).
    ``by_id``: the same statement for a caller that names its request by id alone (its
    ``workspace_id`` parameter None), when that needs another form; connectors run
    :meth:`sql_for` the parameters.
    """

    name: str
    sql: str
    by_id: str | None = None

    def sql_for(self, params: Mapping[str, Any]) -> str:
        """The form of this statement that ``params`` run."""
        if self.by_id is not None and params.get("workspace_id") is None:
            return self.by_id
        return self.sql

    @classmethod
    def of(cls, name: str, clause: TextClause | str) -> Query:
        """A query from SQLAlchemy ``text()`` (``:name`` binds, rendered once) or psycopg SQL."""
        return cls(name, clause if isinstance(clause, str) else render(clause))


@dataclass(frozen=True, slots=True)
class FetchOne:
    """Run ``query``; answers its first row as a dict, or None."""

    query: Query
    params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class FetchAll:
    """Run ``query``; answers every row as a dict."""

    query: Query
    params: Mapping[str, Any]


# One frozen dataclass per step (alike by shape): each is its own step type, data only.
@dataclass(frozen=True, slots=True)
class Execute:
    """Run ``query``; answers the number of rows it touched."""

    query: Query
    params: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Transaction:
    """Run ``body``'s steps on one connection, in one transaction; answers its return value.

    Committed when ``body`` returns, rolled back when it raises (the error is then
    thrown into the outer generator). On a connector already inside the caller's
    transaction this is a savepoint.
    """

    body: Generator[Step, Any, Any]


@dataclass(frozen=True, slots=True)
class Pooled:
    """Answers whether each statement runs on a pooled connection of its own (autocommit).

    True: a statement that failed with a lost connection may be repeated at once on a
    fresh one. False: the connector is the caller's (one transaction), which a lost
    connection has aborted: nothing can be repeated there.
    """


@dataclass(frozen=True, slots=True)
class AfterCommit:
    """Call ``fn()`` once the current transaction commits (at once in autocommit); never on a
    rollback. Answers None. An error in ``fn`` is logged, never raised."""

    fn: Callable[[], object]


@dataclass(frozen=True, slots=True)
class Using:
    """Run ``body``'s steps on ``connector`` instead (e.g. the caller's connection, in its
    transaction); answers its return value. A SQLAlchemy ``Connection`` is taken as a
    :class:`SQLAlchemyConnector`. A sync connector cannot serve an async runner."""

    connector: Any
    body: Generator[Step, Any, Any]


@dataclass(frozen=True, slots=True)
class ShardCount:
    """Answers how many databases the connector spans: 1, or its shards when the database
    is split by workspace (:class:`~onceflow.connector.ShardedConnector`)."""


@dataclass(frozen=True, slots=True)
class OnShard:
    """Run ``body``'s steps on shard ``index`` (0 … ShardCount-1) only; answers its return
    value. On a connector of one database, index 0 is the connector itself. For operations
    over every workspace (claims by worker class, counts, sweeps), which run per shard."""

    index: int
    body: Generator[Step, Any, Any]


@dataclass(frozen=True, slots=True)
class ShardGroups:
    """Answers the shard index of each of ``workspace_ids`` (all 0 on one database): an
    operation over many workspaces (a batch, an enqueue of many) runs once per shard."""

    workspace_ids: tuple[str, ...]


Step: TypeAlias = (
    FetchOne
    | FetchAll
    | Execute
    | Transaction
    | Sleep
    | Pooled
    | AfterCommit
    | Using
    | Call
    | ShardCount
    | OnShard
    | ShardGroups
)
#: What an operation is: a generator of steps whose return value is the operation's result.
Steps: TypeAlias = Generator[Step, Any, R]


def one_row(query: Query, params: Mapping[str, Any]) -> Steps[Any]:
    """``row = yield from one_row(q, p)``: the statement's first row, or None."""
    row = yield FetchOne(query, params)
    return row


def all_rows(query: Query, params: Mapping[str, Any]) -> Steps[list[Any]]:
    """``rows = yield from all_rows(q, p)``: every row of the statement."""
    rows: list[Any] = yield FetchAll(query, params)
    return rows


def on_every_shard(make: Callable[[], Steps[R]]) -> Steps[list[R]]:
    """``make()``'s steps run once per shard (once on a database of one), answers in shard
    order: the reads over every workspace (counts, lists, depth) of a database split by
    workspace."""
    count: int = yield ShardCount()
    out: list[R] = []
    for index in range(count):
        answer: R = yield OnShard(index, make())
        out.append(answer)
    return out


def retrying(make: Callable[[], Steps[R]]) -> Steps[R]:
    """``make()``'s steps, run once more on a fresh connection if a connection was lost.

    For operations safe to run twice (reads; writes whose ids were minted before the
    first attempt; fenced writes): see :func:`onceflow.db.retry_disconnect`, whose
    rule this is. Not repeated on a caller's connection (:class:`Pooled`).
    """
    try:
        return (yield from make())
    except Exception as exc:
        if not is_disconnect(exc) or not (yield Pooled()):
            raise
        log.info("retrying once on a fresh connection after: %s", exc)
    return (yield from make())


# ------------------------------------------------------------------ connectors


class Connector(Protocol):
    """Runs statements synchronously (see :func:`run`)."""

    #: Whether each statement runs on a pooled connection of its own (see :class:`Pooled`).
    pooled: bool

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any: ...

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]: ...

    def execute(self, query: Query, params: Mapping[str, Any]) -> int: ...

    def transaction(self) -> AbstractContextManager[Connector]: ...

    def after_commit(self, fn: Callable[[], object]) -> None: ...


class AsyncConnector(Protocol):
    """Runs statements on an event loop (see :func:`arun`)."""

    pooled: bool

    async def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any: ...

    async def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]: ...

    async def execute(self, query: Query, params: Mapping[str, Any]) -> int: ...

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnector]: ...

    def after_commit(self, fn: Callable[[], object]) -> None: ...


def _call_safely(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        log.exception("an after-commit callback failed")
