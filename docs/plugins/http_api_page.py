"""The HTTP API reference page, rendered from the FastAPI app's OpenAPI schema.

The schema comes from ``create_app(flow).openapi()`` on onceflow's default Flow and the
settings model's defaults: building it connects to nothing. Every route is listed with its
parameters, body and responses; the error answers that every ``/v1`` route shares are
listed once; every schema of ``components`` follows with its fields.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from markdown_text import code, one_line, text

PAGE = "reference/http-api.md"
SCHEMA_FILE = "reference/openapi.json"
METHODS = ("get", "put", "post", "patch", "delete", "head", "options")


def openapi_schema() -> dict[str, Any]:
    """The OpenAPI document of ``onceflow api``, with the settings' defaults."""
    from onceflow.integrations.fastapi import create_app
    from onceflow.settings import Settings
    from onceflow.tasks.default import flow

    return create_app(flow, settings=Settings.model_construct()).openapi()


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(METHOD, path, operation)`` for every route, in the schema's order."""
    return [
        (method.upper(), path, op)
        for path, item in schema["paths"].items()
        for method, op in item.items()
        if method in METHODS
    ]


def anchor(name: str) -> str:
    """The anchor of a component schema's section."""
    return f"schema-{name.lower()}"


def type_of(s: dict[str, Any]) -> str:
    """A JSON schema as a short Markdown type: ``string``, ``array of [ClaimOut](#…)``."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in s:
            return " \\| ".join(type_of(x) for x in s[key])
    if "allOf" in s and len(s["allOf"]) == 1:
        return type_of(s["allOf"][0])
    if "const" in s:
        return code(json.dumps(s["const"]))
    if "enum" in s:
        return " \\| ".join(code(json.dumps(v)) for v in s["enum"])
    kind = s.get("type")
    if isinstance(kind, list):
        return " \\| ".join(type_of({**s, "type": k}) for k in kind)
    if kind == "array":
        return f"array of {type_of(s.get('items', {}))}"
    if kind == "object":
        extra = s.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return f"object of {type_of(extra)}"
        return "object"
    if kind is None:
        return "any"
    fmt = s.get("format")
    return f"{kind} ({fmt})" if fmt else str(kind)


def constraints(s: dict[str, Any]) -> str:
    """A schema's bounds, pattern and default, as a short sentence (or empty)."""
    s = {**s, **next((x for x in s.get("anyOf", []) if x.get("type") != "null"), {})}
    parts: list[str] = []
    lo, hi = s.get("minLength"), s.get("maxLength")
    if lo is not None or hi is not None:
        parts.append(f"{lo or 0} to {hi if hi is not None else '∞'} characters")
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", "≥"),
                      ("exclusiveMaximum", "<"), ("maximum", "≤")):  # fmt: skip
        if key in s:
            value = s[key]
            parts.append(f"{sign} {int(value) if float(value).is_integer() else value}")
    if "minItems" in s or "maxItems" in s:
        parts.append(f"{s.get('minItems', 0)} to {s.get('maxItems', '∞')} items")
    if "pattern" in s:
        parts.append(f"pattern {code(s['pattern'])}")
    if "default" in s:
        parts.append(f"default {code(json.dumps(s['default']))}")
    return "; ".join(parts)


def _cell(*parts: str) -> str:
    return " ".join(p for p in parts if p) or "—"


def _body_schema(node: dict[str, Any]) -> str:
    content = node.get("content") or {}
    if not content:
        return "—"
    return "; ".join(
        type_of(media.get("schema", {}))
        + ("" if kind == "application/json" else f" ({code(kind)})")
        for kind, media in content.items()
    )


def common_responses(schema: dict[str, Any]) -> dict[str, str]:
    """The (status, description) pairs every authenticated route answers."""
    secured = [op for _, _, op in operations(schema) if op.get("security")]
    if not secured:
        return {}
    first = {code: r["description"] for code, r in secured[0]["responses"].items()}
    return {
        code: desc
        for code, desc in first.items()
        if all(op["responses"].get(code, {}).get("description") == desc for op in secured)
    }


