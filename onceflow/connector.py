"""One seam between onceflow's layers and a database: named statements, sync or async.

Each layer writes an operation once, as a generator of *steps* (Procrastinate's
named queries, River's driver seam, the sans-I/O pattern)::

    @operation
    def get(self, request_id: str) -> Steps[Request]:
        row = yield FetchOne(sql.GET, {"request_id": request_id})
        ...

and a *connector* runs the steps: :class:`PsycopgConnector` on the process's
pooled connections, :class:`AsyncPsycopgConnector` on a psycopg async pool,
:class:`SQLAlchemyConnector` and the Django integration's connector on the
caller's own connection, inside the caller's transaction. :class:`operation`
turns the one generator into a plain method on a sync object
(:class:`SyncSide`, e.g. :class:`~onceflow.Queue`) and a coroutine method on an
async one (:class:`AsyncSide`, e.g. :class:`~onceflow.AsyncQueue`): one
signature, one body, the same semantics on both.

A step's answer is sent back into the generator; a step's error is thrown into
it at the ``yield``, so ``try``/``except`` around a ``yield`` handles a failed
statement as it would a direct call. Every error is onceflow's own
(:func:`onceflow.db.translate_errors`): :class:`~onceflow.errors.ConnectionLost`
for a connection lost under a statement, :class:`~onceflow.errors.DatabaseUnavailable`
for a server that cannot be reached.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterator,
    Mapping,
)
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeAlias, TypeVar, overload

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import URL, Connection, Engine, TextClause, event

from onceflow.db import (
    check_database_url,
    fetch_all,
    fetch_one,
    is_disconnect,
    raw_connection,
    render,
    translate_errors,
)
from onceflow.errors import ConnectionLost
from onceflow.payloads import load_stored_json
from onceflow.settings import get_settings

log = logging.getLogger("onceflow.db")

P = ParamSpec("P")
R = TypeVar("R")


# ------------------------------------------------------------------ statements and steps


@dataclass(frozen=True, slots=True)
class Query:
    """A named statement, written for psycopg (``%(name)s`` placeholders; lists bind as arrays).

    ``name`` is how logs, traces and benchmarks count it (``queue.claim``, ``oplog.apply``).
    """

    name: str
    sql: str

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
class Sleep:
    """Wait ``seconds`` (``time.sleep`` or ``asyncio.sleep``); answers None."""

    seconds: float


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
class Call:
    """Call a caller's callback ``fn(*args)`` that may do I/O (a broker publish); answers
    its return value, and its error is thrown into the generator like a statement's.

    A sync runner calls it at once (an awaitable answer is refused: nothing could await
    it). An async runner awaits it when it is a coroutine function (or answers an
    awaitable), else runs it in a worker thread (``asyncio.to_thread``), so a blocking
    callback never stalls the event loop; either way the operation goes on only once
    it has returned.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


