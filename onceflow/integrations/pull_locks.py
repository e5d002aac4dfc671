"""``PullContext.compute_once``: the compute-lock protocol of a Python pull worker, over HTTP.

The same five steps as :func:`onceflow.locks.compute_once` and the JS SDK's ``computeOnce``
(``onceflow/sdk/js/compute.js``), on the claim's lock routes (``POST /v1/claims/{id}/locks``,
``…/locks/extend``, ``…/locks/release``: the same Redis lock, so a Celery stage, a tab and a
Python pull worker asking for the same cell pay for it once):

1. pre-flight ``check()``: a stored value returns at once, no lock round trip;
2. acquire the cell's lock. ``locked`` is "someone else is on it": open the claim's event
   stream (``POST /v1/claims/{id}/events``) *first*, check again, try the lock once more
   (a release announced before the stream was live is not missed), then wait for a
   ``lock_released`` of this cell or a ``commit`` (after which ``check()`` runs again), at
   most the holder's ``remaining_ms`` plus a margin, and try again (the holder may have
   died: its lock expires). No polling loop, no provider call meanwhile;
3. holding the lock, ``check()`` again (the double-check);
4. ``compute()`` with the lock extended every ttl/3 (a failed extend is tried again at the
   next third; only a refusal stops it);
5. ``store(value)``, then — in ``finally`` — release with the outcome (``computed``,
   ``double_check``, ``failed``, or ``abandoned`` before ``compute()`` was called), which
   announces ``lock_released`` to the waiters.

The claim's ``check()`` (lease lost, cancel requested) runs before each acquire, before
``compute()`` and before ``store()``; a lock route answering 409 raises :class:`LeaseLost`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from onceflow.errors import InvalidRequest, LeaseLost, OnceflowError
from onceflow.locks import Locked, Outcome, Path
from onceflow.locks.base import is_release_of
from onceflow.locks.protocol import WAIT_MARGIN_SECONDS

if TYPE_CHECKING:
    import httpx

    from onceflow.integrations.pull import PullContext

log = logging.getLogger("onceflow.pull")

T = TypeVar("T")
Message = dict[str, Any]
Release = Literal["computed", "double_check", "failed", "abandoned"]


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """``(event, data)`` of a server-sent event stream, from its lines (comments skipped)."""
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)


class ClaimEvents:
    """One subscription to the claimed request's workspace events, read on a thread.

    :meth:`open` returns once the stream is live (``ready``) or could not open. Then
    ``ended`` is None while it is live, else why it is not: ``unavailable`` (it never
    opened: waits fall back to the holder's TTL), ``ended`` (it closed: subscribe again),
    ``claim_ended`` (the server ended it: the claim is over) or ``closed``.
    """

    def __init__(
        self,
        client: httpx.Client,
        url: str,
        headers: dict[str, str],
        request_id: str,
        token: str,
        *,
        workspace_id: str | None = None,
    ) -> None:
        self._client = client
        self._request_id = request_id
        self._url = url
        self._headers = headers
        self._token = token
        self._workspace_id = workspace_id
        self._messages: queue.Queue[Message | None] = queue.Queue()
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._response: httpx.Response | None = None
        self._refused: int | None = None
        self.ended: str | None = None
        self._thread = threading.Thread(target=self._run, name="onceflow-pull-events", daemon=True)

    def open(self, timeout: float) -> ClaimEvents:
        """Start reading; return once live or failed. Raises :class:`LeaseLost` on a 409."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.close()
            self.ended = "unavailable"
        if self._refused == 409:
            raise LeaseLost(self._request_id, "the claim's event stream was refused")
        return self

    def wait(self, timeout: float) -> Message | None:
        """The next message, or None after ``timeout`` seconds or once the stream is gone."""
        if self.ended in ("unavailable", "closed"):
            self._closing.wait(max(timeout, 0.0))  # no stream: wait out the holder's TTL
            return None
        try:
            return self._messages.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop reading and free the connection (its socket is shut, which wakes the reader)."""
        self._closing.set()
        if self.ended is None:
            self.ended = "closed"
        response = self._response
        stream = None if response is None else response.extensions.get("network_stream")
        sock = None if stream is None else stream.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._messages.put(None)

    def _run(self) -> None:
        import httpx

        live = False
        base = self._client.timeout
        # A stream: no read timeout (keep-alives say it lives; closing shuts its socket).
        timeout = httpx.Timeout(connect=base.connect, read=None, write=base.write, pool=base.pool)
        body = {"claim_token": self._token}
        if self._workspace_id is not None:  # the request by its key, not by its id alone
            body["workspace_id"] = self._workspace_id
        try:
            with self._client.stream(
                "POST", self._url, json=body, headers=self._headers, timeout=timeout
            ) as response:
                self._response = response
                if self._closing.is_set():
                    return
                if response.status_code != 200:
                    self._refused = response.status_code
                    return
                for event, data in sse_events(response.iter_lines()):
                    if event == "ready":
                        live = True
                        self._ready.set()
                        continue
                    if event == "end":
                        self.ended = "claim_ended"
                        return
                    with contextlib.suppress(ValueError):
                        message = json.loads(data)
                        if isinstance(message, dict):
                            self._messages.put(message)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            if not self._closing.is_set():
                log.info("claim event stream: %s", type(exc).__name__)
        finally:
            if self.ended is None:
                self.ended = "ended" if live else "unavailable"
            self._ready.set()
            self._messages.put(None)  # wakes a waiter: the stream is gone


class _Extender(threading.Thread):
    """Extends a held lock every ttl/3 until stopped; ``lost`` once an extend was refused."""

    def __init__(self, extend: Callable[[], bool], interval: float) -> None:
        super().__init__(name="onceflow-pull-lock-extend", daemon=True)
        self._extend = extend
        self._interval = interval
        self._stop_event = threading.Event()
        self.lost = False

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            try:
                if not self._extend():
                    self.lost = True  # refused: the lock expired or is someone else's
                    return
            except LeaseLost:
                return  # the claim is gone: the stage stops at its next check
            except OnceflowError as exc:  # no answer: it may still be ours, try at the next third
                log.warning("compute lock: extend failed: %s", exc)

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=30)


def compute_once(
    ctx: PullContext,
    task: str,
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    *,
    wait: bool = True,
    ttl: float | None = None,
    watchdog: bool = True,
    on_wait: Callable[[], object] | None = None,
) -> Outcome[T] | Locked:
    """Get the cell ``(ctx.workspace_id, ctx.job_id, task)``, paying for ``compute()`` once.

    ``wait=False`` returns :class:`Locked` when someone else holds the lock; ``ttl``: the
    lock's TTL in seconds (the server's ``ONCEFLOW_LOCK_TTL_SECONDS`` at most); ``on_wait``
    is called each time this caller starts waiting for a holder.
    """
    if not isinstance(task, str) or not 0 < len(task) <= 200:
        raise InvalidRequest("task must be a string of 1..200 characters")
    ctx.check()
    value = check()
    if value is not None:
        return Outcome(value, Path.PREFLIGHT)
    worker, claim = ctx.worker, ctx.claim
    sub: ClaimEvents | None = None
    waiting_since = 0.0
    rounds = 0

    def acquire() -> dict[str, Any]:
        ctx.check()
        got = worker.acquire_lock(claim, task, ttl)
        if not got.get("acquired") and not got.get("locked"):
            raise InvalidRequest("acquire lock: an answer neither acquired nor locked")
        return got

    def served(value: T, by: Literal["broadcast", "recheck"]) -> Outcome[T]:
        waited = time.monotonic() - waiting_since
        return Outcome(value, Path.WAITED, by, waited_seconds=waited, rounds=rounds)

    try:
        while True:
            rounds += 1  # one round per run of the protocol (as onceflow.locks counts them)
            got = acquire()
            if got["acquired"]:
                return _lead(ctx, task, got, check, compute, store, ttl, watchdog, rounds)
            if not wait:
                return Locked(ctx.workspace_id, ctx.job_id, task)
            if sub is None or sub.ended is not None:  # listen first, then look again
                if sub is None:
                    waiting_since = time.monotonic()
                else:
                    sub.close()
                sub = worker.claim_events(claim)
                value = check()
                if value is not None:
                    return served(value, "recheck")
                # A release announced before the stream was live reached no one here.
                got = acquire()
                if got["acquired"]:
                    return _lead(ctx, task, got, check, compute, store, ttl, watchdog, rounds)
            if on_wait is not None:
                on_wait()
            deadline = time.monotonic() + int(got.get("remaining_ms") or 0) / 1000
            deadline += WAIT_MARGIN_SECONDS
            while True:
                message = sub.wait(deadline - time.monotonic())
                if message is None:
                    break  # the holder's TTL ran out, or the stream is gone: try again
                ctx.check()
                value = check()  # any message may be the store's commit
                if value is not None:
                    return served(value, "broadcast")
                if is_release_of(message, ctx.job_id, task):
                    break  # released without a value: try again (one waiter leads next)
    finally:
        if sub is not None:
            sub.close()


def _lead(
    ctx: PullContext,
    task: str,
    got: dict[str, Any],
    check: Callable[[], T | None],
    compute: Callable[[], T],
    store: Callable[[T], object],
    ttl: float | None,
    watchdog: bool,
    rounds: int,
) -> Outcome[T]:
    worker, claim = ctx.worker, ctx.claim
    token = str(got["lock_token"])
    ttl_ms = int(got.get("ttl_ms") or 60_000)
    outcome: Release = "abandoned"  # until compute() is called: no provider call to count
    extender = _Extender(lambda: worker.extend_lock(claim, task, token, ttl), ttl_ms / 3000)
    if watchdog:
        extender.start()
    try:
        again = check()  # the double-check: stored between the pre-flight and the acquire?
        if again is not None:
            outcome = "double_check"
            return Outcome(again, Path.DOUBLE_CHECK, rounds=rounds)
        ctx.check()  # no provider call for a stage that must stop
        outcome = "failed"  # from here a raise is a failed provider call (or a lost value)
        value = compute()
        if value is None:
            raise InvalidRequest("compute() returned None: check() would read it as 'not stored'")
        ctx.check()
        held = not extender.lost
        try:
            held = held and worker.extend_lock(claim, task, token, ttl)  # ours before the store?
        except LeaseLost:
            raise
        except OnceflowError as exc:  # cannot confirm it: store anyway (first writer wins)
            log.warning("compute lock: cannot confirm it before storing: %s", exc)
        if not held:
            existing = check()  # lost: did the next holder store its value already?
            if existing is not None:
                outcome = "computed"
                return Outcome(existing, Path.LOCK_LOST, rounds=rounds, duplicate=True)
        kept = store(value)
        outcome = "computed"
        path = Path.COMPUTED if held else Path.LOCK_LOST
        if kept is False:  # the store kept an earlier value
            existing = check()
            value = value if existing is None else existing
            return Outcome(value, path, rounds=rounds, duplicate=True)
        return Outcome(value, path, rounds=rounds)
    finally:
        extender.stop()
        try:
            worker.release_lock(claim, task, token, outcome)
        except OnceflowError as exc:  # not released: it expires by its TTL, waiters wake then
            log.warning("compute lock: release failed: %s", exc)
