"""Driver errors (psycopg, SQLAlchemy) translated into onceflow's error tree at the boundary."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import sqlalchemy.exc as sa_exc
from sqlalchemy import URL

from onceflow.db.urls import redact_url
from onceflow.errors import (
    ConnectionLost,
    DatabaseUnavailable,
    InvalidRequest,
    NotMigrated,
    OnceflowError,
    StoreError,
)
from onceflow.settings import get_settings


@contextmanager
def translate_errors(url: str | URL | None = None) -> Iterator[None]:
    """Translate SQLAlchemy / psycopg errors into onceflow's tree; ours pass through.

    ``url`` names the database in :class:`NotMigrated` (one of onceflow's tables is
    missing); the settings' database URL by default. See :func:`translated`.
    """
    try:
        yield
    except Exception as exc:
        new = translated(exc, url)
        if new is exc:
            raise
        raise new from exc


def translated(exc: Exception, url: str | URL | None = None) -> Exception:
    """What :func:`translate_errors` raises for ``exc``: onceflow's error for a psycopg or
    SQLAlchemy one, ``exc`` itself for any other (onceflow's own included)."""
    if isinstance(exc, OnceflowError):
        return exc
    if isinstance(exc, psycopg.Error):
        if isinstance(exc, psycopg.OperationalError):
            return DatabaseUnavailable(f"Postgres unavailable: {first_line(exc)}")
        if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
            return InvalidRequest(f"rejected by the database: {first_line(exc)}")
        return _not_migrated(exc, url) or StoreError(first_line(exc))
    if not isinstance(exc, sa_exc.SQLAlchemyError):
        return exc
    if isinstance(exc, sa_exc.OperationalError):
        if exc.connection_invalidated:  # SQLAlchemy invalidated the pool already
            return ConnectionLost(f"Postgres connection lost: {first_line(exc)}")
        return DatabaseUnavailable(f"Postgres unavailable: {first_line(exc)}")
    if isinstance(exc, sa_exc.DataError):
        return InvalidRequest(f"rejected by the database: {first_line(exc)}")
    if isinstance(exc, sa_exc.IntegrityError):
        constraint = getattr(getattr(exc.orig, "diag", None), "constraint_name", None)
        return InvalidRequest(f"violates {constraint or 'a constraint'}: {first_line(exc)}")
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return ConnectionLost(f"Postgres connection lost: {first_line(exc)}")
        return _not_migrated(exc, url) or StoreError(first_line(exc))
    return StoreError(first_line(exc))


def first_line(exc: BaseException) -> str:
    """The first line of a driver error's message (of the DBAPI error it wraps, if any)."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


#: An "undefined table" error names the relation in its message (not in its diagnostics).
_UNDEFINED_RELATION = re.compile(r'relation "(?:[^"]+\.)?([^".]+)" does not exist')


def _not_migrated(exc: BaseException, url: str | URL | None) -> NotMigrated | None:
    """:class:`NotMigrated` if ``exc`` says one of onceflow's tables does not exist."""
    from onceflow.models import metadata  # the tables; models import nothing of ours

    orig = getattr(exc, "orig", None) or exc
    if not isinstance(orig, psycopg.errors.UndefinedTable):
        return None
    match = _UNDEFINED_RELATION.search(str(orig))
    ours = {*metadata.tables, "onceflow_alembic_version"}
    if match is None or match.group(1) not in ours:
        return None
    where = redact_url(url if url is not None else get_settings().database_url)
    return NotMigrated(where, f"table {match.group(1)} is missing")
