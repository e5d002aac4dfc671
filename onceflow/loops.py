"""Objects kept per asyncio event loop, dropped when their loop has closed (and per
process: :class:`PerProcess`).

A table keyed by the loop in a ``weakref.WeakKeyDictionary`` never lets go: the
object it holds (a psycopg pool, a ``redis.asyncio`` client, a listener) refers to its
loop, so the loop stays alive and every ``asyncio.run`` left one more pool behind with
its open connections. :class:`PerLoop` holds its loops in a plain dict and, whenever it
makes an entry for a new loop (and on :meth:`PerLoop.pop`), drops the entries of loops
that have closed, handing each object to ``discard``: a best-effort close that needs no
event loop (close sockets, nothing awaited). The owner's ``aclose()``, awaited on the
loop itself, stays the clean way to close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger("onceflow.loops")


class PerProcess(Generic[T]):
    """One ``T`` per process, made by ``make()`` on first use: a forked child makes its own
    (a parent's client holds the parent's sockets). Thread-safe: made once however many
    threads ask at the same time."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._entry: tuple[int, T] | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        """This process's object (made now if it has none)."""
        pid = os.getpid()
        entry = self._entry
        if entry is None or entry[0] != pid:
            with self._lock:
                entry = self._entry
                if entry is None or entry[0] != pid:
                    entry = self._entry = (pid, self._make())
        return entry[1]

    def made(self) -> T | None:
        """This process's object if it was made, else None (nothing is made)."""
        entry = self._entry
        return entry[1] if entry is not None and entry[0] == os.getpid() else None


class PerLoop(Generic[T]):
    """One ``T`` per running event loop (and per process: a forked child makes its own)."""

    def __init__(self, discard: Callable[[T], object] | None = None) -> None:
        self._entries: dict[asyncio.AbstractEventLoop, tuple[int, T]] = {}
        self._discard = discard
        self._lock = threading.Lock()

    def get(self) -> T | None:
        """The running loop's object, if it has one."""
        entry = self._entries.get(asyncio.get_running_loop())
        return entry[1] if entry is not None and entry[0] == os.getpid() else None

    def setdefault(self, make: Callable[[], T]) -> T:
        """The running loop's object, made by ``make()`` if it has none (closed loops pruned)."""
        loop = asyncio.get_running_loop()
        pid = os.getpid()
        entry = self._entries.get(loop)
        if entry is not None and entry[0] == pid:
            return entry[1]
        with self._lock:
            entry = self._entries.get(loop)
            if entry is None or entry[0] != pid:
                entry = self._entries[loop] = (pid, make())
            dropped = self._prune()
        self._discard_all(dropped)
        return entry[1]

    def pop(self) -> T | None:
        """Take the running loop's object out (and prune the closed loops')."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._entries.pop(loop, None)
            dropped = self._prune()
        self._discard_all(dropped)
        return entry[1] if entry is not None and entry[0] == os.getpid() else None

    def values(self) -> list[T]:
        """This process's objects, every loop's."""
        pid = os.getpid()
        return [value for owner, value in list(self._entries.values()) if owner == pid]

    def __len__(self) -> int:
        return len(self._entries)

    def _prune(self) -> list[T]:
        pid = os.getpid()
        dropped: list[T] = []
        for loop, (owner, value) in list(self._entries.items()):
            if owner != pid:  # a forked parent's: its sockets are the parent's, never closed
                del self._entries[loop]
            elif loop.is_closed():
                del self._entries[loop]
                dropped.append(value)
        return dropped

    def _discard_all(self, dropped: list[T]) -> None:
        if self._discard is None:
            return
        for value in dropped:
            try:
                self._discard(value)
            except Exception:  # best effort: the loop is gone, the object goes anyway
                log.debug("discarding a closed loop's %r failed", value, exc_info=True)


def drop_redis_sockets(client: Any) -> None:
    """Shut down the sockets of a ``redis.asyncio`` client whose loop has closed.

    Its connections cannot be closed without their loop; shutting their sockets down
    ends them on the server now, and the descriptors go with the objects.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a Redis Cluster client: each node holds its own connections
        nodes = getattr(getattr(client, "nodes_manager", None), "nodes_cache", {})
        for node in list(nodes.values()):
            for conn in list(getattr(node, "_connections", ())):
                shut_redis_connection(conn)
        return
    conns = [
        *getattr(pool, "_available_connections", ()),
        *getattr(pool, "_in_use_connections", ()),
    ]
    for conn in conns:
        shut_redis_connection(conn)


def shut_redis_connection(conn: Any) -> None:
    """Shut down one ``redis.asyncio`` connection's socket (its loop has closed)."""
    writer = getattr(conn, "_writer", None)
    sock = writer.transport.get_extra_info("socket") if writer is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
