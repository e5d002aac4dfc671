"""Griffe extension: the docstrings' Sphinx roles as Markdown for mkdocstrings.

onceflow's docstrings are reStructuredText-flavoured: ``:class:`Queue```,
``:meth:`~onceflow.Queue.claim```, ``:meth:`title <target>```, and paragraphs that end in
``::`` before an indented example. mkdocstrings renders docstrings as Markdown, where a
role would show as ``:class:Queue``. This extension rewrites each role into a code span,
linked to the named object when the site documents it (an *optional* cross-reference: no
warning when it does not), and ``::`` before a literal block into ``:``. An attribute
documented by ``#:`` comment lines above it (Sphinx's convention) gets them as its
docstring. The sources are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(?P<tilde>~?)"
    r"(?:(?P<title>[^`<]+?)\s*<(?P<explicit>[\w.]+)>|(?P<target>[\w.]+?)(?P<call>\(\))?)`"
)
LITERAL = re.compile(r"(?<=\S)::(?=\n\n[ \t])")
LONE_LITERAL = re.compile(r"^([ \t]*)::\n(?=\n[ \t])", re.M)


def _resolve(obj: griffe.Object, target: str) -> str:
    """``target``'s full path as seen from ``obj`` (as written when it cannot be resolved)."""
    head, _, rest = target.partition(".")
    for scope in (obj, obj.parent):
        if scope is None:
            continue
        try:
            full = scope.resolve(head)
        except Exception:  # noqa: S112 - not resolvable here: try the next scope
            continue
        return f"{full}.{rest}" if rest else full
    return target


def rewrite(obj: griffe.Object, value: str) -> str:
    """One docstring with its roles as optional cross-references and ``::`` as ``:``."""

    def role(m: re.Match[str]) -> str:
        if m["explicit"]:
            target, shown = m["explicit"], " ".join(m["title"].split())
        else:
            target = m["target"]
            shown = target.rsplit(".", 1)[-1] if m["tilde"] else target
            shown += m["call"] or ""
        identifier = _resolve(obj, target)
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    value = ROLE.sub(role, value)
    value = LITERAL.sub(":", value)
    return LONE_LITERAL.sub("", value)


def _comment_above(obj: griffe.Object) -> str:
    """The ``#:`` comment lines right above an attribute's assignment (Sphinx's attribute
    documentation), joined; empty if there are none."""
    if obj.lineno is None or not isinstance(obj.filepath, Path) or not obj.filepath.is_file():
        return ""
    lines = obj.filepath.read_text().splitlines()
    found: list[str] = []
    i = obj.lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        found.insert(0, lines[i].lstrip()[2:].strip())
        i -= 1
    return " ".join(found)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of a loaded package (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Walk the package once it is loaded, when names resolve."""
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is None and obj.is_attribute:
            comment = _comment_above(obj)
            if comment:
                obj.docstring = griffe.Docstring(comment, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]
