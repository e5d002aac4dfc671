"""The SQL compute lock, for deployments without Redis.

One row of ``compute_locks`` per held lock, keyed ``(workspace_id, job_id, task)``.
Acquire is one statement: ``INSERT … ON CONFLICT DO UPDATE … WHERE
compute_locks.expires_at <= now()`` inserts a free cell or replaces an expired
row, and does nothing to a live one — so a crashed holder blocks nobody past its
TTL, with no sweeper. ``expires_at`` comes from the database clock only.
Release is ``DELETE … WHERE token = :token``; extend is an ``UPDATE`` with the
same token test, refused once the row expired.

Waiting uses Postgres ``LISTEN``/``NOTIFY`` rather than Redis, so this backend
needs nothing but Postgres. Each process keeps one listening connection (the
listener thread) and fans notifications out to its waiters by workspace; the
leader's ``pg_notify`` after release wakes them. NOTIFY is delivered only to
sessions listening at commit time, so waiting still subscribes first and
re-checks second, and every wait is bounded by the lock's remaining TTL.
Layer 3's commit broadcast is a Redis message and does not reach these waiters;
the leader's notification follows its store, so they are woken all the same.
Counters stay process-local with this backend.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
from typing import Any

import psycopg
from sqlalchemy import Engine

from onceflow.db import fetch_one, get_engine, raw_connection
from onceflow.errors import DatabaseUnavailable, LockUnavailable
from onceflow.keys import lock_key
from onceflow.locks.base import LOCK_RELEASED, LockHandle, Message, parse_message, ttl_to_ms
from onceflow.locks.counters import Counters
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.locks")

#: The one NOTIFY channel of the SQL backend; payloads name the workspace.
CHANNEL = "onceflow_compute_locks"

ACQUIRE = """
INSERT INTO compute_locks AS l (workspace_id, job_id, task, token, acquired_at, expires_at)
VALUES (%(workspace_id)s, %(job_id)s, %(task)s, %(token)s,
        now(), now() + make_interval(secs => %(ttl)s))
ON CONFLICT (workspace_id, job_id, task) DO UPDATE
    SET token = EXCLUDED.token, acquired_at = EXCLUDED.acquired_at,
        expires_at = EXCLUDED.expires_at
    WHERE l.expires_at <= now()
RETURNING l.token
"""
# Deleting our own expired row frees the cell early; `held` says whether it was still live.
RELEASE = """
DELETE FROM compute_locks
WHERE workspace_id = %(workspace_id)s AND job_id = %(job_id)s AND task = %(task)s
  AND token = %(token)s
RETURNING expires_at > now() AS held
"""
EXTEND = """
UPDATE compute_locks SET expires_at = now() + make_interval(secs => %(ttl)s)
WHERE workspace_id = %(workspace_id)s AND job_id = %(job_id)s AND task = %(task)s
  AND token = %(token)s AND expires_at > now()
RETURNING 1 AS held
"""
REMAINING = """
SELECT greatest(0, ceil(extract(epoch FROM expires_at - now()) * 1000))::bigint AS ms
FROM compute_locks
WHERE workspace_id = %(workspace_id)s AND job_id = %(job_id)s AND task = %(task)s
"""
OWNER = """
SELECT token FROM compute_locks
WHERE workspace_id = %(workspace_id)s AND job_id = %(job_id)s AND task = %(task)s
  AND expires_at > now()
