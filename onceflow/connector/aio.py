"""The async connector: psycopg's async connections, pooled per event loop (psycopg_pool)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import URL

from onceflow.connector.steps import AsyncConnector, Query, _call_safely
from onceflow.db import (
    REUSED_CURSOR,
    check_database_url,
    is_large,
    named_row,
    named_rows,
    translate_errors,
)
from onceflow.errors import ConnectionLost
from onceflow.loops import PerLoop
from onceflow.payloads import load_stored_json
from onceflow.settings import get_settings

log = logging.getLogger("onceflow.db")


def conninfo(url: str | URL) -> str:
    """A libpq connection string for a database URL (any spelling onceflow accepts)."""
    parsed = check_database_url(str(url) if isinstance(url, URL) else url)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncPsycopgConnector:
    """psycopg's async connections, pooled per event loop and per process (psycopg_pool).

    Nothing connects until the first statement. A statement that meets a dead
    connection raises :class:`~onceflow.errors.ConnectionLost` after asking the pool to
    check its idle connections, so a retry gets a live one (what the sync pool's
    invalidation does). A server that refuses connections fails the caller at once with
    :class:`~onceflow.errors.DatabaseUnavailable` naming the cause, as the sync side does;
    a server that is reachable but slow gets the pool's ``timeout``.

    :meth:`aclose`, awaited on the loop, closes that loop's pool: the clean way. A pool
    whose loop closed without it (``asyncio.run`` per call) is dropped the next time
    another loop makes its pool, its idle connections' sockets closed then.
    """

    pooled = True

    def __init__(
        self, url: str | URL | None = None, *, max_size: int | None = None, timeout: float = 10.0
    ) -> None:
        self.url = str(url) if url is not None else get_settings().database_url
        self._conninfo = conninfo(self.url)
        # As many connections as the sync engine may open (pool_size + as many overflow).
        default = max(4, 2 * get_settings().pool_size)
        self._max_size = max_size if max_size is not None else default
        self._timeout = timeout
        self._pools: PerLoop[_LoopPool] = PerLoop(_LoopPool.discard)

    async def _pool(self) -> _LoopPool:
        entry = self._pools.get()
        if entry is None:
            entry = self._pools.setdefault(self._new_pool)
        if entry.opened is None:
            entry.opened = asyncio.ensure_future(entry.pool.open(wait=False))
        if not entry.opened.done():
            with translate_errors(self.url):
                await asyncio.shield(entry.opened)
        return entry

    def _new_pool(self) -> _LoopPool:
        from psycopg_pool import AsyncConnectionPool

        entry = _LoopPool()
        entry.pool = AsyncConnectionPool(
            self._conninfo,
            connection_class=entry.connection_class(),
            min_size=0,
            max_size=self._max_size,
            open=False,
            timeout=self._timeout,
            kwargs={"autocommit": True, "connect_timeout": _CONNECT_TIMEOUT},
            configure=_configure_async,
            name="onceflow",
        )
        return entry

    @asynccontextmanager
    async def _connection(self, entry: _LoopPool) -> AsyncIterator[Any]:
        """A pooled connection (what ``pool.connection()`` does), or the cause of a refusal.

        With an idle connection at hand nothing else happens. Otherwise the wait for
        one races the pool's connection attempts: one that fails (or a failure already
        seen, with nothing idle) sends one direct connection attempt to the server, whose
        error (refused, unknown host, bad password) is raised at once; if it connects,
        the server is back and the caller uses that connection.
        """
        pool = entry.pool
        conn, direct = await self._getconn(entry)
        try:
            async with conn:
                yield conn
        finally:
            if direct:
                with contextlib.suppress(Exception):
                    await conn.close()
            else:
                await pool.putconn(conn)

    async def _getconn(self, entry: _LoopPool) -> tuple[Any, bool]:
        pool = entry.pool
        if pool.get_stats().get("pool_available", 0):
            return await pool.getconn(), False
        if entry.failure is not None:
            return await self._direct(entry), True
        get = asyncio.ensure_future(pool.getconn())
        failed = asyncio.ensure_future(entry.failed.wait())
        try:
            await asyncio.wait((get, failed), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            _abandon(pool, get)
            raise
        finally:
            failed.cancel()
        if get.done():
            return get.result(), False
        _abandon(pool, get)  # a connection attempt failed: ask the server directly
        return await self._direct(entry), True

    async def _direct(self, entry: _LoopPool) -> Any:
        """One connection made here, not by the pool: its error is the outage's cause."""
        with self._translate():  # refused, unknown host...: DatabaseUnavailable naming it
            conn = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, connect_timeout=_CONNECT_TIMEOUT
            )
        entry.connected()  # the server answers again: the pool's next wait is a plain one
        await _configure_async(conn)
        return conn

    @functools.cached_property
    def _translate(self) -> Callable[[], AbstractContextManager[None]]:
        return functools.partial(translate_errors, self.url)

    async def _run(
        self, query: Query, params: Mapping[str, Any], how: str, conn: Any = None
    ) -> Any:
        if conn is not None:
            return await _on_async(conn, query, params, how, self._translate)
        entry = await self._pool()
        with self._translate():
            async with self._connection(entry) as conn:
                try:
                    return await _on_async(conn, query, params, how, self._translate, reuse=True)
                except Exception as exc:
                    if conn.broken or conn.closed:
                        raise await self._lost(entry.pool, exc) from exc
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
        entry = await self._pool()
        with self._translate():
            async with self._connection(entry) as conn:
                bound = _AsyncOnOneConnection(conn, self._translate)
                try:
                    async with conn.transaction():
                        yield bound
                except Exception as exc:
                    if conn.broken or conn.closed:
                        raise await self._lost(entry.pool, exc) from exc
                    raise
        for fn in bound.callbacks:
            _call_safely(fn)

    def after_commit(self, fn: Callable[[], object]) -> None:
        _call_safely(fn)

    async def aclose(self) -> None:
        """Close this event loop's pool: the clean way, awaited on the loop that used it.

        Other loops' pools stay open (each is closed by its own loop); those whose loop
        has closed are dropped here too, their idle connections' sockets closed.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - called outside a loop
            return
        entry = self._pools.pop()
        if entry is not None:
            await entry.pool.close()


#: Seconds a connection attempt may take (the pool's and the direct one's).
_CONNECT_TIMEOUT = 10


class _LoopPool:
    """One loop's pool, and what its last connection attempt said."""

    pool: Any
    opened: asyncio.Future[None] | None = None

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()

    def connection_class(self) -> type[psycopg.AsyncConnection[Any]]:
        """The pool's connection class: psycopg's, telling this entry how each attempt went."""
        entry = self

        class _Watched(psycopg.AsyncConnection):
            @classmethod
            async def connect(cls, *args: Any, **kwargs: Any) -> Any:
                try:
                    conn = await super().connect(*args, **kwargs)
                except Exception as exc:
                    entry.failure = exc
                    entry.failed.set()
                    raise
                entry.connected()
                return conn

        return _Watched

    def connected(self) -> None:
        self.failure = None
        self.failed.clear()

    def discard(self) -> None:
        """Close the sockets of a pool whose loop has closed (no loop needed: libpq's own)."""
        for conn in list(getattr(self.pool, "_pool", ())):
            conn.pgconn.finish()


