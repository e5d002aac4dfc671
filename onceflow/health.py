"""Health probes: is this process alive, and can it serve (``/healthz``, ``/readyz``)?

Readiness is three checks, each named in the answer:

* ``database``: every database of the settings (each shard of a database split by
  workspace) accepts a connection and answers ``SELECT 1``;
* ``migrations``: each of them is at the package's head revision (Alembic's
  ``onceflow_alembic_version``) — a database behind (or ahead of) the code is not ready;
* ``redis``: the Redis of ``ONCEFLOW_REDIS_URL`` answers ``PING``.

Every check has a deadline (``ONCEFLOW_PROBE_TIMEOUT_SECONDS``): a database or Redis that
accepts connections and never answers fails its check when the deadline passes, so a
probe answers within about that time. A check still running when the next probe comes is
waited for rather than started again, so a hung server never piles up connections.

What a failed check says is a short reason (``unreachable (OperationalError)``, ``timed out
after 2s``, ``at revision 0011_x, the package's head is 0012_y``): never a URL, a host or a
password — the probes answer anyone who can reach the port.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from alembic.script import ScriptDirectory

from onceflow.db import check_database_url
from onceflow.migrate import alembic_config
from onceflow.redis_clients import sync_client
from onceflow.settings import Settings, get_settings
from onceflow.shards import configured_map

#: The names of the readiness checks, in the order they are reported.
CHECKS = ("database", "migrations", "redis")
#: Alembic's version table of onceflow's migrations (onceflow/migrations/env.py).
VERSION_TABLE = "onceflow_alembic_version"
_NOT_CHECKED = "not checked: the database did not answer"


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``ok``, and a one-line reason (``"ok"`` when it passed)."""

    name: str
    ok: bool
    detail: str = "ok"


@dataclass(frozen=True)
class Readiness:
    """The outcome of every readiness check; ready when all passed."""

    checks: tuple[Check, ...]

    @property
    def ready(self) -> bool:
        """Whether every check passed."""
        return all(check.ok for check in self.checks)

    @property
    def failing(self) -> list[str]:
        """The names of the checks that failed."""
        return [check.name for check in self.checks if not check.ok]

    def body(self) -> dict[str, Any]:
        """The JSON answer of ``/readyz``: the status and each check by name."""
        return {
            "status": "ready" if self.ready else "not ready",
            "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in self.checks},
        }


def liveness() -> dict[str, str]:
    """The JSON answer of ``/healthz``: the process runs (it checks nothing else)."""
    return {"status": "alive"}


@functools.lru_cache(maxsize=1)
def head_revisions() -> frozenset[str]:
    """The head revision(s) of the migrations shipped with this package (read once)."""
    # The URL is never connected to: the script directory is all that is read.
    script = ScriptDirectory.from_config(alembic_config("postgresql+psycopg:///unused"))
    return frozenset(script.get_heads())


def database_revisions(url: str, timeout: float) -> frozenset[str] | None:
    """The revision(s) the database of ``url`` is at; None without onceflow's version table.

    ``timeout`` is the statement timeout; the connect gives up a second after it (the
    caller's deadline, :func:`readiness`, answers first, so a hung server always reads as
    "timed out", and the check's thread ends soon after).
    """
    conninfo = check_database_url(url).set(drivername="postgresql")
    millis = max(1, int(timeout * 1000))
    with psycopg.connect(
        conninfo.render_as_string(hide_password=False),
        connect_timeout=math.ceil(timeout) + 1,
        options=f"-c statement_timeout={millis}",
        autocommit=True,
    ) as conn:
        found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (VERSION_TABLE,)).fetchone()
        if found is None or not found[0]:
            return None
        rows = conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall()  # noqa: S608
        return frozenset(str(row[0]) for row in rows)


def migrations_problem(found: frozenset[str] | None) -> str | None:
    """Why a database at revisions ``found`` is not at the package's head (None if it is)."""
    heads = head_revisions()
    if found is None or not found:
        return "not migrated: no onceflow tables (run `onceflow migrate`)"
    if found != heads:
        return f"at revision {_names(found)}, the package's head is {_names(heads)}"
    return None


def _names(revisions: frozenset[str]) -> str:
    return ", ".join(sorted(revisions))


def ping_redis(url: str, timeout: float) -> None:
    """``PING`` the Redis of ``url`` (one server or a cluster), ``timeout`` on every socket call."""
    client = sync_client(url, timeout=timeout, retries=0, client_name="onceflow-probe")
    try:
        client.ping()
    finally:
        client.close()


#: A check's run: set when it ends, then holding its result (or the exception it raised).
_Slot = tuple[threading.Event, list[Any]]


