# About 400 lines: the dashboard's data routes and their snapshot producer, one router.
"""The dashboard: a static page on ``GET /dashboard`` and its operator-keyed data routes.

The page (``dashboard_static/``: HTML, JavaScript modules, CSS, no build) holds no data and
needs no key: it asks the operator for one, keeps it in ``sessionStorage`` and sends it as
``Authorization: Bearer`` (never in a URL). The data routes, guarded by
:func:`~onceflow.integrations.fastapi.guard.operator_route_class` (GET: viewer, POST:
admin; no login-less mode):

* ``GET /dashboard/api/snapshot`` — one snapshot (see :mod:`onceflow.queue.overview`),
  sharing the producer's compute in flight; 503 if it has not answered after
  :data:`SNAPSHOT_TIMEOUT_SECONDS`;
* ``GET /dashboard/api/stream`` — Server-Sent Events, ``event: snapshot`` each time the
  snapshot changes. ONE producer per API process (per event loop) computes it at most every
  :data:`INTERVAL_SECONDS` while at least one stream is open, and only then; every stream
  gets the latest snapshot (a slow reader skips to the newest, it never queues more than
  one). A compute that has not answered after :data:`SNAPSHOT_TIMEOUT_SECONDS` (a database
  that stopped answering) sends ``event: problem`` and is awaited again, never doubled: no
  second compute starts while it runs, and the stream recovers when it answers. The
  producer never starts computes more often than the last one took. At most
  :data:`MAX_STREAMS` streams per process and :data:`MAX_STREAMS_PER_KEY` per operator key
  (or ``ONCEFLOW_API_SSE_MAX_PER_KEY`` if lower; one key cannot take every stream of a
  process): past that, 429;
* ``GET /dashboard/api/requests/{id}`` (optional ``?workspace_id=``) — one request, whole
  (:func:`onceflow.queue.detail.read_request`): its row, history and attempts, hand-offs,
  ops, compute-lock outcomes, spend and the actions the key may take; the input, result
  and error only to a key that may read the workspace (else ``withheld``); 404 for an
  unknown id;
* ``GET /dashboard/api/requests`` — search: filters (workspace, job, branch, stage,
  worker_class, status, since/until on created_at), ``q`` (a pasted request id, its hex
  prefix, or a job id), newest first, keyset pages (``limit`` at most 200, ``cursor`` the
  previous page's ``next``); every shard asked and merged (:mod:`onceflow.queue.search`);
* ``GET /dashboard/api/series`` — the time series of the sweeper's rollup over the last
  hour, day or week, with the spend budgets (:mod:`onceflow.queue.series`);
* a key limited to some workspaces sees the others' dead rows in the snapshot and stream
  without their error summary, and no savings of theirs; search lists only its
  workspaces' requests (a ``workspace`` filter outside them: 403); the series' spend by
  workspace and budgets are of its workspaces only;
* (a key limited to some workspaces acts only with the row's ``workspace_id``, one of its
  own: else 422 / 403);
* ``POST /dashboard/api/requests/{id}/requeue`` — fenced: body ``{"version": <the row's
  updated_at as shown>}``; only that dead or cancelled row moves, anything else is 409
  ``changed`` and the row is left as it is; the wake-up is sent after;
* ``POST /dashboard/api/requests/{id}/cancel`` — fenced :meth:`Queue.cancel`: body
  ``{"run": <a running row's run as shown>}`` (the run's identity: a heartbeat moves
  updated_at) or ``{"version": <a queued row's updated_at as shown>}``; that running run is
  asked to stop, that queued row is cancelled; anything else (finished, another run, a
  changed row) is 409 ``changed`` and unchanged.

Every action is logged (logger ``onceflow.dashboard``) with the operator key's id, never
the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine
from starlette.responses import JSONResponse, Response, StreamingResponse

from onceflow.errors import InvalidRequest, InvalidTransition, OnceflowError
from onceflow.ids import check_id
from onceflow.integrations.fastapi.events import StreamLimit, too_many_streams
from onceflow.integrations.fastapi.guard import operator_route_class, readable, request_operator
from onceflow.integrations.fastapi.operators import ADMIN, Operator
from onceflow.integrations.fastapi.schemas import RequestIdPath, WorkspaceIdStr
from onceflow.locks.savings import read_savings
from onceflow.loops import PerLoop
from onceflow.models import Dispatch, Status
from onceflow.queue import Queue
from onceflow.queue import search as request_search
from onceflow.queue import series as request_series
from onceflow.queue.detail import read_request
from onceflow.queue.overview import read_tables, stop_already_requested
from onceflow.redis_clients import REDIS_OR_OS_ERRORS

if TYPE_CHECKING:
    from onceflow.integrations.fastapi.services import OnceflowServices

log = logging.getLogger("onceflow.dashboard")

STATIC: Final = Path(__file__).with_name("dashboard_static")
INTERVAL_SECONDS: Final = 1.0
MAX_STREAMS: Final = 64
MAX_STREAMS_PER_KEY: Final = 8  # a few tabs per operator, well below MAX_STREAMS
KEEPALIVE_SECONDS: Final = 15.0
SNAPSHOT_TIMEOUT_SECONDS: Final = 5.0
# The page's files: JavaScript modules (no build step) and one stylesheet. A module is only
# run when served as JavaScript, so each is listed with its media type.
_ASSETS: Final = {
    **{
        f"{name}.js": "text/javascript; charset=utf-8"
        for name in (
            "dashboard",
            "util",
            "actions",
            "overview",
            "charts",
            "series",
            "search",
            "request",
        )
    },
    "dashboard.css": "text/css; charset=utf-8",
}
_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# Fields that change with the clock alone: a snapshot differing only in these is not re-sent
# (the page counts them on from the last snapshot).
_VOLATILE: Final = ("db_now", "oldest_queued_age_seconds")


def compute_snapshot(services: OnceflowServices) -> dict[str, Any]:
    """The tables' state, plus the Redis savings (an error there is reported, not raised)."""
    engines = [shard.engine for shard in services.queue.shards()]  # every shard, merged
    snapshot = read_tables(engines, count_cap=services.settings.metrics_count_cap)
    try:
        snapshot["savings"] = read_savings(services.oplog.redis())
    except REDIS_OR_OS_ERRORS as exc:
        snapshot["savings"] = {"error": f"Redis: {type(exc).__name__}"}
    return snapshot


