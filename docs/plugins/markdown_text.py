"""Text from the code made safe for a Markdown page: its code spans kept, HTML escaped.

Help texts, descriptions and docstrings say ``<key>`` or ``{"*": …}``: outside code spans
those characters would be read as HTML or emphasis. References to the project's own pages
(``docs/reliability.md``) become links, so a renamed page fails the strict build.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_PAGE = re.compile(r"\bdocs/([\w/-]+\.md)\b")
_SPECIAL = re.compile(r"([\\*_\[\]|])")


def text(value: str, *, page: str) -> str:
    """``value`` as Markdown for the page at ``page`` (its path under docs/).

    Code spans are kept as written (tables do not split on a ``|`` inside one); elsewhere
    ``< > &`` are HTML-escaped, Markdown's special characters backslash-escaped, and
    ``docs/<page>.md`` becomes a link to that page.
    """
    out: list[str] = []
    last = 0
    for m in _CODE.finditer(value):
        out.append(_plain(value[last : m.start()], page))
        out.append(m.group(0))
        last = m.end()
    out.append(_plain(value[last:], page))
    return "".join(out)


def _plain(value: str, page: str) -> str:
    escaped = _SPECIAL.sub(r"\\\1", html.escape(value, quote=False))
    return _PAGE.sub(lambda m: _link(m, page), escaped)


def _link(m: re.Match[str], page: str) -> str:
    target = m.group(1).replace("\\_", "_")
    if not (DOCS / target).is_file():
        return m.group(0)
    depth = page.count("/")
    return f"[docs/{target}]({'../' * depth}{target})"


def code(value: object) -> str:
    """``value`` as an inline code span (backticks inside it are fenced by more)."""
    s = str(value)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def one_line(value: str) -> str:
    """Whitespace (newlines included) collapsed to single spaces, for a table cell."""
    return " ".join(value.split())
