"""A connection for a call: the thread's held one, or a pool checkout for the call alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import Engine

from onceflow.db.disconnect import drop_dead_connection
from onceflow.db.held import held_for, on_held, run_on_held
from onceflow.db.statements import lend_cursor, run, take_cursor_back
from onceflow.db.translate import translate_errors
from onceflow.errors import DatabaseUnavailable
from onceflow.settings import get_settings


@contextmanager
def raw_connection(engine: Engine) -> Iterator[psycopg.Connection[Any]]:
    """A pooled psycopg connection in autocommit mode, for the hot paths.

    SQLAlchemy keeps the pool; the statements go straight to psycopg (its
    automatic prepared statements, no result-metadata work). Each statement
    commits on its own; wrap several in ``conn.transaction()``. The checkout is the
    pool's own (``engine.raw_connection()``), without a SQLAlchemy ``Connection``
    around it: that wrapper costs a stage's two statements a noticeable share of a worker
    child's CPU, and nothing here uses it. A thread inside
    :func:`~onceflow.db.holding_connections` keeps its checkout between calls instead.
    """
    held = held_for(engine)
    if held is not None:
        with on_held(engine, held) as conn:
            yield conn
        return
    with translate_errors(engine.url):
        fairy = engine.raw_connection()
        try:
            raw = fairy.driver_connection
            assert raw is not None  # noqa: S101 - a live checkout always has one
            raw.autocommit = True
            lend_cursor(raw)
            try:
                yield raw
            except BaseException as exc:
                if raw.broken or raw.closed:
                    lost = drop_dead_connection(engine, fairy, exc)
                    if lost is not None:
                        raise lost from exc
                raise
            finally:
                take_cursor_back(raw)
                if not raw.closed:
                    raw.autocommit = False  # what SQLAlchemy's pool expects back
        finally:
            fairy.close()  # back to the pool (an invalidated one is discarded)


@contextmanager
def bounded_read(engine: Engine, seconds: float | None = None) -> Iterator[psycopg.Connection[Any]]:
    """A connection as :func:`raw_connection`, in one transaction whose statements each stop
    after ``seconds`` (``SET LOCAL statement_timeout``; the settings'
    ``dashboard_query_timeout_seconds`` by default): a read a caller shapes (the dashboard's
    search, series and request page) never runs on unbounded. A statement stopped by it
    raises :class:`DatabaseUnavailable` saying so (an HTTP 503)."""
    if seconds is None:
        seconds = get_settings().dashboard_query_timeout_seconds
    limit_ms = max(1, int(seconds * 1000))
    with raw_connection(engine) as raw, raw.transaction():
        raw.execute("SELECT set_config('statement_timeout', %s, true)", [f"{limit_ms}ms"])
        try:
            yield raw
        except Exception as exc:
            if isinstance(exc, psycopg.errors.QueryCanceled) or isinstance(
                exc.__cause__, psycopg.errors.QueryCanceled
            ):
                raise DatabaseUnavailable(
                    f"the query ran past its {seconds:g} s limit and was stopped: narrow it "
                    "(a workspace, a job or a time range) or try again"
                ) from exc
            raise


def run_statement(
    engine: Engine,
    query: str,
    params: dict[str, Any],
    take: Callable[[psycopg.Cursor[Any], str], Any],
) -> Any:
    """``take(cursor, query)`` after ``query`` ran on a connection of ``engine``'s: what
    ``with raw_connection(engine) as raw: run(raw, ...)`` does, without its three context
    managers on a held connection (a stage's statements, the hottest path)."""
    held = held_for(engine)
    if held is None:
        with raw_connection(engine) as raw:
            return run(raw, query, params, take)
    return run_on_held(engine, held, query, params, take)