def scoped_snapshot(snapshot: dict[str, Any], operator: Operator) -> dict[str, Any]:
    """``snapshot`` as ``operator`` may see it: the snapshot is computed once for every key;
    a key limited to some workspaces gets other workspaces' dead rows without their error
    summary (None: the request's payload) and the savings of its own workspaces only."""
    if operator.workspaces is None:
        return snapshot
    scoped = dict(snapshot)
    if "dead" in snapshot:
        scoped["dead"] = [
            row if operator.may_read(row["workspace_id"]) else {**row, "error": None}
            for row in snapshot["dead"]
        ]
    savings = snapshot.get("savings")
    if isinstance(savings, dict) and "workspaces" in savings:
        mine = [row for row in savings["workspaces"] if operator.may_read(row["workspace_id"])]
        # The totals count the key's workspaces, not every workspace: when every workspace
        # was read, its own are all here; when not, how many of its own were left out is
        # not known (None), only that some may have been.
        truncated = bool(savings.get("truncated"))
        scoped["savings"] = {
            **savings,
            "workspaces": mine,
            "workspaces_total": None if truncated else len(mine),
            "truncated": truncated,
        }
    return scoped


def _engines_of(queue: Queue, workspace_id: str | None) -> list[Engine]:
    """The engine of ``workspace_id``'s shard; every shard's when it is not known."""
    shards = queue.shards()
    if workspace_id is not None and queue.shard_map is not None:
        return [shards[queue.shard_map.shard_of(workspace_id)].engine]
    return [shard.engine for shard in shards]