_returning: set[asyncio.Future[None]] = set()


def _abandon(pool: Any, get: asyncio.Future[Any]) -> None:
    """Give up a pending ``getconn``: a connection it gets anyway goes back to the pool."""

    def give_back(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            task = asyncio.ensure_future(pool.putconn(done.result()))
            _returning.add(task)
            task.add_done_callback(_returning.discard)
        elif not done.cancelled():
            done.exception()  # retrieved: a timed-out wait nobody awaits is no error

    get.cancel()
    get.add_done_callback(give_back)


async def _configure_async(conn: psycopg.AsyncConnection[Any]) -> None:
    # What SQLAlchemy's dialect does for the sync pool: a stored value too deep to serve
    # comes back as a placeholder instead of failing the read.
    psycopg.types.json.set_json_loads(load_stored_json, conn)
    # The reusable cursor of a connection of onceflow's pool (as onceflow.db's for the sync
    # pool; tuple rows, made dicts with onceflow.db.column_names): a caller's own connection
    # never gets one.
    setattr(conn, REUSED_CURSOR, conn.cursor(row_factory=tuple_row))


async def _on_async(
    conn: psycopg.AsyncConnection[Any],
    query: Query,
    params: Mapping[str, Any],
    how: str,
    translate: Callable[[], AbstractContextManager[None]],
    *,
    reuse: bool = False,
) -> Any:
    """One statement. ``reuse``: on the connection's reusable cursor — only for a statement
    that has the connection to itself (not inside a transaction, whose statements a caller
    may run concurrently with ``asyncio.gather``: they would share the cursor)."""
    with translate():
        kept: psycopg.AsyncCursor[Any] | None = (
            getattr(conn, REUSED_CURSOR, None) if reuse else None
        )
        if kept is None or kept.closed:
            async with conn.cursor(row_factory=tuple_row) as cur:
                return await _results(cur, query, params, how)
        try:
            return await _results(kept, query, params, how)
        finally:  # a large result is not kept with the idle connection, whatever happened
            if kept.pgresult is not None and is_large(kept.pgresult):
                await kept.close()
                setattr(conn, REUSED_CURSOR, conn.cursor(row_factory=tuple_row))


async def _results(
    cur: psycopg.AsyncCursor[Any], query: Query, params: Mapping[str, Any], how: str
) -> Any:
    sql = query.sql_for(params)
    await cur.execute(sql, dict(params))
    if how == "one":
        return named_row(cur, sql, await cur.fetchone() if cur.description else None)
    if how == "all":
        return named_rows(cur, sql, await cur.fetchall() if cur.description else [])
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
        # A savepoint with its own after-commit list, kept only if it is released.
        inner = _AsyncOnOneConnection(self.conn, self._translate)
        async with self.conn.transaction():
            yield inner
        self.callbacks.extend(inner.callbacks)

    def after_commit(self, fn: Callable[[], object]) -> None:
        self.callbacks.append(fn)
