"""Database URLs: checked as PostgreSQL through psycopg 3, shown without their password."""

from __future__ import annotations

import re

import sqlalchemy.exc as sa_exc
from sqlalchemy import URL, make_url

from onceflow.errors import InvalidDatabaseUrl


def redact_url(url: str | URL) -> str:
    """``url`` without its password, for messages (also for a string that does not parse)."""
    if isinstance(url, URL):
        clean = url._replace(password=None).difference_update_query(["password"])
        return clean.render_as_string(hide_password=False)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"  # a libpq key=value string may carry password=…: show none of it
    rest = rest.split("?", 1)[0]  # a query string may carry ?password=…
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return f"{scheme}{sep}{rest}"
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}@{hostpart}"


#: The spellings of PostgreSQL accepted; the driver is always psycopg 3.
_POSTGRES_SCHEMES = ("postgresql+psycopg", "postgresql", "postgres")


def check_database_url(url: str) -> URL:
    """``url`` parsed as a PostgreSQL URL for psycopg 3, or :class:`InvalidDatabaseUrl`.

    Accepts the libpq spelling (``postgresql://``, ``postgres://``) users copy from
    elsewhere. Nothing connects; the error names the problem, never the password.
    """
    shown = redact_url(url)
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError:
        raise InvalidDatabaseUrl(shown, "not a URL") from None
    except ValueError as exc:  # e.g. a port that is not a number
        raise InvalidDatabaseUrl(shown, _bad_port(exc)) from None
    if parsed.drivername not in _POSTGRES_SCHEMES:
        raise InvalidDatabaseUrl(
            shown, f"onceflow needs PostgreSQL through psycopg 3, not {parsed.drivername!r}"
        )
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise InvalidDatabaseUrl(shown, f"port {parsed.port} is not in 1-65535")
    return parsed.set(drivername="postgresql+psycopg")


def _bad_port(exc: ValueError) -> str:
    match = re.search(r"int\(\) with base 10: '(.*)'$", str(exc))
    return f"port {match.group(1)!r} is not a number" if match else "cannot be parsed"
