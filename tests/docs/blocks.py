"""The fenced code blocks of a Markdown page, each with the HTML comment marking it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<fence>```+)(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*example:\s*(?P<body>.*?)\s*-->$", re.S)
MODULE = re.compile(r"^#\s*(?P<path>[\w/]+\.py)\b")
PYTHON = {"python", "py"}


@dataclass
class Block:
    """One fenced code block and its marker."""

    path: Path
    line: int
    lang: str
    code: str
    marker: str = ""

    @property
    def where(self) -> str:
        """``file:line`` of the opening fence."""
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def module(self) -> str | None:
        """The module path a Python block defines (``myproject/stages.py``), if any."""
        m = MODULE.match(self.code)
        return m["path"] if self.lang in PYTHON and m else None


def _comments_before(lines: list[str], index: int) -> list[str]:
    """The HTML comments right above line ``index`` (blank lines allowed), nearest last."""
    found: list[str] = []
    i = index - 1
    while i >= 0:
        if not lines[i].strip():
            i -= 1
            continue
        if not lines[i].rstrip().endswith("-->"):
            break
        end = i
        while i >= 0 and not lines[i].lstrip().startswith("<!--"):
            i -= 1
        if i < 0:
            break
        found.insert(0, "\n".join(s.strip() if n == i else s for n, s in
                                  enumerate(lines[i : end + 1], start=i)))  # fmt: skip
        i -= 1
    return found


def extract(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with its marker."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m or lines[i].startswith("    "):
            i += 1
            continue
        start, fence = i, m["fence"]
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        block = Block(path, start + 1, m["lang"].lower(), "\n".join(body) + "\n")
        for comment in _comments_before(lines, start):
            if mm := MARKER.match(comment):
                block.marker = mm["body"]
        blocks.append(block)
        i += 1
    return blocks
