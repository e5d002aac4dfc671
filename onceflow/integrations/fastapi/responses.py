"""The API's error answers: onceflow errors and validation failures as JSON bodies
(:class:`~.schemas.ErrorOut`), and the OpenAPI ``responses`` of each route.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse

from onceflow.connector.sharded import UnroutedStatement
from onceflow.errors import (
    AccessDenied,
    BudgetExceeded,
    DatabaseUnavailable,
    InputMismatch,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    LimitsUnavailable,
    LockUnavailable,
    NotFound,
    OpIdConflict,
    PayloadTooLarge,
    ReplayTooOld,
)
from onceflow.integrations.fastapi import schemas as s
from onceflow.integrations.fastapi.http_errors import one_line, validation_body

log = logging.getLogger("onceflow.api")


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an echoed lone surrogate (``\\ud800``) cannot break it."""

    def render(self, content: Any) -> bytes:
        """Encode ``content`` as ASCII-only JSON."""
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def validation_response(exc: RequestValidationError) -> JSONResponse:
    """422 ``{"detail": "<one line>", "code": "invalid_request", "errors": [{loc, msg, type}]}``.

    The input is left out: it may be large, and may hold what JSON cannot carry
    back (NaN, a lone surrogate), which would turn a 422 into a 500.
    """
    return AsciiJSONResponse(jsonable_encoder(validation_body(exc.errors())), 422)


#: The answer to each onceflow error, first match wins (a subclass before its base):
#: (error types, HTTP status, code). AccessDenied is answered apart (its status is its own).
_ANSWERS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], int, str], ...] = (
    (NotFound, 404, "not_found"),
    (LeaseLost, 409, "lease_lost"),
    (OpIdConflict, 409, "op_id_conflict"),
    (ReplayTooOld, 409, "replay_too_old"),
    (InputMismatch, 409, "input_mismatch"),
    (InvalidTransition, 409, "invalid_transition"),
    (PayloadTooLarge, 413, "payload_too_large"),
    # A workspace's spend budget has no room for a provider permit (nothing was reserved).
    (BudgetExceeded, 402, "budget_exceeded"),
    # A read over every workspace not yet taught about shards: say so, never one shard's.
    (UnroutedStatement, 501, "not_implemented"),
    (InvalidRequest, 422, "invalid_request"),
    # JSON may carry a lone surrogate (\ud800) that no UTF-8 store can hold.
    (UnicodeError, 422, "invalid_request"),
    ((DatabaseUnavailable, LockUnavailable, LimitsUnavailable), 503, "unavailable"),
)


def error_response(exc: Exception) -> JSONResponse:
    """The HTTP answer to an onceflow error (the body is :class:`~.schemas.ErrorOut`)."""
    status, code, headers = 500, "internal", {}
    extra: dict[str, Any] = {}
    detail = str(exc)
    if isinstance(exc, AccessDenied):
        status = exc.status
        code = "unauthorized" if status == 401 else "forbidden"
        detail = exc.detail
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
    else:
        answer = next((row[1:] for row in _ANSWERS if isinstance(exc, row[0])), None)
        if answer is None:
            log.error("internal error: %s", type(exc).__name__, exc_info=exc)
            detail = "internal error"
        else:
            status, code = answer
    # What some answers say beyond their code (each type matched its own row above).
    if isinstance(exc, LeaseLost):
        detail = f"no live claim on request {exc.request_id} for this token"
    elif isinstance(exc, ReplayTooOld):
        extra["horizon"] = exc.horizon
    elif isinstance(exc, UnroutedStatement):
        detail = f"not available on a database split by workspace yet: {exc}"
    elif isinstance(exc, BudgetExceeded):
        extra.update(budget_fields(exc))
    elif isinstance(exc, UnicodeError):
        detail = "a string holds a lone surrogate"
    elif status == 503:
        headers["Retry-After"] = "1"
    body = {"detail": one_line(detail), "code": code, **extra}
    return AsciiJSONResponse(body, status, headers=headers)


def budget_fields(exc: BudgetExceeded) -> dict[str, Any]:
    """What a 402 budget_exceeded says beyond its detail: which budget refused, and when a
    ``wait`` budget lets the stage run again (``retry_at``, ``retry_in`` seconds)."""
    return {
        "workspace_id": exc.workspace_id,
        "period": exc.period,
        "on_exceeded": exc.on_exceeded,
        "retry_at": exc.retry_at,
        "retry_in": exc.retry_in,
        "reason": exc.detail,
    }


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "The body is not parseable or not UTF-8, or Content-Length is malformed",
        401: "No key, or an unknown key",
        402: "A spend budget of the workspace has no room for the call (code budget_exceeded; "
        "`on_exceeded`, `retry_at`, `retry_in` say when it may run again)",
        403: "The key is not scoped to this workspace or worker class",
        404: "No such request in this workspace",
        409: "Conflict (lease lost, op id reused, input mismatch)",
        408: "The body did not arrive within ONCEFLOW_API_BODY_TIMEOUT_SECONDS (code "
        "request_timeout; the connection is closed)",
        413: "The body is over the size limit (or a payload over the payload limit)",
        422: "Invalid parameters or body (code invalid_request; `errors` lists each field)",
        429: "Too many requests for this key (code rate_limited); retry after Retry-After",
        503: "Postgres or Redis did not answer",
    }
    return {code: {"model": s.ErrorOut, "description": text[code]} for code in statuses}
