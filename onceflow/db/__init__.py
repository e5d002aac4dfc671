"""Engines made lazily per process, and driver errors translated at the boundary.

Nothing connects at import. An engine is cached per (url, pid): after a fork
(Celery's prefork pool) the child builds its own engine instead of sharing the
parent's sockets — the pattern of Celery's own ``SessionManager``.

Lost connections. The pool does not ping a connection before handing it out
(a round trip per call). After a Postgres restart every pooled connection is
dead, so the first call that meets a dead one invalidates the *whole* pool:
every connection opened before that moment is replaced at its next checkout,
and the error is raised as :class:`ConnectionLost`. :func:`is_disconnect` tells
such an error from a server that cannot be reached at all, and
:func:`retry_disconnect` repeats a call that is safe to repeat once, on a fresh
connection.

The parts, one idea each: :mod:`~onceflow.db.urls` (database URLs),
:mod:`~onceflow.db.engines` (an engine per url and process),
:mod:`~onceflow.db.statements` (statements on a reused cursor, rows as dicts),
:mod:`~onceflow.db.checkout` (a connection for a call), :mod:`~onceflow.db.held`
(a thread that keeps its connection), :mod:`~onceflow.db.disconnect` (lost
connections), :mod:`~onceflow.db.translate` (driver errors into onceflow's) and
:mod:`~onceflow.db.forks` (what a fork does to all of it). Import from
``onceflow.db``: the names below are the API.
"""

from __future__ import annotations

from onceflow.db import forks as forks  # registers the fork hooks, once per process
from onceflow.db.checkout import bounded_read, raw_connection, run_statement
from onceflow.db.disconnect import invalidate_pool, is_disconnect, retry_disconnect
from onceflow.db.engines import dispose_engines, get_engine, make_engine, size_pools_for
from onceflow.db.held import (
    MAX_HELD_ENGINES,
    hold_connections,
    holding,
    holding_connections,
    release_connections,
)
from onceflow.db.statements import (
    KEEP_ROWS,
    NAMES_KEPT,
    REUSED_CURSOR,
    all_as_dicts,
    column_names,
    execute,
    fetch_all,
    fetch_one,
    is_large,
    named_row,
    named_rows,
    one_as_dict,
    render,
    rowcount,
)
from onceflow.db.translate import translate_errors, translated
from onceflow.db.urls import check_database_url, redact_url

__all__ = [
    "KEEP_ROWS",
    "MAX_HELD_ENGINES",
    "NAMES_KEPT",
    "REUSED_CURSOR",
    "all_as_dicts",
    "bounded_read",
    "check_database_url",
    "column_names",
    "dispose_engines",
    "execute",
    "fetch_all",
    "fetch_one",
    "get_engine",
    "hold_connections",
    "holding",
    "holding_connections",
    "invalidate_pool",
    "is_disconnect",
    "is_large",
    "make_engine",
    "named_row",
    "named_rows",
    "one_as_dict",
    "raw_connection",
    "redact_url",
    "release_connections",
    "render",
    "retry_disconnect",
    "rowcount",
    "run_statement",
    "size_pools_for",
    "translate_errors",
    "translated",
]
