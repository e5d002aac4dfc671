"""The settings reference page, rendered from :class:`onceflow.settings.Settings`.

One section per field, in the model's order: its environment variable, type, default,
allowed range and description. Nothing is read from the environment: the defaults shown
are the model's.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import annotated_types
from markdown_text import code, one_line, text
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from onceflow.settings import Settings

PAGE = "reference/settings.md"
PREFIX = str(Settings.model_config.get("env_prefix", ""))

#: Variables read outside the settings model, with what reads them.
OTHER_VARIABLES = {
    "CELERY_BROKER_URL": "Celery's own name for the broker URL; when set it wins over "
    "`ONCEFLOW_BROKER_URL` and `ONCEFLOW_REDIS_URL` for the broker.",
    "PROMETHEUS_MULTIPROC_DIR": "prometheus_client's multiprocess directory: set it, to an "
    "empty directory, before Python starts (docs/metrics.md).",
    "ONCEFLOW_FLOWER_ADDRESS": "`onceflow flower`: the address Flower binds (default `127.0.0.1`).",
    "ONCEFLOW_FLOWER_PORT": "`onceflow flower`: the port Flower listens on (default `5555`).",
    "ONCEFLOW_FLOWER_BASIC_AUTH": "`onceflow flower`: `user:password` entries separated by "
    "commas; Flower refuses to start without it (docs/celery.md).",
    "ONCEFLOW_CHROMIUM": "`onceflow demo --browser`: the Chromium executable to drive.",
    "ONCEFLOW_DEMO_LLM_URLS": "`onceflow demo`: OpenAI-compatible base URLs (comma-separated) "
    "of a real LLM provider, tried in order, instead of the stand-in.",
    "ONCEFLOW_DEMO_LLM_MODEL": "`onceflow demo`: the model asked for at those URLs.",
    "ONCEFLOW_LLM_API_KEY": "`onceflow demo`: the provider's API key (from the environment "
    "only; never logged, never in a task argument).",
    "ONCEFLOW_DEMO_MAPS_URL": "`onceflow demo`: the base URL of a real maps provider.",
    "ONCEFLOW_DEMO_RUN": "Set by `onceflow demo` for the processes it starts.",
    "ONCEFLOW_API_LOG_LEVEL": "Set by `onceflow api --workers N` for the processes it "
    "starts (their log level).",
}


def env_var(name: str) -> str:
    """The environment variable of field ``name``."""
    return f"{PREFIX}{name}".upper()


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: ``float``, ``str | None``, ``"redis" | "sql"``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def default(field: FieldInfo) -> str:
    """The default as it would be written in the environment (unset for None)."""
    value = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, dict | list) or value == "":
        return code(json.dumps(value))
    return code(value)


def bounds(field: FieldInfo) -> str:
    """The field's allowed range (``> 0, ≤ 86400``), or an empty string."""
    parts: list[str] = []
    for item in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                parts.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(parts)


def render() -> str:
    """The whole page."""
    fields = Settings.model_fields
    lines = [
        "# Settings",
        "",
        "Every setting of onceflow, generated from its settings model "
        "(`onceflow.settings.Settings`) when this site is built. Each is read from the "
        f"environment as `{PREFIX}<NAME>`; a framework's own configuration can supply values "
        "beneath the environment (`onceflow.settings.use_defaults`, Django's "
        "`ONCEFLOW = {...}`), and a variable that is set wins over them. Values of dictionary "
        "type are JSON; booleans are `true`/`false` (or `1`/`0`). A process reads its "
        "settings once, at its first use of them.",
        "",
        "| Variable | Type | Default |",
        "|---|---|---|",
    ]
    for name, field in fields.items():
        var = env_var(name)
        lines.append(
            f"| [`{var}`](#{var.lower()}) | {code(type_name(field.annotation))} "
            f"| {default(field)} |"
        )
    for name, field in fields.items():
        var = env_var(name)
        lines += ["", f"## `{var}` {{ #{var.lower()} }}", ""]
        lines.append(text(one_line(field.description or ""), page=PAGE))
        lines.append("")
        facts = [
            f"Type: {code(type_name(field.annotation))}",
            f"default: {default(field)}",
            f"field: {code(name)}",
        ]
        if rng := bounds(field):
            facts.insert(2, f"range: {text(rng, page=PAGE)}")
        lines.append("; ".join(facts) + ".")
    lines += [
        "",
        "## Read outside the settings model",
        "",
        "| Variable | What reads it |",
        "|---|---|",
    ]
    for var, what in OTHER_VARIABLES.items():
        lines.append(f"| `{var}` | {text(what, page=PAGE)} |")
    return "\n".join(lines) + "\n"
