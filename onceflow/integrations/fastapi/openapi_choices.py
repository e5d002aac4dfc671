"""The OpenAPI schema names what the server accepts where a static model cannot.

A stage and an op type are checked against what this server declares (the Flow's
stages, the registered op types): a name outside them is 422 ``invalid_request``. The
body models hold free strings (they are the same for every Flow), so the served schema
gets the names as an ``enum`` at the first request of ``/openapi.json``: a client
generated from it, or a fuzzer, knows which names pass, and that any other is a 422.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from onceflow.models.ops import op_types
from onceflow.tasks import Flow

#: Body models whose ``stage`` names a stage of the Flow.
STAGE_BODIES = ("EnqueueIn", "FollowUp")
#: Body models whose ``op`` is a typed op (its ``type`` a registered op type).
OP_BODIES = ("OpIn", "ClaimOpIn")


def name_choices(app: FastAPI, flow: Flow) -> None:
    """Make ``app``'s schema list ``flow``'s stages and the op types as enums."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # FastAPI's, cached on the app: the choices are added in place
        add_choices(schema, sorted(flow.stages), op_types())
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
