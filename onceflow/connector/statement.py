"""A named statement, written once: its name, its SQL text and its psycopg forms.

A layer's SQL module writes each statement as SQLAlchemy-style text (``:name`` binds)
under the name logs, traces and benchmarks count it by, and everything else is derived
from that one object: the psycopg SQL a connector runs (:attr:`Statement.sql`, rendered
once, at import), the form for a caller that names its request by id alone
(:attr:`Statement.by_id`, written from the same parts) and a ``text()`` clause for a
SQLAlchemy connection (:attr:`Statement.clause`). A statement is a
:class:`~onceflow.connector.steps.Query`: an operation yields it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import TextClause, text

from onceflow.connector.steps import Query
from onceflow.db import render


def psycopg_sql(source: str, binary: Sequence[str] = ()) -> str:
    """``source`` (``:name`` binds) rendered for psycopg (``%(name)s``), the parameters
    ``binary`` as binary placeholders (``%(name)b``).

    Binary for lists of strings: psycopg's text format escapes each element of an array
    with a regular expression, in Python (several times the cost of the binary format).
    Only for parameters that are always lists of one type (a binary array takes its
    element type from its first element) and never empty.
    """
    sql = render(text(source))
    for name in binary:
        placeholder = f"%({name})s"
        if placeholder not in sql:
            raise ValueError(f"no {placeholder} in the statement")
        sql = sql.replace(placeholder, f"%({name})b")
    return sql


@dataclass(frozen=True, slots=True)
class Statement(Query):
    """A named statement: ``text`` as written, ``sql`` (and ``by_id``) as psycopg runs it."""

    text: str = ""

    @classmethod
    def write(
        cls,
        name: str,
        source: str,
        *,
        by_id: str | None = None,
        binary: Sequence[str] = (),
    ) -> Statement:
        """The statement ``name`` of the SQL ``source``; ``by_id``: its form for a caller
        that names its request by id alone, written from the same parts (see
        :meth:`Query.sql_for`); ``binary``: parameters sent in binary (:func:`psycopg_sql`)."""
        return cls(
            name,
            psycopg_sql(source, binary),
            None if by_id is None else psycopg_sql(by_id, binary),
            source,
        )

    @property
    def clause(self) -> TextClause:
        """The statement as a SQLAlchemy ``text()`` clause, for a SQLAlchemy connection."""
        return text(self.text)