def _stable(snapshot: dict[str, Any]) -> str:
    """The snapshot without what changes by the clock alone: what 'changed' compares."""
    rest = {k: v for k, v in snapshot.items() if k not in _VOLATILE}
    rest["running"] = [
        {k: v for k, v in r.items() if k != "lease_seconds_left"}
        for r in snapshot.get("running", [])
    ]
    return json.dumps(rest, sort_keys=True, default=str)


class _Stream:
    """One open stream: the latest event not yet sent (older ones are replaced). A snapshot
    is kept as computed and rendered for the stream's key when it is sent."""

    def __init__(self, operator: Operator) -> None:
        self.operator = operator
        self.key_id = operator.key_id
        self.queue: asyncio.Queue[str | dict[str, Any]] = asyncio.Queue(maxsize=1)

    def offer(self, event: str | dict[str, Any]) -> None:
        with contextlib.suppress(asyncio.QueueEmpty):
            self.queue.get_nowait()  # a slow reader skips to the newest snapshot
        self.queue.put_nowait(event)

    async def next_event(self) -> str:
        """The next event's text (waits for one)."""
        return self.render(await self.queue.get())

    def render(self, event: str | dict[str, Any]) -> str:
        """An event's text: a snapshot as this stream's key may see it, a problem as is."""
        if isinstance(event, str):
            return event
        shown = scoped_snapshot(event, self.operator)
        return "event: snapshot\ndata: " + json.dumps(shown, default=str) + "\n\n"


class SnapshotTimeout(Exception):
    """The snapshot's compute has not answered in time (it keeps running; nothing is doubled)."""


class SnapshotHub:
    """One snapshot producer for every stream of an event loop, running only while watched."""

    def __init__(
        self,
        compute: Callable[[], dict[str, Any]],
        *,
        interval: float = INTERVAL_SECONDS,
        timeout: float = SNAPSHOT_TIMEOUT_SECONDS,
        max_streams: int = MAX_STREAMS,
        max_per_key: int = MAX_STREAMS_PER_KEY,
    ) -> None:
        self._compute = compute
        self._interval = interval
        self._timeout = timeout
        self._pending: asyncio.Future[tuple[dict[str, Any], float]] | None = None
        self._max_streams = max_streams
        self._max_per_key = max_per_key
        self._streams: set[_Stream] = set()
        self._task: asyncio.Task[None] | None = None
        # (stable form, event): a snapshot as computed (each stream renders it for its key)
        # or a problem's text.
        self._last: tuple[str, str | dict[str, Any]] | None = None
        self.computed = 0  # snapshots computed (how often the producer ran)

    def open(self, operator: Operator) -> _Stream:
        """Join; StreamLimit past the bounds. The latest snapshot (if any) is sent at once."""
        if len(self._streams) >= self._max_streams:
            raise StreamLimit("too many open dashboard streams in this process", self._max_streams)
        if sum(s.key_id == operator.key_id for s in self._streams) >= self._max_per_key:
            raise StreamLimit("too many open dashboard streams for this key", self._max_per_key)
        stream = _Stream(operator)
        self._streams.add(stream)
        if self._last is not None:
            stream.offer(self._last[1])
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return stream

    def close(self, stream: _Stream) -> None:
        """Leave (the producer stops after its current round when nobody watches)."""
        self._streams.discard(stream)

    def _timed(self) -> tuple[dict[str, Any], float]:
        start = time.monotonic()
        return self._compute(), time.monotonic() - start

    async def fresh(self) -> tuple[dict[str, Any], float]:
        """(snapshot, seconds it took): the compute in flight, or a new one.

        Raises :class:`SnapshotTimeout` if it has not answered after the timeout; the
        compute keeps running (in its thread, which cannot be interrupted) and the next
        call waits for that same one instead of starting another.
        """
        if self._pending is None:
            loop = asyncio.get_running_loop()
            # Not run_in_threadpool: a timeout must be able to stop *waiting* for it.
            pending = self._pending = loop.run_in_executor(None, self._timed)
            pending.add_done_callback(self._clear)
        done, _ = await asyncio.wait({self._pending}, timeout=self._timeout)
        if not done:
            raise SnapshotTimeout(f"the database has not answered in {self._timeout:g} s")
        return done.pop().result()

    def _clear(self, fut: asyncio.Future[tuple[dict[str, Any], float]]) -> None:
        if self._pending is fut:
            self._pending = None
        if not fut.cancelled():
            fut.exception()  # retrieved: an unawaited failure is not logged as lost

    async def _run(self) -> None:
        while self._streams:
            took = 0.0
            try:
                snapshot, took = await self.fresh()
                self.computed += 1
                stable = _stable(snapshot)
                event: str | dict[str, Any] = snapshot
            except SnapshotTimeout as exc:  # a stalled database: say so, keep waiting for it
                stable = event = "event: problem\ndata: " + json.dumps(
                    {"detail": f"snapshot timed out: {exc}"}
                ) + "\n\n"  # fmt: skip
            except OnceflowError as exc:  # e.g. the database is down: say so, keep streaming
                stable = event = "event: problem\ndata: " + json.dumps(
                    {"detail": f"snapshot failed: {type(exc).__name__}"}
                ) + "\n\n"  # fmt: skip
            except Exception as exc:  # never kill the producer of every stream
                log.error("dashboard snapshot failed: %s", type(exc).__name__, exc_info=exc)
                stable = event = 'event: problem\ndata: {"detail": "snapshot failed"}\n\n'
            if self._last is None or self._last[0] != stable:
                self._last = (stable, event)
                for stream in list(self._streams):
                    stream.offer(event)
            # Never more often than the last compute took (a slow database is not piled on).
            await asyncio.sleep(max(self._interval, took))
        self._last = None  # nobody watched: the next stream waits for a fresh snapshot


