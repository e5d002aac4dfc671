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
    DatabaseUnavailable,
    InputMismatch,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
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
    elif isinstance(exc, NotFound):
        status, code = 404, "not_found"
    elif isinstance(exc, LeaseLost):
        status, code = 409, "lease_lost"
        detail = f"no live claim on request {exc.request_id} for this token"
    elif isinstance(exc, OpIdConflict):
        status, code = 409, "op_id_conflict"
    elif isinstance(exc, ReplayTooOld):
        status, code = 409, "replay_too_old"
        extra["horizon"] = exc.horizon
    elif isinstance(exc, InputMismatch):
        status, code = 409, "input_mismatch"
    elif isinstance(exc, InvalidTransition):
        status, code = 409, "invalid_transition"
    elif isinstance(exc, PayloadTooLarge):
        status, code = 413, "payload_too_large"
    elif isinstance(exc, UnroutedStatement):
        # A read over every workspace not yet taught about shards: say so, never one shard's.
        status, code = 501, "not_implemented"
        detail = f"not available on a database split by workspace yet: {exc}"
    elif isinstance(exc, InvalidRequest):
        status, code = 422, "invalid_request"
    elif isinstance(exc, UnicodeError):
        # JSON may carry a lone surrogate (\ud800) that no UTF-8 store can hold.
        status, code, detail = 422, "invalid_request", "a string holds a lone surrogate"
    elif isinstance(exc, DatabaseUnavailable | LockUnavailable):
        status, code = 503, "unavailable"
        headers["Retry-After"] = "1"
    else:
        log.error("internal error: %s", type(exc).__name__, exc_info=exc)
        detail = "internal error"
    body = {"detail": one_line(detail), "code": code, **extra}
    return AsciiJSONResponse(body, status, headers=headers)


def _responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "The body is not parseable or not UTF-8, or Content-Length is malformed",
        401: "No key, or an unknown key",
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
