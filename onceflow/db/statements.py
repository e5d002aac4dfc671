"""Statements on a psycopg connection: rendered once, run on a reused cursor, rows as dicts.

While onceflow has a connection checked out (raw_connection: a pooled call, or a thread's
hold), its statements run on one dict-row cursor the connection keeps (REUSED_CURSOR). A
new cursor per statement built a fresh adapters map and looked every column's loader up
again, about a tenth of the client CPU of a claim + completion.
The cursor is lent at onceflow's checkout and taken back before the connection returns
to the pool (kept aside under _IDLE_CURSOR for onceflow's next checkout): whoever gets
the connection from the pool next (a SQLAlchemy Connection, a caller's raw checkout it
hands to onceflow.connector.on_connection and may share between its threads, which
psycopg allows for connections and not for cursors) sees no cursor and uses its own.
A statement whose result is large (more than one row with a JSON column, or more than
KEEP_ROWS rows) leaves its cursor closed and a fresh one in its place, so a large result
is never kept in memory with an idle connection or across a stage's body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import TextClause
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

_DIALECT = pg_psycopg.dialect()  # type: ignore[no-untyped-call]


def render(clause: TextClause) -> str:
    """A text() statement rendered once for psycopg (``%(name)s`` placeholders)."""
    return str(clause.compile(dialect=_DIALECT))


REUSED_CURSOR = "_onceflow_cursor"
_IDLE_CURSOR = "_onceflow_idle_cursor"
#: A result of more rows than this is not kept by the reused cursor.
KEEP_ROWS = 100
#: Column types that may hold a payload (json, jsonb, bytea): a result of more than one row
#: with one of them is not kept either.
_BULKY_TYPES = frozenset({114, 3802, 17})


def lend_cursor(raw: psycopg.Connection[Any]) -> None:
    """At onceflow's checkout: the connection's reusable cursor (kept aside since its last
    onceflow checkout, or a new one)."""
    cur = getattr(raw, _IDLE_CURSOR, None)
    if cur is None or cur.closed:
        cur = raw.cursor(row_factory=tuple_row)
    else:
        setattr(raw, _IDLE_CURSOR, None)
    setattr(raw, REUSED_CURSOR, cur)


def take_cursor_back(raw: psycopg.Connection[Any]) -> None:
    """Before the connection goes back to the pool: nobody else may find the cursor."""
    cur = getattr(raw, REUSED_CURSOR, None)
    if cur is not None:
        setattr(raw, REUSED_CURSOR, None)
        setattr(raw, _IDLE_CURSOR, cur)


def _reused(conn: psycopg.Connection[Any]) -> psycopg.Cursor[Any] | None:
    cur: psycopg.Cursor[Any] | None = getattr(conn, REUSED_CURSOR, None)
    return None if cur is None or cur.closed else cur


def is_large(result: Any) -> bool:
    """Whether a result (a psycopg ``PGresult``) is too large to keep with its cursor."""
    rows = int(result.ntuples)
    if rows <= 1:
        return False
    if rows > KEEP_ROWS:
        return True
    return any(result.ftype(i) in _BULKY_TYPES for i in range(result.nfields))


def fetch_one(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> Any:
    """Run ``query``; its first row as a dict, or None."""
    return run(conn, query, params, one_as_dict)


def fetch_all(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[Any]:
    """Run ``query``; every row as a dict."""
    rows: list[Any] = run(conn, query, params, all_as_dicts)
    return rows


def execute(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> int:
    """Run ``query``; the number of rows it touched."""
    count: int = run(conn, query, params, rowcount)
    return count


def rowcount(cur: psycopg.Cursor[Any], query: str) -> int:
    """The number of rows the statement touched (a ``take`` of ``run_statement``)."""
    return cur.rowcount


# The reused cursors make tuple rows, and a row becomes a dict with its statement's column
# names kept from the statement's first result: psycopg's dict_row decodes every column's
# name from each result again (27 names for a claim), a measurable share of a claim +
# completion's client CPU. A statement's text fixes its column names (onceflow's statements
# name their columns; no `SELECT *` of a table); the number of columns is checked at every
# result all the same, and a statement whose result differs in it gets its names read again.
_NAMES: dict[str, tuple[str, ...]] = {}
#: Statements whose column names are kept (a process runs a few dozen; cleared past this).
NAMES_KEPT = 512


def column_names(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], query: str
) -> tuple[str, ...]:
    """The column names of ``cur``'s current result, which ``query`` produced."""
    names = _NAMES.get(query)
    result = cur.pgresult
    if names is None or result is None or len(names) != result.nfields:
        names = tuple(c.name for c in cur.description or ())
        if len(_NAMES) >= NAMES_KEPT:
            _NAMES.clear()
        _NAMES[query] = names
    return names


def named_row(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], query: str, row: Any
) -> dict[str, Any] | None:
    """A tuple row of ``cur``'s current result as a dict (None stays None)."""
    return None if row is None else dict(zip(column_names(cur, query), row, strict=True))


def named_rows(
    cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], query: str, rows: list[Any]
) -> list[dict[str, Any]]:
    """The tuple rows of ``cur``'s current result as dicts."""
    if not rows:
        return []
    names = column_names(cur, query)
    return [dict(zip(names, row, strict=True)) for row in rows]


def one_as_dict(cur: psycopg.Cursor[Any], query: str) -> dict[str, Any] | None:
    """The first row of a tuple-row cursor's result, as a dict (None: no row)."""
    return named_row(cur, query, cur.fetchone())


def all_as_dicts(cur: psycopg.Cursor[Any], query: str) -> list[dict[str, Any]]:
    """Every row of a tuple-row cursor's result, as dicts."""
    return named_rows(cur, query, cur.fetchall())


def run(
    conn: psycopg.Connection[Any],
    query: str,
    params: dict[str, Any],
    take: Callable[[psycopg.Cursor[Any], str], Any],
) -> Any:
    """``take(cursor, query)`` after running ``query`` on the connection's reused cursor
    (or on a cursor of its own, for a connection onceflow did not check out)."""
    cur = _reused(conn)
    if cur is None:
        with conn.cursor(row_factory=tuple_row) as own:
            own.execute(query, params)
            return take(own, query)
    try:
        cur.execute(query, params)
        return take(cur, query)
    finally:  # also when a row failed to load: a large result is not kept either way
        result = cur.pgresult
        if result is not None and is_large(result):
            cur.close()  # the result freed now; the next statement gets a fresh cursor
            setattr(conn, REUSED_CURSOR, conn.cursor(row_factory=tuple_row))
