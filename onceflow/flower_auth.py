"""Flower's basic-auth credentials, parsed once for both ``onceflow flower`` and flower.cfg.

``ONCEFLOW_FLOWER_BASIC_AUTH`` holds ``user:password`` entries separated by commas
(so neither part may contain a comma; a password may contain ``:``). Every entry
must have a non-empty user and a non-empty password: a value with an empty or
malformed entry (``","``, ``":"``, ``"user:"``, ``":pw"``) is refused as a whole,
so that nothing that parses to no credentials can start Flower with its UI open.
Error messages never repeat the value: it holds passwords.
"""

from __future__ import annotations

import os

ENV_VAR = "ONCEFLOW_FLOWER_BASIC_AUTH"


class InvalidBasicAuth(ValueError):
    """The credentials value is malformed (the message names the entry, never its text)."""


def parse_basic_auth(value: str) -> list[str]:
    """The ``user:password`` entries of ``value``; :class:`InvalidBasicAuth` if any is malformed."""
    entries = value.split(",")
    out: list[str] = []
    for number, raw in enumerate(entries, 1):
        entry = raw.strip()
        user, sep, password = entry.partition(":")
        if not sep or not user.strip() or not password.strip():
            raise InvalidBasicAuth(
                f"{ENV_VAR}: entry {number} of {len(entries)} is not user:password with a "
                "non-empty user and password (entries are separated by commas)"
            )
        out.append(entry)
    return out


def basic_auth_from_env(environ: dict[str, str] | None = None) -> list[str] | None:
    """The credentials of ``ONCEFLOW_FLOWER_BASIC_AUTH``: None when unset or empty."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not value:
        return None
    return parse_basic_auth(value)
