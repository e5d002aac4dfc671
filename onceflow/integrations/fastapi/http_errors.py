"""One error shape for every HTTP error, as the OpenAPI schema documents it.

Every error the API answers is ``{"detail": "<one line>", "code": "<code>"}``
(:class:`~.schemas.ErrorOut`); a validation error (422 ``invalid_request``)
adds ``errors``: ``[{"loc": [...], "msg": "...", "type": "..."}]``, FastAPI's
list without the echoed input. This module renders that shape for FastAPI's and
Starlette's own errors too: a body that cannot be parsed (400), no such route
(404), a method the path does not serve (405, with an ``Allow`` header naming
every method of every route of that path — Starlette names only the first
route's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match

# Codes of the HTTP errors that onceflow's own errors do not raise.
HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    422: "invalid_request",
    429: "rate_limited",
}
MAX_LISTED_ERRORS = 5
PROBED_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped, so an echoed lone surrogate cannot break the body."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode("ascii")


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def field_errors(errors: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pydantic's error dicts as ``{loc, msg, type}`` (no input, no context, one-line msg)."""
    out = []
    for error in errors:
        loc = [part if isinstance(part, int) else str(part) for part in error.get("loc", ())]
        out.append({"loc": loc, "msg": one_line(error.get("msg", "")), "type": error.get("type")})
    return out


def summarize(errors: Sequence[Mapping[str, Any]]) -> str:
    """One line naming the first few errors: ``body.job_id: Input should be …; …``."""
    parts = []
    for error in errors[:MAX_LISTED_ERRORS]:
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else str(error["msg"]))
    more = len(errors) - MAX_LISTED_ERRORS
    if more > 0:
        parts.append(f"and {more} more")
    return one_line("; ".join(parts)) or "invalid request"


def validation_body(errors: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The 422 body of a validation error."""
    listed = field_errors(errors)
    return {"detail": summarize(listed), "code": "invalid_request", "errors": listed}


def validation_error_response(exc: RequestValidationError) -> Response:
    """422 ``invalid_request`` with the field errors, without the echoed input."""
    return _AsciiJSON(validation_body(exc.errors()), 422)


def allowed_methods(routes: Iterable[BaseRoute], scope: Mapping[str, Any]) -> list[str]:
    """Every method that some route serves at the scope's path, sorted.

    Each method is probed through the routes' own ``matches`` on a fresh scope, so
    routes nested in included routers count too.
    """
    routes = list(routes)
    allowed = []
    for method in PROBED_METHODS:
        probe = {
            "type": "http",
            "path": scope.get("path", ""),
            "root_path": scope.get("root_path", ""),
            "method": method,
            "headers": [],
            "query_string": b"",
        }
        if any(route.matches(probe)[0] is Match.FULL for route in routes):
            allowed.append(method)
    return allowed


def http_error_response(request: Request, exc: StarletteHTTPException) -> Response:
    """An HTTP error of FastAPI or Starlette (400, 404, 405, …) in onceflow's shape."""
    status = exc.status_code
    headers = dict(exc.headers or {})
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail, default=str)
    if status == 405:
        allow = allowed_methods(request.app.router.routes, request.scope)
        headers["Allow"] = ", ".join(allow)
        detail = f"{request.method} is not allowed on this path; it serves {', '.join(allow)}"
    code = HTTP_CODES.get(status, "http_error")
    return _AsciiJSON({"detail": one_line(detail), "code": code}, status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Answer FastAPI's and Starlette's own errors in onceflow's shape (``create_app`` does)."""

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)  # noqa: S101 - registered for it
        return http_error_response(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)  # noqa: S101 - registered for it
        return validation_error_response(exc)

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
