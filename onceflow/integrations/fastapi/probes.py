"""``GET /healthz`` and ``GET /readyz``: the probes of ``onceflow api`` (Kubernetes'
liveness and readiness), unauthenticated and outside every rate limit.

``/healthz`` answers 200 while the process serves requests, and checks nothing else:
a liveness probe that restarts the API because Postgres is down would not bring
Postgres back. ``/readyz`` answers 200 when the database (every shard) answers, is at
the package's migration head and Redis answers, 503 naming the failing checks
otherwise (:mod:`onceflow.health`), each check bounded by
``ONCEFLOW_PROBE_TIMEOUT_SECONDS``. Neither answer carries a URL, host or password.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from onceflow.health import liveness, readiness_probe

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.services import OnceflowServices


class HealthOut(BaseModel):
    """The process is alive."""

    status: Literal["alive"]


class CheckOut(BaseModel):
    """One readiness check."""

    ok: bool
    detail: str = Field(description='"ok", or why the check failed (never a URL or secret).')


class ReadinessOut(BaseModel):
    """Every readiness check by name: ``database``, ``migrations``, ``redis``."""

    status: Literal["ready", "not ready"]
    checks: dict[str, CheckOut]


def probes_router(services: OnceflowServices) -> APIRouter:
    """``GET /healthz`` and ``GET /readyz`` on the databases and Redis of ``services``."""
    router = APIRouter(tags=["probes"])
    probe = readiness_probe(services.settings)

    @router.get(
        "/healthz",
        operation_id="healthz",
        response_model=HealthOut,
        summary="Liveness: the process serves requests (checks nothing else)",
    )
    async def healthz() -> JSONResponse:
        return JSONResponse(liveness())

    @router.get(
        "/readyz",
        operation_id="readyz",
        response_model=ReadinessOut,
        responses={503: {"model": ReadinessOut, "description": "A check failed (named)"}},
        summary="Readiness: Postgres and Redis answer, the database is at the migration head",
    )
    async def readyz() -> JSONResponse:
        # The checks block (each in its own thread, within the probe timeout): off the loop.
        readiness = await run_in_threadpool(probe)
        return JSONResponse(readiness.body(), status_code=200 if readiness.ready else 503)

    return router
