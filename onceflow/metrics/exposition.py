"""Exposition: the registry to serve (every process + the database) and its HTTP server.

The server answers ``/metrics`` (any other path too, as prometheus_client always has) and
the probes ``/healthz`` and ``/readyz`` (:mod:`onceflow.health`: the same answers as
``onceflow api``'s).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from onceflow.health import Readiness, liveness, readiness_probe
from onceflow.metrics.collector import DatabaseCollector

log = logging.getLogger("onceflow.metrics")

__all__ = [
    "DatabaseCollector",
    "mark_dead",
    "multiproc_dir",
    "multiproc_dir_problem",
    "prune_dead_pids",
    "registry",
    "serve",
    "with_probes",
]


def multiproc_dir() -> str | None:
    """The multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``), or None in single-process mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def multiproc_dir_problem() -> str | None:
    """One line saying why ``PROMETHEUS_MULTIPROC_DIR`` cannot be used, or None if it can
    (or is not set). The start script must create it; onceflow never does."""
    path = multiproc_dir()
    if path is None:
        return None
    if not os.path.isdir(path):
        return f"PROMETHEUS_MULTIPROC_DIR={path} is not a directory (create it, empty, at start)"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"PROMETHEUS_MULTIPROC_DIR={path} is not writable by this process"
    return None


def mark_dead(pid: int) -> None:
    """Drop the live gauges of process ``pid`` (multiprocess mode; a no-op otherwise)."""
    path = multiproc_dir()
    if path is not None:
        try:
            mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
        except Exception:  # never break a process's exit for a metric
            log.warning("metrics: could not mark process %s dead", pid, exc_info=True)


_LIVE_FILE = re.compile(r"gauge_live\w*?_(\d+)\.db$")


def prune_dead_pids(path: str) -> list[int]:
    """Mark dead every pid with live-gauge files that is not running (on this host)."""
    dead: list[int] = []
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        m = _LIVE_FILE.search(name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.append(pid)
        except PermissionError:
            pass  # alive, another user's
    for pid in sorted(set(dead)):
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    return dead


class _Processes(Collector):
    """The merged files of every process (dead pids' live gauges dropped first)."""

    def __init__(self, path: str, prune_dead: bool) -> None:
        self._path = path
        self._prune = prune_dead
        self._merged: Any = None
        self._warned = False

    def collect(self) -> Iterable[Any]:
        if not os.path.isdir(self._path):  # a scrape must not fail: the database's still count
            if not self._warned:
                self._warned = True
                log.warning("metrics: %s", multiproc_dir_problem())
            return []
        if self._merged is None:
            self._merged = MultiProcessCollector(None, self._path)  # type: ignore[no-untyped-call]
        if self._prune:
            try:
                prune_dead_pids(self._path)
            except Exception:
                log.warning("metrics: pruning dead pids failed", exc_info=True)
        merged: Iterable[Any] = self._merged.collect()
        return merged


class _ThisProcess(Collector):
    """The default registry of this process (single-process mode)."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()


def registry(
    database_url: str | Sequence[str] | None = None,
    *,
    database: bool = True,
    prune_dead: bool = True,
    count_cap: int | None = None,
) -> CollectorRegistry:
    """A registry to expose: every process's metrics plus the database collector.

    Multiprocess mode: the files of ``PROMETHEUS_MULTIPROC_DIR`` merged (``prune_dead``:
    drop the live gauges of pids no longer running — turn off when the writers run in
    another pid namespace, e.g. another container sharing the directory). Single-process
    mode: this process's default registry. ``database_url`` (one URL, or the shards' URLs
    of a database split by workspace) and ``count_cap`` (index entries counted per status
    at most) default to the settings' (every shard of ``ONCEFLOW_DATABASE_URLS`` /
    ``ONCEFLOW_SHARD_MAP``).
    """
    reg = CollectorRegistry()
    path = multiproc_dir()
    if path is not None:
        reg.register(_Processes(path, prune_dead))
    else:
        reg.register(_ThisProcess())
    if database:
        if database_url is None or count_cap is None:
            from onceflow.settings import get_settings
            from onceflow.shards import configured_map

            settings = get_settings()
            database_url = database_url or list(configured_map(settings).urls)
            count_cap = count_cap or settings.metrics_count_cap
        reg.register(DatabaseCollector(database_url, count_cap=count_cap))
    return reg


#: A WSGI application: ``app(environ, start_response) -> body parts``.
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def with_probes(metrics: WsgiApp, readiness: Callable[[], Readiness]) -> WsgiApp:
    """``metrics`` with ``GET /healthz`` (200 while the server runs) and ``GET /readyz``
    (``readiness()``: 200, or 503 naming the failing checks) in front of it."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/healthz", "/readyz"):
            return metrics(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if path == "/healthz":
            status, body = "200 OK", liveness()
        else:
            ready = readiness()
            status = "200 OK" if ready.ready else "503 Service Unavailable"
            body = ready.body()
        data = json.dumps(body).encode()
        headers = [("Content-Type", "application/json"), ("Cache-Control", "no-store")]
        start_response(status, [*headers, ("Content-Length", str(len(data)))])
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [data]

    return app


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (a probe every few seconds would fill the log)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(
    port: int,
    bind: str = "127.0.0.1",
    *,
    reg: CollectorRegistry | None = None,
    readiness: Callable[[], Readiness] | None = None,
) -> Any:
    """Serve ``reg`` (default: :func:`registry`) over HTTP, unauthenticated, in a thread,
    with the probes ``/healthz`` and ``/readyz`` (``readiness`` defaults to the checks of
    the settings: :func:`onceflow.health.readiness_probe`).

    Returns the server. A process forked afterwards closes its copy of the listening socket.
    """

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET

    app = with_probes(make_wsgi_app(reg or registry()), readiness or readiness_probe())
    server = make_server(bind, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="onceflow-metrics", daemon=True).start()
    os.register_at_fork(after_in_child=server.socket.close)
    log.info("metrics: serving on http://%s:%d/metrics", bind, port)
    return server
