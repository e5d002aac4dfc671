"""HTTP transports for the client SDK: ops travel to onceflow's HTTP API.

::

    from onceflow.oplog import WorkspaceClient
    from onceflow.oplog.http import HttpTransport

    client = WorkspaceClient(HttpTransport("https://api.example", key), "w1", outbox="ops.sqlite")
    client.apply("board", {"type": "node.insert", "node": "a"})

:class:`AsyncHttpTransport` is the same on ``httpx.AsyncClient``, for
:class:`~onceflow.oplog.AsyncWorkspaceClient`. Both build each request and read
each answer with the same functions (:class:`ApiRequest` and the ``*_answer`` readers):
only the sending differs.

When the outcome is unknown — a connection error, a timeout, a 5xx answer, a
malformed 2xx body — it raises :class:`~onceflow.oplog.client.TransportError`,
so the client retries under the *same* op id and the server applies the op
once. A final answer from the server becomes the matching onceflow error (409
op_id_conflict → :class:`OpIdConflict`, …). ``httpx`` (the ``fastapi`` extra) is
imported only when a transport is made. While tracing, each request carries the current
trace (``traceparent``), so the server's ``onceflow.op.apply`` span joins the caller's trace.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import quote

from onceflow import tracing
from onceflow.errors import (
    AccessDenied,
    InvalidRequest,
    LeaseLost,
    NotFound,
    OpIdConflict,
    ReplayTooOld,
)
from onceflow.ids import check_id
from onceflow.oplog.client import TransportError
from onceflow.oplog.store import ApplyResult, OpRecord, SubDoc

if TYPE_CHECKING:
    import httpx

ClientT = TypeVar("ClientT", "httpx.Client", "httpx.AsyncClient")

#: Statuses that say "try again": the request may not have been processed.
RETRYABLE_STATUSES = frozenset({408, 425, 429})


def retry_after_seconds(response: httpx.Response, cap: float) -> float:
    """The server's ``Retry-After`` (delay seconds) as a floor for the next try, at most
    ``cap``; 0 when absent or not a number (an HTTP date is not sent by onceflow's API)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return 0.0
    if math.isnan(seconds):
        return 0.0
    return min(max(seconds, 0.0), cap)


def path_segment(name: str, value: str) -> str:
    """``value`` percent-encoded as one URL path segment; ids with ``/`` cannot be one."""
    check_id(name, value)
    if "/" in value or value in (".", ".."):
        raise InvalidRequest(f"{name} {value!r} cannot travel in a URL path (it holds '/')")
    return quote(value, safe="")


def raise_for_api_error(
    response: httpx.Response,
    *,
    request_id: str = "",
    op_id: str = "",
    sub_doc: str = "",
    base_clock: int | None = None,
) -> None:
    """Raise the onceflow error an API answer stands for (nothing for 1xx-3xx)."""
    status = response.status_code
    if status < 400:
        return
    if status >= 500 or status in RETRYABLE_STATUSES:
        raise TransportError(f"the server answered {status}; the outcome is unknown")
    code, detail, body = "", response.text[:500], None
    with contextlib.suppress(ValueError):
        body = response.json()
    if isinstance(body, dict):
        code = str(body.get("code", ""))
        detail = str(body.get("detail", detail))
    if status in (401, 403):
        raise AccessDenied(status, detail)
    if status == 404:
        raise NotFound(request_id or detail)
    if status == 409 and code == "lease_lost":
        raise LeaseLost(request_id, detail)
    if status == 409 and code == "op_id_conflict":
        raise OpIdConflict(op_id, sub_doc)
    if status == 409 and code == "replay_too_old":
        horizon = body.get("horizon") if isinstance(body, dict) else None
        raise ReplayTooOld(op_id, base_clock, int(horizon) if isinstance(horizon, int) else 0)
    raise InvalidRequest(f"{status} {code or 'error'}: {detail}")


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One request of the HTTP API: what a transport sends (sync or async)."""

    method: str
    url: str
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)


def _sub_doc_url(workspace_id: str, sub_doc: str) -> str:
    return (
        f"/v1/workspaces/{path_segment('workspace_id', workspace_id)}"
        f"/sub-docs/{path_segment('sub_doc', sub_doc)}"
    )


def apply_request(
    workspace_id: str, sub_doc: str, op: dict[str, Any], op_id: str, base_clock: int | None
) -> ApiRequest:
    """``POST …/ops`` with the op, its id and its base clock."""
    body = {"op_id": op_id, "op": op, "base_clock": base_clock}
    return ApiRequest("POST", _sub_doc_url(workspace_id, sub_doc) + "/ops", json=body)


def apply_result(data: dict[str, Any]) -> ApplyResult:
    """An op's result as the API writes it (JSON) — ``KeyError`` and friends when malformed."""
    return ApplyResult(
        workspace_id=data["workspace_id"],
        sub_doc=data["sub_doc"],
        op_id=data["op_id"],
        clock=data["clock"],
        duplicate=bool(data["duplicate"]),
        result=data["result"],
        error=data["error"],
        committed_at=datetime.fromisoformat(data["committed_at"]),
    )


def apply_answer(
    response: httpx.Response, sub_doc: str, op_id: str, base_clock: int | None
) -> ApplyResult:
    """The op's result; a replay answers with the original clock (``duplicate=True``)."""
    raise_for_api_error(response, op_id=op_id, sub_doc=sub_doc, base_clock=base_clock)
    try:
        return apply_result(response.json())
    except (ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"malformed answer ({type(exc).__name__})") from exc


def sub_doc_answer(response: httpx.Response, sub_doc: str) -> SubDoc:
    """The sub-doc of a ``GET …/sub-docs/{sub_doc}`` answer."""
    raise_for_api_error(response, sub_doc=sub_doc)
    data = response.json()
    return SubDoc(data["workspace_id"], data["sub_doc"], data["clock"], data["state"])


def ops_since_answer(response: httpx.Response, sub_doc: str) -> list[OpRecord]:
    """The ops of a ``GET …/ops?since=`` answer."""
    raise_for_api_error(response, sub_doc=sub_doc)
    return [
        OpRecord(
            op_id=o["op_id"],
            clock=o["clock"],
            op_type=o["op_type"],
            payload=o["payload"],
            result=o["result"],
            fence=o["fence"],
            committed_at=datetime.fromisoformat(o["committed_at"]),
        )
        for o in response.json()["ops"]
    ]


class _ApiClient(Generic[ClientT]):
    """What both transports hold: an ``httpx`` client (theirs, or one made here) and the key."""

    _client_class: str  # the httpx class made when no client is given

    def __init__(
        self,
        base_url: str,
        key: str,
        *,
        timeout: float = 10.0,
        client: ClientT | None = None,
    ) -> None:
        import httpx

        self._httpx = httpx
        made = getattr(httpx, self._client_class)
        self._client: ClientT = client or made(base_url=base_url, timeout=timeout)
        self._owns_client = client is None
        self._headers = {"Authorization": f"Bearer {key}"}

    def _arguments(self, req: ApiRequest) -> dict[str, Any]:
        headers = self._headers
        if tracing.active():
            # The current trace goes with the request in W3C headers, what the API reads
            # (never the application's baggage): the server's apply joins the caller's trace.
            headers = {**headers, **tracing.current_headers()}
        return {
            "method": req.method,
            "url": req.url,
            "headers": headers,
            "json": req.json,
            "params": req.params,
        }

    @contextlib.contextmanager
    def _unknown_outcome(self) -> Iterator[None]:
        # No answer (connection error, timeout): the op may or may not have been applied.
        try:
            yield
        except self._httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: the outcome is unknown") from exc


class HttpTransport(_ApiClient["httpx.Client"]):
    """Sends ops to ``POST /v1/workspaces/{ws}/sub-docs/{sub_doc}/ops`` with an API key."""

    _client_class = "Client"

    def _send(self, req: ApiRequest) -> httpx.Response:
        with self._unknown_outcome():
            return self._client.request(**self._arguments(req))

    # Transport.apply's signature (alike by shape): the protocol's method, spelled out.
    def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        op: dict[str, Any],
        op_id: str,
        base_clock: int | None,
    ) -> ApplyResult:
        """Send one op; a replay answers with the original clock (``duplicate=True``)."""
        response = self._send(apply_request(workspace_id, sub_doc, op, op_id, base_clock))
        return apply_answer(response, sub_doc, op_id, base_clock)

    def get_sub_doc(self, workspace_id: str, sub_doc: str) -> SubDoc:
        """The sub-doc's state and clock, read over HTTP."""
        response = self._send(ApiRequest("GET", _sub_doc_url(workspace_id, sub_doc)))
        return sub_doc_answer(response, sub_doc)

    def ops_since(self, workspace_id: str, sub_doc: str, clock: int = 0) -> list[OpRecord]:
        """Applied ops after ``clock``, over HTTP (a reconnecting client catches up)."""
        url = _sub_doc_url(workspace_id, sub_doc) + "/ops"
        response = self._send(ApiRequest("GET", url, params={"since": clock}))
        return ops_since_answer(response, sub_doc)

    def close(self) -> None:
        """Close the HTTP client if this transport made it."""
        if self._owns_client:
            self._client.close()


