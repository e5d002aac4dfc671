"""The async connector: psycopg's async connections, pooled per event loop (psycopg_pool)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import URL

from onceflow.connector.steps import AsyncConnector, Query, _call_safely
from onceflow.db import check_database_url, translate_errors
from onceflow.errors import ConnectionLost
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
    invalidation does). :meth:`aclose` closes this loop's pool.
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