async def _events(hub: SnapshotHub, stream: _Stream) -> AsyncIterator[str]:
    try:
        yield ": connected\n\n"
        while True:
            try:
                # Rendered for this stream's key at send time (one shared compute).
                yield await asyncio.wait_for(stream.next_event(), KEEPALIVE_SECONDS)
            except TimeoutError:
                yield ": keep-alive\n\n"
    finally:
        hub.close(stream)


# Fields alike by shape to the settings' on purpose: each its own bounds and documented text.
class ActionIn(BaseModel):
    """An operator's action on one request."""

    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(
        default=None,
        max_length=64,
        description="The row's `version` as the snapshot showed it (its updated_at): "
        "required to requeue, or to cancel a queued row; the action is refused (409) if the "
        "row changed since.",
    )
    run: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="A running row's `run` as the snapshot showed it (the run's identity): "
        "to cancel it; refused (409) if that run ended or another took its place.",
    )
    workspace_id: WorkspaceIdStr | None = Field(
        default=None,
        description="The row's `workspace_id` as the snapshot showed it: the request is found "
        "by its key (workspace, id), not by its id alone; another workspace is 404.",
    )


def _in_scope(operator: Operator, workspace_id: str | None) -> str:
    """The operator's key id, if it may act on ``workspace_id``'s requests: a key limited to
    some workspaces names the row's workspace (the statement then finds the row by its key,
    in that workspace only) and it must be one of its own."""
    if operator.workspaces is not None:
        if workspace_id is None:
            raise InvalidRequest(
                "this operator key is limited to some workspaces: send the row's workspace_id"
            )
        readable(operator, workspace_id)
    return operator.key_id


def _version(value: str | None) -> datetime:
    if value is None:
        raise InvalidRequest("version is required: the row's version as the dashboard showed it")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest("version must be an ISO 8601 timestamp with a zone") from None
    if parsed.tzinfo is None:
        raise InvalidRequest("version must be an ISO 8601 timestamp with a zone")
    return parsed


def _changed(request_id: str, detail: str) -> JSONResponse:
    body = {"detail": f"request {request_id}: {detail}", "code": "changed"}
    return JSONResponse(body, status_code=409)


