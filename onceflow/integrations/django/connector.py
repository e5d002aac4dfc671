"""A connector (:mod:`onceflow.connector`) on Django's own database connection.

Every statement runs on a cursor of the connection ``using``, so inside the
caller's current transaction (``transaction.atomic()``) or in Django's autocommit.
A database error marks the caller's atomic block for rollback (as Django's own
writes do), so a caught error cannot be followed by a silent commit. A
:class:`~onceflow.connector.Transaction` step is a nested ``atomic`` (a savepoint
inside the caller's block); an :class:`~onceflow.connector.AfterCommit` step is
``transaction.on_commit`` (at once in autocommit, never after a rollback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from onceflow.connector import Connector, Query

log = logging.getLogger("onceflow.integrations.django")


class DjangoConnector:
    """Statements on Django's connection ``using``, in the caller's transaction.

    Django's PostgreSQL backend (psycopg 3 or 2) takes psycopg's ``%(name)s``
    placeholders and binds lists as arrays.
    """

    pooled = False

    def __init__(self, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using

    def _rows(self, query: Query, params: Mapping[str, Any]) -> tuple[list[Any], int]:
        with (
            transaction.mark_for_rollback_on_error(using=self.using),
            connections[self.using].cursor() as cursor,
        ):
            cursor.execute(query.sql_for(params), dict(params))
            if cursor.description is None:
                return [], cursor.rowcount
            names = [column[0] for column in cursor.description]
            rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            return rows, cursor.rowcount

    def fetch_one(self, query: Query, params: Mapping[str, Any]) -> Any:
        rows, _ = self._rows(query, params)
        return rows[0] if rows else None

    def fetch_all(self, query: Query, params: Mapping[str, Any]) -> list[Any]:
        return self._rows(query, params)[0]

    def execute(self, query: Query, params: Mapping[str, Any]) -> int:
        return self._rows(query, params)[1]

    @contextmanager
    def transaction(self) -> Iterator[Connector]:
        with transaction.atomic(using=self.using):
            yield self

    def after_commit(self, fn: Callable[[], object]) -> None:
        transaction.on_commit(fn, using=self.using, robust=True)
