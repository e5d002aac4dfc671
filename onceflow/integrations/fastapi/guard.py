"""The route classes that guard onceflow's routes before FastAPI parses the body.

The ``/v1`` routes: the key is authenticated, its rate limit charged and its scope
checked, in that order. The operator routes (dashboard, ``/metrics``,
:func:`operator_route_class`): the operator key is authenticated, its rate limit charged
and its role checked (:mod:`~onceflow.integrations.fastapi.operators`). Every refusal is
in the API's error shape.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from onceflow.errors import AccessDenied, InvalidRequest, OnceflowError
from onceflow.integrations.fastapi.auth import Authenticator, Principal, bearer_key
from onceflow.integrations.fastapi.http_errors import http_error_response
from onceflow.integrations.fastapi.operators import Operator, role_for
from onceflow.integrations.fastapi.ratelimit import RateLimited
from onceflow.integrations.fastapi.responses import error_response, validation_response
from onceflow.integrations.fastapi.services import OnceflowServices


async def guarded_call(
    request: Request,
    authorize: Callable[[], Coroutine[Any, Any, None]],
    handler: Callable[[Request], Coroutine[Any, Any, Response]],
) -> Response:
    """``authorize()`` then ``handler(request)``; every refusal in the API's error shape."""
    try:
        await authorize()
        return await handler(request)
    except RateLimited as exc:
        return exc.response()
    except (OnceflowError, UnicodeError) as exc:
        return error_response(exc)
    except RequestValidationError as exc:
        return validation_response(exc)
    except StarletteHTTPException as exc:  # e.g. 400: the body cannot be parsed
        return http_error_response(request, exc)


def _route_class(services: OnceflowServices) -> type[APIRoute]:
    """Routes that check the key and its scope before FastAPI parses the body."""

    class OnceflowRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            kind = "workspace" if "{ws}" in self.path else "wc" if "{wc}" in self.path else "claim"

            async def guarded(request: Request) -> Response:
                async def authorize() -> None:
                    request.state.onceflow_principal = await services.rate_limits.authorize(
                        request,
                        lambda: _authenticate(services.auth, request),
                        lambda principal: _permit(principal, request, kind),
                    )

                return await guarded_call(request, authorize, handler)

            return guarded

    return OnceflowRoute


def _authenticate(auth: Authenticator, request: Request) -> Principal:
    principal = auth.authenticate(bearer_key(request))
    if principal is None:
        raise AccessDenied(401, "unknown key")
    return principal


def _permit(principal: Principal, request: Request, kind: str) -> None:
    """403 unless the key may use the path's workspace / worker class (checked after the
    key's rate limit is charged: a refused request uses its budget too)."""
    params = request.path_params
    if kind == "workspace" and not principal.may_use_workspace(params["ws"]):
        raise AccessDenied(403, "this key is not scoped to that workspace")
    if kind == "wc" and not principal.may_work(params["wc"]):
        raise AccessDenied(403, "this key is not a worker key of that worker class")
    if kind == "claim" and not principal.is_worker:
        raise AccessDenied(403, "claims need a worker key")


async def authorize_operator(services: OnceflowServices, request: Request, role: str) -> Operator:
    """The request's operator if its key has ``role``; AccessDenied (401/403) or RateLimited.

    Failed authentications count against ``ONCEFLOW_API_AUTH_FAILURE_LIMIT`` per address,
    and an operator's requests against ``ONCEFLOW_API_RATE_LIMIT`` per key — those refused
    for their role (403) too: the role is checked after the key's limit is charged.
    """
    found: list[Operator] = []

    def authenticate() -> Principal:
        operator = services.operator_auth.authenticate(bearer_key(request))
        if operator is None:
            raise AccessDenied(401, "unknown operator key")
        found.append(operator)
        return operator.as_principal()

    def permit(_: Principal) -> None:
        if not found[0].may(role):
            raise AccessDenied(403, f"this operator key does not have the {role!r} role")

    await services.rate_limits.authorize(request, authenticate, permit)
    request.state.onceflow_operator = found[0]
    return found[0]


def request_operator(request: Request) -> Operator:
    """The operator :func:`operator_route_class` checked for ``request``."""
    found = getattr(request.state, "onceflow_operator", None)
    if not isinstance(found, Operator):  # the route class always sets it
        raise InvalidRequest("no operator key was checked for this route")
    return found


def readable(operator: Operator, workspace_id: str) -> None:
    """403 unless the operator's key may read ``workspace_id`` (a key limited to some
    workspaces named another one); nothing is read or changed before this check."""
    if not operator.may_read(workspace_id):
        raise AccessDenied(403, "this operator key is not scoped to that workspace")


def operator_route_class(services: OnceflowServices) -> type[APIRoute]:
    """Routes that check the operator key and role before the handler (or body parsing) runs."""

    class OperatorRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                async def authorize() -> None:
                    await authorize_operator(services, request, role_for(request.method))

                return await guarded_call(request, authorize, handler)

            return guarded

    return OperatorRoute
