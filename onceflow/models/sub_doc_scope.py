"""The sub-docs a stage's claim may read and write: templates over the claimed request.

A stage declares them (``Flow.stage(..., sub_docs=...)``) as templates with the
placeholders ``{workspace_id}``, ``{job_id}``, ``{request_id}`` and ``{stage}``, each
filled with the claimed request's value; a trailing ``*`` makes a template a prefix::

    sub_docs=("job:{job_id}", "job:{job_id}:*", "board")

Undeclared, a stage's claim reaches its job's sub-docs, :data:`DEFAULT_SUB_DOCS`.
Templates are checked when the stage is declared: an unknown placeholder, a brace that
opens no placeholder or a ``*`` anywhere but at the end is refused there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from onceflow.errors import InvalidRequest, OutOfScope
from onceflow.ids import check_id

#: What a template may name: the claimed request's own ids.
PLACEHOLDERS = ("workspace_id", "job_id", "request_id", "stage")
#: A stage that declares no ``sub_docs``: its job's sub-docs (``job:<job>`` and below it).
DEFAULT_SUB_DOCS = ("job:{job_id}", "job:{job_id}:*")

_PART = re.compile(r"\{([^{}]*)\}|([^{}]+)|([{}])")


@dataclass(frozen=True, slots=True)
class _Template:
    parts: tuple[tuple[bool, str], ...]  # (is a placeholder, its name or the literal text)
    prefix: bool

    def render(self, where: Mapping[str, str]) -> str:
        return "".join(str(where[text]) if named else text for named, text in self.parts)

    def matches(self, sub_doc: str, where: Mapping[str, str]) -> bool:
        rendered = self.render(where)
        return sub_doc.startswith(rendered) if self.prefix else sub_doc == rendered


def _parse(template: object) -> _Template:
    if not isinstance(template, str):
        raise InvalidRequest(f"sub_docs: a template is a string, got {type(template).__name__}")
    check_id("sub_docs template", template)
    prefix = template.endswith("*")
    body = template[:-1] if prefix else template
    if "*" in body:
        raise InvalidRequest(
            f"sub_docs template {template!r}: '*' is allowed only at the end (a prefix)"
        )
    parts: list[tuple[bool, str]] = []
    for match in _PART.finditer(body):
        name, literal, stray = match.groups()
        if stray is not None:
            raise InvalidRequest(
                f"sub_docs template {template!r}: a brace opens no placeholder "
                f"(placeholders: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})"
            )
        if name is not None and name not in PLACEHOLDERS:
            raise InvalidRequest(
                f"sub_docs template {template!r}: unknown placeholder {{{name}}} "
                f"(placeholders: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})"
            )
        parts.append((name is not None, name if name is not None else literal))
    if not parts and not prefix:
        raise InvalidRequest("sub_docs: a template must not be empty")
    return _Template(tuple(parts), prefix)


@dataclass(frozen=True, slots=True)
class SubDocScope:
    """The sub-doc templates of one stage, checked: which sub-docs its claims may reach."""

    stage: str
    templates: tuple[str, ...]
    _parsed: tuple[_Template, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def of(cls, stage: str, templates: Iterable[str] | None) -> SubDocScope:
        """``stage``'s scope: ``templates`` checked, or :data:`DEFAULT_SUB_DOCS` for None.

        Raises :class:`InvalidRequest` for a malformed template (at the declaration).
        """
        if templates is None:
            templates = DEFAULT_SUB_DOCS
        if isinstance(templates, str):
            raise InvalidRequest("sub_docs must be a tuple of templates, not one string")
        kept = tuple(templates)
        return cls(stage, kept, tuple(_parse(t) for t in kept))

    @classmethod
    def nothing(cls, stage: str) -> SubDocScope:
        """No sub-doc at all (a stage this process does not declare)."""
        return cls(stage, ())

    def allows(self, sub_doc: str, where: Mapping[str, str]) -> bool:
        """True if ``sub_doc`` is in scope for the request ``where`` names (its
        ``workspace_id``, ``job_id``, ``request_id`` and ``stage``)."""
        return any(t.matches(sub_doc, where) for t in self._parsed)

    def check(self, sub_doc: str, where: Mapping[str, str]) -> None:
        """Raise :class:`OutOfScope` unless ``sub_doc`` is in scope for ``where``."""
        if self.allows(sub_doc, where):
            return
        allowed = ", ".join(self.templates) if self.templates else "none"
        raise OutOfScope(
            f"sub-doc {sub_doc!r} is outside what stage {self.stage!r} may read and write "
            f"(sub_docs: {allowed}); a stage declares others with Flow.stage(..., sub_docs=...)"
        )


def request_fields(request: object) -> dict[str, str]:
    """The placeholders' values of a request (any object with the four ids as attributes)."""
    return {name: str(getattr(request, name)) for name in PLACEHOLDERS}