class AsyncHttpTransport(_ApiClient["httpx.AsyncClient"]):
    """:class:`HttpTransport` on ``httpx.AsyncClient``: the same requests and answers, awaited."""

    _client_class = "AsyncClient"

    async def _send(self, req: ApiRequest) -> httpx.Response:
        with self._unknown_outcome():
            return await self._client.request(**self._arguments(req))

    # HttpTransport's methods awaited (alike by shape): one send of the shared request each.
    async def apply(
        self,
        workspace_id: str,
        sub_doc: str,
        op: dict[str, Any],
        op_id: str,
        base_clock: int | None,
    ) -> ApplyResult:
        """:meth:`HttpTransport.apply`, awaited."""
        response = await self._send(apply_request(workspace_id, sub_doc, op, op_id, base_clock))
        return apply_answer(response, sub_doc, op_id, base_clock)

    async def get_sub_doc(self, workspace_id: str, sub_doc: str) -> SubDoc:
        """:meth:`HttpTransport.get_sub_doc`, awaited."""
        response = await self._send(ApiRequest("GET", _sub_doc_url(workspace_id, sub_doc)))
        return sub_doc_answer(response, sub_doc)

    async def ops_since(self, workspace_id: str, sub_doc: str, clock: int = 0) -> list[OpRecord]:
        """:meth:`HttpTransport.ops_since`, awaited."""
        url = _sub_doc_url(workspace_id, sub_doc) + "/ops"
        response = await self._send(ApiRequest("GET", url, params={"since": clock}))
        return ops_since_answer(response, sub_doc)

    async def aclose(self) -> None:
        """Close the HTTP client if this transport made it."""
        if self._owns_client:
            await self._client.aclose()