def _route(method: str, path: str, op: dict[str, Any], common: dict[str, str]) -> list[str]:
    op_id = op.get("operationId", f"{method}-{path}")
    lines = [f"### `{method} {path}` {{ #{op_id} }}", "", f"**{op.get('summary', '')}**", ""]
    for para in (op.get("description") or "").split("\n\n"):
        if para.strip():
            lines += [text(one_line(para), page=PAGE), ""]
    lines.append("Authentication: " + (
        "`Authorization: Bearer <key>`." if op.get("security") else "none."
    ))  # fmt: skip
    lines.append("")
    params = op.get("parameters") or []
    if params:
        lines += ["| Parameter | In | Type | Required | Description |", "|---|---|---|---|---|"]
        for p in params:
            s = p.get("schema", {})
            desc = p.get("description") or s.get("description") or ""
            lines.append(
                f"| {code(p['name'])} | {p['in']} | {type_of(s)} "
                f"| {'yes' if p.get('required') else 'no'} "
                f"| {_cell(text(one_line(desc), page=PAGE), constraints(s))} |"
            )
        lines.append("")
    body = op.get("requestBody")
    if body:
        required = "required" if body.get("required") else "optional"
        lines += [f"Body ({required}): {_body_schema(body)}", ""]
    lines += ["| Status | Meaning | Body |", "|---|---|---|"]
    shared = [c for c in op["responses"] if common.get(c) == op["responses"][c]["description"]]
    for status, resp in sorted(op["responses"].items()):
        if status in shared:
            continue
        lines.append(
            f"| {status} | {text(one_line(resp.get('description', '')), page=PAGE)} "
            f"| {_body_schema(resp)} |"
        )
    if shared:
        lines.append(
            f"| {', '.join(sorted(shared))} | [the errors every route answers](#common-errors) "
            "| [ErrorOut](#schema-errorout) |"
        )
    lines.append("")
    return lines


def _component(name: str, s: dict[str, Any]) -> list[str]:
    lines = [f"### {name} {{ #{anchor(name)} }}", ""]
    if s.get("description"):
        lines += [text(one_line(s["description"]), page=PAGE), ""]
    props = s.get("properties")
    if not props:
        lines += [f"Type: {type_of(s)}" + (f"; {constraints(s)}" if constraints(s) else ""), ""]
        return lines
    required = set(s.get("required", []))
    lines += ["| Field | Type | Required | Description |", "|---|---|---|---|"]
    for field, fs in props.items():
        desc = text(one_line(fs.get("description", "")), page=PAGE)
        lines.append(
            f"| {code(field)} | {type_of(fs)} | {'yes' if field in required else 'no'} "
            f"| {_cell(desc, constraints(fs))} |"
        )
    if s.get("additionalProperties") is False:
        lines += ["", "Other fields are refused (422)."]
    lines.append("")
    return lines


def render(schema: dict[str, Any]) -> str:
    """The whole page."""
    info = schema["info"]
    lines = [
        "# HTTP API",
        "",
        text(
            f"The routes of `onceflow api` (OpenAPI {schema['openapi']}, API version "
            f"{info['version']}), generated from the app's own schema when this site is built. "
            + one_line(info.get("description", "")),
            page=PAGE,
        ),
        "",
        "The raw schema: [openapi.json](openapi.json) (a running server also serves it at "
        "`/openapi.json`). "
        + text(
            "How to run and secure the API: docs/integration-fastapi.md; pull workers: "
            "docs/browser.md.",
            page=PAGE,
        ),
        "",
    ]
    common = common_responses(schema)
    if common:
        lines += [
            "## The errors every route answers { #common-errors }",
            "",
            "Every route that takes a key may answer these, each with an "
            "[ErrorOut](#schema-errorout) body:",
            "",
            "| Status | Meaning |",
            "|---|---|",
        ]
        for status, desc in sorted(common.items()):
            lines.append(f"| {status} | {text(one_line(desc), page=PAGE)} |")
        lines.append("")
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = defaultdict(list)
    for method, path, op in operations(schema):
        by_tag[(op.get("tags") or ["other"])[0]].append((method, path, op))
    for tag, ops in by_tag.items():
        lines += [f"## {tag.capitalize()}", ""]
        for method, path, op in ops:
            lines += _route(method, path, op, common)
    lines += ["## Schemas", ""]
    for name, s in schema.get("components", {}).get("schemas", {}).items():
        lines += _component(name, s)
    return "\n".join(lines)