"""
NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"


class SqlLockBackend:
    """Compute locks in the ``compute_locks`` table; waiting on LISTEN/NOTIFY."""

    name = "sql"

    def __init__(self, engine: Engine | str | None = None, *, settings: Settings | None = None):
        self.settings = settings or get_settings()
        if engine is None or isinstance(engine, str):
            engine = get_engine(engine or self.settings.database_url)
        self.engine = engine
        self.counters = Counters()
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )

    def _one(self, what: str, query: str, params: dict[str, Any]) -> Any:
        try:
            with raw_connection(self.engine) as conn:
                return fetch_one(conn, query, params)
        except DatabaseUnavailable as exc:
            raise LockUnavailable(f"Postgres unavailable ({what}): {exc}") from exc

    # LockBackend.acquire's signature (alike by shape in every backend): the protocol's.
    def acquire(
        self,
        workspace_id: str,
        job_id: str,
        task: str,
        ttl: float | None = None,
        *,
        watchdog: bool = False,
        holder: str | None = None,
    ) -> LockHandle | None:
        """Insert the cell's row, or replace an expired one; None if a live row exists.

        ``holder`` (the caller's trace context) is not kept: this backend stores no trace
        context, so its waiters' spans carry no link to the holder's."""
        key = lock_key(workspace_id, job_id, task)  # validates the ids
        ttl_ms = ttl_to_ms(self.settings.lock_ttl_seconds if ttl is None else ttl)
        token = secrets.token_hex(16)
        params = {
            "workspace_id": workspace_id, "job_id": job_id, "task": task,
            "token": token, "ttl": ttl_ms / 1000.0,
        }  # fmt: skip
        row = self._one("acquire", ACQUIRE, params)
        if row is None:
            return None
        handle = LockHandle(self, workspace_id, job_id, task, key, token, ttl_ms)
        if watchdog:
            handle.start_watchdog()
        return handle

    def cad_release(self, handle: LockHandle) -> bool:
        """Delete the row if it holds the handle's token; True if it was still live."""
        row = self._one("release", RELEASE, _cell(handle, token=handle.token))
        return bool(row and row["held"])

    def cad_extend(self, handle: LockHandle, ttl_ms: int) -> bool:
        """Push ``expires_at`` out if the live row holds the handle's token."""
        params = _cell(handle, token=handle.token, ttl=ttl_ms / 1000.0)
        return self._one("extend", EXTEND, params) is not None

    def remaining_ms(self, workspace_id: str, job_id: str, task: str) -> int | None:
        """Milliseconds until the row expires by the database clock; None if no row."""
        row = self._one("remaining", REMAINING, _ids(workspace_id, job_id, task))
        return None if row is None else int(row["ms"])

    def holder_of(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """Always None: the holder's trace context is not kept (see :meth:`acquire`)."""
        return None

    def owner_token(self, workspace_id: str, job_id: str, task: str) -> str | None:
        """The token of the cell's live row, or None."""
        row = self._one("owner", OWNER, _ids(workspace_id, job_id, task))
        return None if row is None else str(row["token"])

    def subscribe(self, workspace_id: str) -> SqlSubscription:
        """Register with this process's listener (which is LISTENing before this returns)."""
        return SqlSubscription(_listener(self._conninfo, self.settings), workspace_id)

    def announce(self, handle: LockHandle, *, ok: bool) -> None:
        """``pg_notify`` lock_released for the handle's cell (the payload names the workspace)."""
        payload = json.dumps(
            {"kind": LOCK_RELEASED, "workspace_id": handle.workspace_id,
             "job_id": handle.job_id, "task": handle.task, "ok": ok}
        )  # fmt: skip
        self._one("notify", NOTIFY, {"channel": CHANNEL, "payload": payload})

    def flush_counters(self) -> None:
        """Nothing to send: this backend's counters are process-local."""

    def workspace_counters(self, workspace_id: str) -> dict[str, int]:
        """This process's counters of the workspace (there is no shared store without Redis)."""
        return self.counters.snapshot(workspace_id)


def _ids(workspace_id: str, job_id: str, task: str) -> dict[str, Any]:
    return {"workspace_id": workspace_id, "job_id": job_id, "task": task}


def _cell(handle: LockHandle, **extra: Any) -> dict[str, Any]:
    return {**_ids(handle.workspace_id, handle.job_id, handle.task), **extra}


class SqlSubscription:
    """A waiter's registration with the process's listener, for one workspace."""

    def __init__(self, listener: _Listener, workspace_id: str) -> None:
        self._listener = listener
        self._workspace_id = workspace_id
        self._inbox = listener.register(workspace_id)

    def wait(self, timeout: float) -> Message | None:
        """The next notification of the workspace, or None after ``timeout`` seconds."""
        try:
            return self._inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop receiving."""
        self._listener.unregister(self._workspace_id, self._inbox)


class _Listener:
    """One LISTEN connection per process, read by a daemon thread, fanned out by workspace."""

    def __init__(self, conninfo: str, timeout: float) -> None:
        self._conninfo = conninfo
        self._timeout = timeout
        self._lock = threading.Lock()
        self._inboxes: dict[str, set[queue.SimpleQueue[Message]]] = {}
        self._conn: psycopg.Connection[Any] | None = None

    def register(self, workspace_id: str) -> queue.SimpleQueue[Message]:
        inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        with self._lock:
            self._ensure_listening()
            self._inboxes.setdefault(workspace_id, set()).add(inbox)
        return inbox

    def unregister(self, workspace_id: str, inbox: queue.SimpleQueue[Message]) -> None:
        with self._lock:
            inboxes = self._inboxes.get(workspace_id)
            if inboxes is not None:
                inboxes.discard(inbox)
                if not inboxes:
                    del self._inboxes[workspace_id]

    def _ensure_listening(self) -> None:
        if self._conn is not None and not self._conn.closed:
            return
        try:
            conn = psycopg.connect(
                self._conninfo, autocommit=True, connect_timeout=max(1, round(self._timeout))
            )
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as exc:
            raise LockUnavailable(f"Postgres unavailable (listen): {exc}") from exc
        self._conn = conn
        threading.Thread(
            target=self._run, args=(conn,), name="onceflow-lock-listener", daemon=True
        ).start()

    def _run(self, conn: psycopg.Connection[Any]) -> None:
        try:
            while True:
                for note in conn.notifies(timeout=1.0):
                    message = parse_message(note.payload)
                    with self._lock:
                        inboxes = list(self._inboxes.get(str(message.get("workspace_id")), ()))
                    for inbox in inboxes:
                        inbox.put(message)
        except psycopg.Error as exc:
            # Waiters fall back on their bounded wait; the next subscribe reconnects.
            log.warning("compute locks: LISTEN connection lost: %s", exc)
        finally:
            with self._lock:
                if self._conn is conn:
                    self._conn = None
            conn.close()


_listeners: dict[tuple[str, int], _Listener] = {}
_listeners_lock = threading.Lock()


def _listener(conninfo: str, settings: Settings) -> _Listener:
    key = (conninfo, os.getpid())  # a forked child listens on its own connection
    with _listeners_lock:
        listener = _listeners.get(key)
        if listener is None:
            listener = _listeners[key] = _Listener(conninfo, settings.lock_timeout_seconds)
        return listener
