"""Sync connectors: the process's pooled psycopg connections, and the caller's own
connection (SQLAlchemy, or an executor of SQL) inside the caller's transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, event

from onceflow.connector.steps import Connector, Query, _call_safely
from onceflow.db import (
    all_as_dicts,
    execute,
    fetch_all,
    fetch_one,
    one_as_dict,
    raw_connection,
    rowcount,
    run_statement,
    translate_errors,
)


class _OnOneConnection:
    """Statements on one psycopg connection (inside a transaction the runner opened)."""

    pooled = False

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.raw = raw
        self.callbacks: list[Callable[[], object]] = []

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return fetch_one(self.raw, query.sql_for(params), dict(params))

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return fetch_all(self.raw, query.sql_for(params), dict(params))

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return execute(self.raw, query.sql_for(params), dict(params))

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        # Nested: a savepoint, with its own after-commit list, kept only if it is released
        # (a rolled-back savepoint's writes are gone: so are their callbacks).
        inner = _OnOneConnection(self.raw)
        with self.raw.transaction():
            yield inner
        self.callbacks.extend(inner.callbacks)

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
        return run_statement(self.engine, query.sql_for(params), dict(params), one_as_dict)

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        rows: list[Any] = run_statement(
            self.engine, query.sql_for(params), dict(params), all_as_dicts
        )
        return rows

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        count: int = run_statement(self.engine, query.sql_for(params), dict(params), rowcount)
        return count

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
            result = self.connection.exec_driver_sql(query.sql_for(params), dict(params))
            return [dict(r) for r in result.mappings()] if result.returns_rows else []

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        rows = self._rows(query, params)
        return rows[0] if rows else None

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self._rows(query, params)

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        with translate_errors(self.connection.engine.url):
            result = self.connection.exec_driver_sql(query.sql_for(params), dict(params))
            return int(result.rowcount)

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        # A savepoint; what it registers after commit is kept only if it is released (a
        # rolled-back savepoint fires no "rollback" event, and its rows are gone).
        inner = _SavepointCallbacks(self)
        with translate_errors(self.connection.engine.url), self.connection.begin_nested():
            yield inner
        for fn in inner.callbacks:
            self.after_commit(fn)

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


class _SavepointCallbacks:
    """A SQLAlchemy savepoint's view of its connector: statements as the connector runs them,
    after-commit callbacks held until the savepoint is released."""

    pooled = False

    def __init__(self, outer: SQLAlchemyConnector) -> None:
        self.outer = outer
        self.callbacks: list[Callable[[], object]] = []

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        return self.outer.fetch_one(query, params)

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self.outer.fetch_all(query, params)

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return self.outer.execute(query, params)

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        inner = _SavepointCallbacks(self.outer)
        connection = self.outer.connection
        with translate_errors(connection.engine.url), connection.begin_nested():
            yield inner
        self.callbacks.extend(inner.callbacks)

    def after_commit(self, fn: Callable[[], object]) -> None:
        self.callbacks.append(fn)


class ExecutorConnector:
    """A caller's executor of SQL, ``execute(sql, params) -> rows as mappings``, in its
    transaction (what :meth:`onceflow.Queue.enqueue_many_with` takes). No savepoints:
    a :class:`Transaction` runs its steps as they are; :class:`AfterCommit` is the
    caller's to do (``on_commit``), so it is dropped here."""

    pooled = False

    def __init__(self, execute: Callable[[str, dict[str, Any]], Any]) -> None:
        self._execute = execute

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        rows = list(self._execute(query.sql_for(params), dict(params)))
        return rows[0] if rows else None

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return list(self._execute(query.sql_for(params), dict(params)))

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return len(list(self._execute(query.sql_for(params), dict(params)) or ()))

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        yield self

    def after_commit(self, fn: Callable[[], object]) -> None:
        pass