class _Deadlines:
    """Runs each named check in a daemon thread and waits for it until a deadline.

    A check still running when it is asked for again (its server hung past the last
    deadline) is waited for again, never started twice.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The checks running, and the latest run of each check (what wait() reads).
        self._running: dict[str, _Slot] = {}
        self._slots: dict[str, _Slot] = {}

    def start(self, key: str, fn: Callable[[], Any]) -> None:
        """Start ``fn`` as the check ``key``, unless that check is still running."""
        with self._lock:
            if key in self._running:
                return
            slot: _Slot = (threading.Event(), [])
            self._running[key] = slot
            self._slots[key] = slot
        # The key names a URL: the thread's name does not.
        threading.Thread(
            target=self._call, args=(key, fn, slot), name="onceflow-probe", daemon=True
        ).start()

    def wait(self, key: str, timeout: float) -> tuple[bool, Any]:
        """(finished, its result or the exception it raised) of the check ``key``, waited
        for at most ``timeout`` seconds."""
        with self._lock:
            slot = self._slots[key]
        done, outcome = slot
        if not done.wait(timeout):
            return False, None
        return True, outcome[0]

    def _call(self, key: str, fn: Callable[[], Any], slot: _Slot) -> None:
        try:
            result: Any = fn()
        except Exception as exc:  # reported as the check's failure
            result = exc
        with self._lock:
            slot[1].append(result)
            slot[0].set()
            self._running.pop(key, None)


_deadlines = _Deadlines()


def readiness(
    database_urls: Sequence[str],
    redis_url: str | None,
    *,
    timeout: float,
) -> Readiness:
    """Run the readiness checks on ``database_urls`` (every shard) and ``redis_url`` (None:
    no Redis check), each within ``timeout`` seconds; the checks run concurrently."""
    waits: list[tuple[str, Callable[[], Any]]] = [
        (f"database:{index}:{url}", functools.partial(database_revisions, url, timeout))
        for index, url in enumerate(database_urls)
    ]
    if redis_url is not None:
        waits.append((f"redis:{redis_url}", functools.partial(ping_redis, redis_url, timeout)))
    outcomes = _run_all(waits, timeout)
    database, migrations = _database_checks(outcomes[: len(database_urls)], timeout)
    checks = [database, migrations]
    if redis_url is not None:
        checks.append(_redis_check(outcomes[-1], timeout))
    return Readiness(tuple(checks))


def _run_all(waits: list[tuple[str, Callable[[], Any]]], timeout: float) -> list[tuple[bool, Any]]:
    """Start every check, then wait for each until the one shared deadline."""
    deadline = time.monotonic() + timeout
    for key, fn in waits:
        _deadlines.start(key, fn)
    return [_deadlines.wait(key, max(0.0, deadline - time.monotonic())) for key, _ in waits]


def _database_checks(outcomes: list[tuple[bool, Any]], timeout: float) -> tuple[Check, Check]:
    unreachable: list[str] = []
    behind: list[str] = []
    many = len(outcomes) > 1
    for index, (finished, result) in enumerate(outcomes):
        where = f"shard {index}: " if many else ""
        if not finished:
            unreachable.append(f"{where}timed out after {timeout:g}s")
        elif isinstance(result, Exception):
            unreachable.append(f"{where}unreachable ({type(result).__name__})")
        else:
            problem = migrations_problem(result)
            if problem is not None:
                behind.append(where + problem)
    database = Check("database", not unreachable, "; ".join(unreachable) or "ok")
    if unreachable:
        return database, Check("migrations", False, _NOT_CHECKED)
    return database, Check("migrations", not behind, "; ".join(behind) or "ok")


def _redis_check(outcome: tuple[bool, Any], timeout: float) -> Check:
    finished, result = outcome
    if not finished:
        return Check("redis", False, f"timed out after {timeout:g}s")
    if isinstance(result, Exception):  # REDIS_OR_OS_ERRORS, or a malformed URL
        return Check("redis", False, f"unreachable ({type(result).__name__})")
    return Check("redis", True)


def readiness_probe(settings: Settings | None = None) -> Callable[[], Readiness]:
    """:func:`readiness` on the databases (every shard) and the Redis of ``settings``.

    The shard map is read at the first probe and kept. A configuration that cannot be
    read (a malformed URL, a missing map file) fails the ``database`` check, never the
    process that serves the probe.
    """
    settings = settings or get_settings()
    resolved: list[list[str]] = []

    def probe() -> Readiness:
        if not resolved:
            try:
                resolved.append(list(configured_map(settings).urls))
            except Exception as exc:  # an OnceflowError naming the setting: no URL shown
                database = Check("database", False, f"not configured ({type(exc).__name__})")
                rest = readiness([], settings.redis_url, timeout=settings.probe_timeout_seconds)
                redis_check = [c for c in rest.checks if c.name == "redis"]
                migrations = Check("migrations", False, _NOT_CHECKED)
                return Readiness((database, migrations, *redis_check))
        return readiness(resolved[0], settings.redis_url, timeout=settings.probe_timeout_seconds)

    return probe