Step: TypeAlias = (
    FetchOne | FetchAll | Execute | Transaction | Sleep | Pooled | AfterCommit | Using | Call
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


class _OnOneConnection:
    """Statements on one psycopg connection (inside a transaction the runner opened)."""

    pooled = False

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.callbacks: list[Callable[[], object]] = []

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return fetch_one(self.raw, query.sql, dict(params))

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return fetch_all(self.raw, query.sql, dict(params))

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return self.raw.execute(query.sql, dict(params)).rowcount

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        with self.raw.transaction():  # nested: a savepoint
            yield self

    def after_commit(self, fn: Callable[[], object]) -> None:
        self.callbacks.append(fn)


def on_connection(raw: psycopg.Connection[Any]) -> Connector:
    """A connector on one psycopg connection the caller holds (and whose transaction it owns)."""
    return _OnOneConnection(raw)


class PsycopgConnector:
    """The process's pooled psycopg connections (SQLAlchemy keeps the pool): one checkout per
    statement in autocommit, one per :class:`Transaction`. See :func:`onceflow.db.raw_connection`
    for what a lost connection does to the pool."""

    pooled = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        with raw_connection(self.engine) as raw:
            return fetch_one(raw, query.sql, dict(params))

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        with raw_connection(self.engine) as raw:
            return fetch_all(raw, query.sql, dict(params))

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        with raw_connection(self.engine) as raw:
            return raw.execute(query.sql, dict(params)).rowcount

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        with raw_connection(self.engine) as raw:
            bound = _OnOneConnection(raw)
            with raw.transaction():
                yield bound
        for fn in bound.callbacks:  # committed: the with-block above did not raise
            _call_safely(fn)

    def after_commit(self, fn: Callable[[], object]) -> None:
        _call_safely(fn)  # every statement here commits on its own


class SQLAlchemyConnector:
    """The caller's SQLAlchemy connection: statements run inside the caller's transaction.

    Nothing commits here. :class:`Transaction` is a savepoint; :class:`AfterCommit`
    runs on the connection's ``commit`` event (dropped on a rollback).
    """

    pooled = False

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def _rows(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        with translate_errors(self.connection.engine.url):
            result = self.connection.exec_driver_sql(query.sql, dict(params))
            return [dict(r) for r in result.mappings()] if result.returns_rows else []

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        rows = self._rows(query, params)
        return rows[0] if rows else None

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self._rows(query, params)

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        with translate_errors(self.connection.engine.url):
            return int(self.connection.exec_driver_sql(query.sql, dict(params)).rowcount)

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        with translate_errors(self.connection.engine.url), self.connection.begin_nested():
            yield self

    def after_commit(self, fn: Callable[[], object]) -> None:
        conn = self.connection
        done = False

        def on_commit(_conn: Connection) -> None:
            nonlocal done
            if not done:
                done = True
                _call_safely(fn)

        def on_rollback(_conn: Connection) -> None:
            nonlocal done
            done = True  # never counted: the rows are gone

        event.listen(conn, "commit", on_commit, once=True)
        event.listen(conn, "rollback", on_rollback, once=True)


class ExecutorConnector:
    """A caller's executor of SQL, ``execute(sql, params) -> rows as mappings``, in its
    transaction (what :meth:`onceflow.Queue.enqueue_many_with` takes). No savepoints:
    a :class:`Transaction` runs its steps as they are; :class:`AfterCommit` is the
    caller's to do (``on_commit``), so it is dropped here."""

    pooled = False

    def __init__(self, execute: Callable[[str, dict[str, Any]], Any]) -> None:
        self._execute = execute

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        rows = list(self._execute(query.sql, dict(params)))
        return rows[0] if rows else None

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return list(self._execute(query.sql, dict(params)))

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return len(list(self._execute(query.sql, dict(params)) or ()))

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        yield self

    def after_commit(self, fn: Callable[[], object]) -> None:
        pass


def conninfo(url: str | URL) -> str:
    """A libpq connection string for a database URL (any spelling onceflow accepts)."""
    parsed = check_database_url(str(url) if isinstance(url, URL) else url)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncPsycopgConnector:
    """psycopg's async connections, pooled per event loop and per process (psycopg_pool).

    Nothing connects until the first statement. A statement that meets a dead
    connection raises :class:`~onceflow.errors.ConnectionLost` after asking the pool to
    check its idle connections, so a retry gets a live one (what the sync pool's
    invalidation does). :meth:`aclose` closes this loop's pool.
    """

    pooled = True

    def __init__(
        self, url: str | URL | None = None, *, max_size: int | None = None, timeout: float = 10.0
    ) -> None:
        self.url = str(url) if url is not None else get_settings().database_url
        self._conninfo = conninfo(self.url)
        self._max_size = max_size if max_size is not None else max(4, get_settings().pool_size)
        self._timeout = timeout
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[int, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    async def _pool(self) -> Any:
        from psycopg_pool import AsyncConnectionPool

        loop = asyncio.get_running_loop()
        entry = self._pools.get(loop)
        if entry is not None and entry[0] == os.getpid():
            return entry[1]
        pool = AsyncConnectionPool(
            self._conninfo,
            min_size=0,
            max_size=self._max_size,
            open=False,
            timeout=self._timeout,
            kwargs={"autocommit": True, "connect_timeout": 10},
            configure=_configure_async,
            name="onceflow",
        )
        with self._lock:
            entry = self._pools.get(loop)
            if entry is not None and entry[0] == os.getpid():
                return entry[1]
            self._pools[loop] = (os.getpid(), pool)
        with translate_errors(self.url):
            await pool.open(wait=False)
        return pool

    @functools.cached_property
    def _translate(self) -> Callable[[], AbstractContextManager[None]]:
        return functools.partial(translate_errors, self.url)

    async def _run(
        self, query: Query, params: Mapping[str, Any], how: str, conn: Any = None
    ) -> Any:
        if conn is not None:
            return await _on_async(conn, query, params, how, self._translate)
        pool = await self._pool()
        with self._translate():
            async with pool.connection() as conn:
                try:
                    return await _on_async(conn, query, params, how, self._translate)
                except Exception as exc:
                    if conn.broken or conn.closed:
                        raise await self._lost(pool, exc) from exc
                    raise

    async def _lost(self, pool: Any, exc: BaseException) -> BaseException:
        if isinstance(exc, ConnectionLost):
            return exc
        try:
            await pool.check()  # drop every idle connection the outage killed too
        except Exception:  # pragma: no cover - best effort; the pool also checks on return
            log.debug("pool check failed", exc_info=True)
        return ConnectionLost(f"Postgres connection lost: {str(exc).strip().splitlines()[0]}")

    async def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return await self._run(query, params, "one")

    async def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        rows: list[Any] = await self._run(query, params, "all")
        return rows

    async def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        count: int = await self._run(query, params, "count")
        return count

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnector]:
        return self._transaction()

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnector]:
        pool = await self._pool()
        with self._translate():
            async with pool.connection() as conn:
                bound = _AsyncOnOneConnection(conn, self._translate)
                try:
                    async with conn.transaction():
                        yield bound
                except Exception as exc:
                    if conn.broken or conn.closed:
                        raise await self._lost(pool, exc) from exc
                    raise
        for fn in bound.callbacks:
            _call_safely(fn)

    def after_commit(self, fn: Callable[[], object]) -> None:
        _call_safely(fn)

    async def aclose(self) -> None:
        """Close this event loop's pool (others stay open; each is closed by its own loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - called outside a loop
            return
        entry = self._pools.pop(loop, None)
        if entry is not None and entry[0] == os.getpid():
            await entry[1].close()


async def _configure_async(conn: psycopg.AsyncConnection[Any]) -> None:
    # What SQLAlchemy's dialect does for the sync pool: a stored value too deep to serve
    # comes back as a placeholder instead of failing the read.
    psycopg.types.json.set_json_loads(load_stored_json, conn)


async def _on_async(
    conn: psycopg.AsyncConnection[Any],
    query: Query,
    params: Mapping[str, Any],
    how: str,
    translate: Callable[[], AbstractContextManager[None]],
) -> Any:
    with translate():
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(query.sql, dict(params))
            if how == "one":
                return await cur.fetchone() if cur.description else None
            if how == "all":
                return await cur.fetchall() if cur.description else []
            return cur.rowcount


class _AsyncOnOneConnection:
    pooled = False

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        translate: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.conn = conn
        self._translate = translate
        self.callbacks: list[Callable[[], object]] = []

    async def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return await _on_async(self.conn, query, params, "one", self._translate)

    async def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        rows: list[Any] = await _on_async(self.conn, query, params, "all", self._translate)
        return rows

    async def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        count: int = await _on_async(self.conn, query, params, "count", self._translate)
        return count

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnector]:
        return self._savepoint()

    @asynccontextmanager
    async def _savepoint(self) -> AsyncIterator[AsyncConnector]:
        async with self.conn.transaction():
            yield self

    def after_commit(self, fn: Callable[[], object]) -> None:
        self.callbacks.append(fn)


# ------------------------------------------------------------------ runners


def run(connector: Connector, steps: Steps[R]) -> R:
    """Drive ``steps`` to their result on a sync connector."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as stop:
            result: R = stop.value
            return result
        answer, error = None, None
        try:
            answer = _do(connector, step)
        except Exception as exc:
            error = exc


def _do(c: Connector, step: Step) -> Any:
    if isinstance(step, FetchOne):
        return c.fetch_one(step.query, step.params)
    if isinstance(step, FetchAll):
        return c.fetch_all(step.query, step.params)
    if isinstance(step, Execute):
        return c.execute(step.query, step.params)
    if isinstance(step, Transaction):
        with c.transaction() as tx:
            return run(tx, step.body)
    if isinstance(step, Sleep):
        time.sleep(step.seconds)
        return None
    if isinstance(step, Pooled):
        return c.pooled
    if isinstance(step, AfterCommit):
        c.after_commit(step.fn)
        return None
    if isinstance(step, Using):
        other = step.connector
        if isinstance(other, Connection):
            other = SQLAlchemyConnector(other)
        return run(other, step.body)
    if isinstance(step, Call):
        answer = step.fn(*step.args)
        if inspect.isawaitable(answer):
            if inspect.iscoroutine(answer):
                answer.close()
            raise TypeError(f"{step.fn!r} is async: call it through the asyncio API")
        return answer
    raise TypeError(f"not a step: {step!r}")


async def arun(connector: AsyncConnector, steps: Steps[R]) -> R:
    """Drive ``steps`` to their result on an async connector."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as stop:
            result: R = stop.value
            return result
        answer, error = None, None
        try:
            answer = await _ado(connector, step)
        except Exception as exc:
            error = exc


async def _ado(c: AsyncConnector, step: Step) -> Any:
    if isinstance(step, FetchOne):
        return await c.fetch_one(step.query, step.params)
    if isinstance(step, FetchAll):
        return await c.fetch_all(step.query, step.params)
    if isinstance(step, Execute):
        return await c.execute(step.query, step.params)
    if isinstance(step, Transaction):
        async with c.transaction() as tx:
            return await arun(tx, step.body)
    if isinstance(step, Sleep):
        await asyncio.sleep(step.seconds)
        return None
    if isinstance(step, Pooled):
        return c.pooled
    if isinstance(step, AfterCommit):
        c.after_commit(step.fn)
        return None
    if isinstance(step, Using):
        if not inspect.iscoroutinefunction(getattr(step.connector, "fetch_one", None)):
            raise TypeError(
                f"an async operation needs an async connector, not {type(step.connector).__name__}"
            )
        return await arun(step.connector, step.body)
    if isinstance(step, Call):
        if inspect.iscoroutinefunction(step.fn):
            return await step.fn(*step.args)
        answer = await asyncio.to_thread(step.fn, *step.args)
        return (await answer) if inspect.isawaitable(answer) else answer
    raise TypeError(f"not a step: {step!r}")


# ------------------------------------------------------------------ one body, two APIs


class SyncSide:
    """An object whose :class:`operation` methods run at once on :attr:`connector`."""

    connector: Connector


class AsyncSide:
    """An object whose :class:`operation` methods are coroutines on :attr:`aconnector`."""

    aconnector: AsyncConnector


class operation(Generic[P, R]):
    """Turns a generator of steps into a method: plain on a :class:`SyncSide`, a coroutine on
    an :class:`AsyncSide`. ``steps`` is the generator function itself, for composing
    operations (``yield from Core.get.steps(self, ...)``)."""

    def __init__(self, fn: Callable[Concatenate[Any, P], Steps[R]]) -> None:
        self.steps = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> operation[P, R]: ...

    @overload
    def __get__(self, obj: AsyncSide, owner: type) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(self, obj: SyncSide, owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: object, owner: type) -> Any:
        if obj is None:
            return self
        fn = self.steps
        bound: Callable[..., Any]
        if isinstance(obj, AsyncSide):
            target = obj

            async def abound(*args: Any, **kwargs: Any) -> Any:
                return await arun(target.aconnector, fn(target, *args, **kwargs))

            bound = abound
        elif isinstance(obj, SyncSide):
            sync_target = obj

            def sbound(*args: Any, **kwargs: Any) -> Any:
                return run(sync_target.connector, fn(sync_target, *args, **kwargs))

            bound = sbound
        else:
            raise TypeError(f"{type(obj).__name__} is neither a SyncSide nor an AsyncSide")
        functools.update_wrapper(bound, fn)
        obj.__dict__[self.name] = bound  # once per instance: later lookups skip __get__
        return bound
