"""Hypothesis strategies drawn from an OpenAPI document: calls that are valid, nearly valid, or not.

A small JSON Schema reader for what FastAPI emits ($ref, anyOf, object, array,
string with lengths and patterns, integer and number bounds, boolean, null,
enum, and the empty schema = any JSON). Each value is drawn from the schema most
of the time and from arbitrary JSON otherwise; objects sometimes lose a required
field or gain an unknown one, and numbers stray past their bounds — the edges a
server must answer with 4xx, never 5xx.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

# Text that a server must survive: controls, non-ASCII, lone surrogates, separators.
nasty_text = st.text(
    alphabet=st.characters(codec=None, exclude_categories=()), min_size=0, max_size=40
) | st.sampled_from(["", "/", "..", "%", "\x00", "\ud800", "a" * 300, "w1\n", "*", "{x}"])

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and ±Infinity too: Python's json reads them
    | nasty_text
)
any_json = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(nasty_text, inner, max_size=4),
    max_leaves=12,
)


@dataclass(frozen=True)
class Operation:
    """One operation of the document."""

    method: str
    path: str
    spec: Mapping[str, Any]


def operations(doc: Mapping[str, Any], *, skip_media: str = "text/event-stream") -> list[Operation]:
    """Every operation, minus the streaming ones."""
    out = []
    for path, item in sorted(doc["paths"].items()):
        for method, spec in sorted(item.items()):
            content = spec.get("responses", {}).get("200", {}).get("content", {})
            if skip_media in content:
                continue
            out.append(Operation(method.upper(), path, spec))
    return out


class SchemaStrategies:
    """Strategies for the schemas of one OpenAPI document."""

    def __init__(self, doc: Mapping[str, Any], hints: Mapping[str, st.SearchStrategy[Any]]):
        self.components = doc.get("components", {}).get("schemas", {})
        self.hints = hints

    def value(self, schema: Mapping[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
        """Mostly schema-shaped values, sometimes anything."""
        return st.one_of(self._shaped(schema, depth), self._shaped(schema, depth), any_json)

    def _shaped(self, schema: Mapping[str, Any], depth: int) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            return self._shaped(self.components[schema["$ref"].rsplit("/", 1)[1]], depth)
        if "anyOf" in schema:
            return st.one_of([self._shaped(sub, depth) for sub in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"]) | nasty_text
        if "const" in schema:
            return st.just(schema["const"])
        kind = schema.get("type")
        if kind == "object" and depth < 3:
            return self._object(schema, depth)
        if kind == "array" and depth < 3:
            items = schema.get("items", {})
            return st.lists(self._shaped(items, depth + 1), max_size=schema.get("maxItems", 3) + 1)
        if kind == "string":
            return self._string(schema)
        if kind == "integer":
            lo, hi = schema.get("minimum"), schema.get("maximum")
            edges = [v for b in (lo, hi) if b is not None for v in (b - 1, b, b + 1)]
            return st.integers(min_value=lo, max_value=hi) | st.sampled_from(edges or [0, -1])
        if kind == "number":
            return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
                [0, -1, 1e300, 0.0001, 86_401]
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return any_json

    def _string(self, schema: Mapping[str, Any]) -> st.SearchStrategy[str]:
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True) | nasty_text
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength", 60)
        return st.text(min_size=lo, max_size=min(hi, 60)) | nasty_text

    def _object(self, schema: Mapping[str, Any], depth: int) -> st.SearchStrategy[Any]:
        props: Mapping[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", []))

        @st.composite
        def build(draw: st.DrawFn) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, sub in props.items():
                if name not in required and draw(st.booleans()):
                    continue
                if name in required and draw(st.integers(0, 9)) == 0:
                    continue  # a required field missing
                hint = self.hints.get(name)
                if hint is not None and draw(st.booleans()):
                    out[name] = draw(hint)
                else:
                    out[name] = draw(self._shaped(sub, depth + 1))
            if draw(st.integers(0, 9)) == 0:
                out[draw(nasty_text)] = draw(any_json)  # an unknown field
            return out

        return build()


def path_value(raw: str) -> str:
    """A path parameter as one percent-encoded segment."""
    return quote(raw.encode("utf-8", "surrogatepass"), safe="")
