"""The OpenAPI schema names what the server accepts where a static model cannot.

A stage, an op type and a provider are checked against what this server declares (the
Flow's stages, the registered op types, the declared spend providers): a name outside
them is 422 ``invalid_request``. The
body models hold free strings (they are the same for every Flow), so the served schema
gets the names as an ``enum`` at the first request of ``/openapi.json``: a client
generated from it, or a fuzzer, knows which names pass, and that any other is a 422.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from onceflow.models.ops import op_types
from onceflow.settings import Settings
from onceflow.spend.registry import providers
from onceflow.tasks import Flow

#: Body models whose ``stage`` names a stage of the Flow.
STAGE_BODIES = ("EnqueueIn", "FollowUp")
#: Body models whose ``op`` is a typed op (its ``type`` a registered op type).
OP_BODIES = ("OpIn", "ClaimOpIn")
#: Body models whose ``provider`` names a declared spend provider.
PROVIDER_BODIES = ("PermitIn",)


def name_choices(app: FastAPI, flow: Flow, settings: Settings | None = None) -> None:
    """Make ``app``'s schema list ``flow``'s stages, the op types and the providers
    declared under ``settings`` as enums."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # FastAPI's, cached on the app: the choices are added in place
        add_choices(schema, sorted(flow.stages), op_types())
        add_provider_choices(schema, [p.name for p in providers(settings=settings)])
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_choices(schema: dict[str, Any], stages: list[str], ops: list[str]) -> None:
    """Add the ``enum`` of stages and op types to the body models of ``schema`` (idempotent)."""
    models = schema.get("components", {}).get("schemas", {})
    for name in STAGE_BODIES:
        stage = models.get(name, {}).get("properties", {}).get("stage")
        if stage is not None and stages:
            stage["enum"] = stages
            stage.setdefault("description", "A stage the server's Flow declares.")
    for name in OP_BODIES:
        op = models.get(name, {}).get("properties", {}).get("op")
        if op is not None and ops:
            op.setdefault("properties", {})["type"] = {"type": "string", "enum": ops}
            op["required"] = ["type"]


def add_provider_choices(schema: dict[str, Any], names: list[str]) -> None:
    """Add the ``enum`` of declared providers to the permit body of ``schema`` (idempotent;
    none declared: left a free string, every name then 422)."""
    models = schema.get("components", {}).get("schemas", {})
    for name in PROVIDER_BODIES:
        provider = models.get(name, {}).get("properties", {}).get("provider")
        if provider is not None and names:
            provider["enum"] = names