def _page(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=_HEADERS)


def create_dashboard_router(services: OnceflowServices) -> APIRouter:
    """``/dashboard`` (the page) and ``/dashboard/api/…`` (operator keys) for ``services``."""
    svc = services
    hubs: PerLoop[SnapshotHub] = PerLoop()  # pruned of closed loops (a weak table kept them)

    def hub() -> SnapshotHub:
        found = hubs.get()
        if found is None:
            per_key = min(MAX_STREAMS_PER_KEY, svc.settings.api_sse_max_per_key)
            found = hubs.setdefault(
                lambda: SnapshotHub(lambda: compute_snapshot(svc), max_per_key=per_key)
            )
        return found

    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    def page() -> Response:
        return _page("index.html", "text/html; charset=utf-8")

    for name, media in _ASSETS.items():
        router.add_api_route(
            f"/dashboard/{name}",
            lambda name=name, media=media: _page(name, media),
            methods=["GET"],
            include_in_schema=False,
        )

    # Not in /openapi.json: that schema documents the API of API and worker keys (and is
    # checked against it); these routes take operator keys and are described in
    # docs/dashboard.md.
    api = APIRouter(
        prefix="/dashboard/api", route_class=operator_route_class(svc), include_in_schema=False
    )

    @api.get("/snapshot", operation_id="dashboard_snapshot")
    async def snapshot(request: Request) -> JSONResponse:
        """Queue depth, oldest queued, running and dead requests, savings, op-log rate."""
        operator = request_operator(request)
        try:
            found, _took = await hub().fresh()
        except SnapshotTimeout as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        shown = scoped_snapshot(found, operator)
        return JSONResponse(shown, headers={"Cache-Control": "no-store"})

    @api.get("/stream", operation_id="dashboard_stream", response_class=Response)
    async def stream(request: Request) -> Response:
        """Server-Sent Events: ``event: snapshot`` (JSON) whenever the snapshot changes."""
        the_hub = hub()
        try:
            opened = the_hub.open(request_operator(request))
        except StreamLimit as exc:
            return too_many_streams(exc)
        return StreamingResponse(
            _events(the_hub, opened),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @api.get("/requests/{request_id}", operation_id="dashboard_request")
    def request_detail(
        request_id: RequestIdPath,
        request: Request,
        workspace_id: Annotated[WorkspaceIdStr | None, Query()] = None,
    ) -> JSONResponse:
        """One request, whole: row, history, attempts, hand-offs, ops, locks, spend, actions."""
        operator = request_operator(request)
        check_id("request_id", request_id)
        found = read_request(
            _engines_of(svc.queue, workspace_id),
            request_id,
            workspace_id=workspace_id,
            readable=operator.may_read,
            may_act=operator.may(ADMIN),
        )
        return JSONResponse(found, headers={"Cache-Control": "no-store"})

    @api.get("/requests", operation_id="dashboard_requests")
    def requests(  # one argument per documented filter
        request: Request,
        workspace: str | None = None,
        job: str | None = None,
        branch: str | None = None,
        stage: str | None = None,
        worker_class: str | None = None,
        status: str | None = None,
        since: str | None = None,
        until: str | None = None,
        q: str | None = None,
        cursor: str | None = Query(default=None, max_length=1000),
        limit: int = Query(default=request_search.LIMIT_DEFAULT, ge=1, le=request_search.LIMIT_MAX),
    ) -> JSONResponse:
        """Requests matching the filters, newest first, one page (``next``: the cursor)."""
        operator = request_operator(request)
        if workspace is not None:
            check_id("workspace", workspace)
            readable(operator, workspace)
        filters = request_search.Filters(
            workspace=workspace, job=job, branch=branch, stage=stage,
            worker_class=worker_class, status=status,
            since=request_search.parse_time("since", since),
            until=request_search.parse_time("until", until),
            q=q.strip() if q is not None else None, scope=operator.workspaces,
        )  # fmt: skip
        found = request_search.search(
            _engines_of(svc.queue, workspace), filters, limit=limit, cursor=cursor
        )
        return JSONResponse(found, headers={"Cache-Control": "no-store"})

    @api.get("/series", operation_id="dashboard_series")
    def series(
        request: Request,
        range: str = "hour",  # the documented parameter's name
        worker_class: str | None = None,
        stage: str | None = None,
    ) -> JSONResponse:
        """The rollup's buckets over the range, spend by provider and workspace, budgets
        (spend by workspace and budgets: of the workspaces the key may read)."""
        engines = [shard.engine for shard in svc.queue.shards()]
        scope = request_operator(request).workspaces
        found = request_series.read_series(
            engines, range, worker_class=worker_class, stage=stage, scope=scope
        )
        return JSONResponse(found, headers={"Cache-Control": "no-store"})

    @api.post("/requests/{request_id}/requeue", operation_id="dashboard_requeue")
    def requeue(request_id: RequestIdPath, body: ActionIn, request: Request) -> Response:
        """Run a dead or cancelled request again, if it is still as the operator saw it."""
        who = _in_scope(request_operator(request), body.workspace_id)
        check_id("request_id", request_id)
        expect = _version(body.version)
        try:
            done = svc.queue.requeue(request_id, expect=expect, workspace_id=body.workspace_id)
        except InvalidTransition as exc:
            log.info("dashboard: operator %s: requeue of %s refused (%s)", who, request_id, exc)
            return _changed(request_id, f"it is {exc.status} and changed since it was shown")
        svc.flow.dispatch(
            Dispatch(done.request_id, done.stage, done.worker_class, done.workspace_id)
        )
        log.info("dashboard: operator %s requeued request %s", who, request_id)
        return JSONResponse(
            {
                "request_id": request_id,
                "status": done.status.value,
                "version": done.updated_at.isoformat(),
            }
        )

    @api.post("/requests/{request_id}/cancel", operation_id="dashboard_cancel")
    def cancel(request_id: RequestIdPath, body: ActionIn, request: Request) -> Response:
        """Cancel a queued request, or ask a running one to stop, if it is still as shown."""
        who = _in_scope(request_operator(request), body.workspace_id)
        check_id("request_id", request_id)
        if body.run is None and body.version is None:
            raise InvalidRequest("run (a running row's) or version (a queued row's) is required")
        expect = _version(body.version) if body.version is not None else None
        try:
            done = svc.queue.cancel(
                request_id, expect=expect, expect_run=body.run, workspace_id=body.workspace_id
            )
        except InvalidTransition as exc:
            if body.run is not None and stop_already_requested(
                _engines_of(svc.queue, body.workspace_id),
                request_id,
                body.run,
                workspace_id=body.workspace_id,
            ):
                # Asked to stop already (another click, another operator): nothing new to do
                # and nothing changed; what the operator wanted holds, so 200, not a conflict.
                log.info("dashboard: operator %s: cancel of %s: stop already requested", who,
                         request_id)  # fmt: skip
                current = svc.queue.get(request_id, workspace_id=body.workspace_id)
                return JSONResponse(
                    {
                        "request_id": request_id,
                        "status": current.status.value,
                        "cancel_requested": True,
                        "already_requested": True,
                        "version": current.updated_at.isoformat(),
                    }
                )
            log.info("dashboard: operator %s: cancel of %s refused (%s)", who, request_id, exc)
            return _changed(request_id, f"it is {exc.status} and changed since it was shown")
        log.info("dashboard: operator %s cancelled request %s (%s)", who, request_id,
                 "cancelled" if done.status is Status.CANCELLED else "stop requested")  # fmt: skip
        return JSONResponse(
            {
                "request_id": request_id,
                "status": done.status.value,
                "cancel_requested": done.cancel_requested,
                "version": done.updated_at.isoformat(),
            }
        )

    router.include_router(api)
    return router


__all__ = [
    "SnapshotHub",
    "SnapshotTimeout",
    "compute_snapshot",
    "create_dashboard_router",
    "scoped_snapshot",
]
