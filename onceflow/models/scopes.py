"""Which workspaces a worker may claim in: exact ids and prefixes (``"acme-*"``).

A worker key or a minted worker token names its workspaces as patterns: ``"*"`` (every
workspace), an exact workspace id, or a prefix ending in ``*`` (``"acme-*"``: every
workspace whose id starts with ``acme-``, what an app assigns per tenant). A ``*``
anywhere but at the end is refused, so a pattern never means more than it shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from onceflow.errors import InvalidRequest
from onceflow.ids import check_id

#: The pattern meaning every workspace.
EVERY_WORKSPACE = "*"


@dataclass(frozen=True, slots=True)
class WorkspaceScope:
    """The workspaces a holder may claim in: ``exact`` ids and id ``prefixes``.

    None where a scope is expected means every workspace (a trusted back end's key).
    """

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, patterns: Iterable[Any], *, what: str = "workspaces") -> WorkspaceScope | None:
        """The scope of ``patterns``; None when one of them is ``"*"`` (every workspace).

        Raises :class:`InvalidRequest` for an empty list, a pattern that is not a usable
        workspace id (or one with a trailing ``*``), or a ``*`` elsewhere than at the end.
        """
        if isinstance(patterns, str | bytes):
            raise InvalidRequest(f"{what} must be a list of workspace ids or patterns")
        exact: set[str] = set()
        prefixes: set[str] = set()
        seen = False
        for pattern in patterns:
            seen = True
            if not isinstance(pattern, str):
                raise InvalidRequest(f"{what}: each pattern is a string")
            if pattern == EVERY_WORKSPACE:
                return None
            head = pattern[:-1] if pattern.endswith("*") else pattern
            if "*" in head:
                raise InvalidRequest(
                    f"{what}: {pattern[:40]!r} — a * is allowed only at the end (a prefix)"
                )
            check_id(f"{what} pattern", head)
            (prefixes if pattern.endswith("*") else exact).add(head)
        if not seen:
            raise InvalidRequest(f'{what} must name at least one workspace (or "*")')
        return cls(frozenset(exact), tuple(sorted(prefixes)))

    def allows(self, workspace_id: str) -> bool:
        """True if ``workspace_id`` is one of the exact ids or starts with a prefix."""
        return workspace_id in self.exact or any(workspace_id.startswith(p) for p in self.prefixes)

    def patterns(self) -> list[str]:
        """The scope as patterns (exact ids, then ``prefix*``), sorted."""
        return sorted(self.exact) + [p + "*" for p in self.prefixes]


def as_scope(workspaces: WorkspaceScope | Iterable[str] | None) -> WorkspaceScope | None:
    """``workspaces`` as a scope (None: every workspace): a scope as is, patterns parsed."""
    if workspaces is None or isinstance(workspaces, WorkspaceScope):
        return workspaces
    return WorkspaceScope.parse(workspaces)


def allows(scope: WorkspaceScope | None, workspace_id: str) -> bool:
    """True if ``scope`` (None: every workspace) allows ``workspace_id``."""
    return scope is None or scope.allows(workspace_id)


def scope_params(scope: WorkspaceScope | None) -> dict[str, list[str] | None]:
    """The bound parameters of a statement's workspace filter (``ws_exact``,
    ``ws_prefixes``); both None for every workspace."""
    if scope is None:
        return {"ws_exact": None, "ws_prefixes": None}
    return {"ws_exact": sorted(scope.exact), "ws_prefixes": list(scope.prefixes)}


def like_patterns(scope: WorkspaceScope) -> list[str]:
    """The scope as SQL ``LIKE`` patterns (escape character ``\\``, Postgres's default): an
    exact id as itself, a prefix followed by ``%``. The ``%``, ``_`` and ``\\`` of an id are
    escaped, so a pattern matches exactly the workspaces :meth:`WorkspaceScope.allows`."""

    def literal(text: str) -> str:
        return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

    return sorted(literal(ws) for ws in scope.exact) + [literal(p) + "%" for p in scope.prefixes]
