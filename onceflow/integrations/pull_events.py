"""The claim's event stream of a Python pull worker (``POST /v1/claims/{id}/events``): the
workspace events a compute-lock waiter listens to (``lock_released``, ``commit``), read on a
thread, and the server-sent-events line parser it reads them with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from onceflow.errors import LeaseLost

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("onceflow.pull")

Message = dict[str, Any]


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
        # A constructor keeping its arguments (alike by shape with others): nothing to share.
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


__all__ = ["ClaimEvents", "Message", "sse_events"]
