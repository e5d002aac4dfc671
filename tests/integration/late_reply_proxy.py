"""A TCP forwarder that loses one reply: the server runs the command, the client never hears.

``lose_reply_to(pattern)`` arms it: the next request whose bytes contain ``pattern`` is
forwarded to the server, and when the server's reply comes the connection is cut instead
of delivering it. The client sees its connection fail after the server acted — as after a
socket timeout or a network cut — and redis-py resends the command once on a new
connection: the case a retried command must survive.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class LateReplyProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._lock = threading.Lock()
        self._pattern: bytes | None = None
        self.lost = threading.Event()  # set once a reply was held back and dropped
        self._closed = False
        self._socks: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, pattern: bytes) -> None:
        with self._lock:
            self._pattern = pattern
            self.lost.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> LateReplyProxy:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._socks += [client, server]
            held = threading.Event()  # this connection's next reply is to be lost
            for pump, ends in (
                (self._requests, (client, server)),
                (self._replies, (server, client)),
            ):
                threading.Thread(target=pump, args=(*ends, held), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, held: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    if self._pattern is not None and self._pattern in data:
                        self._pattern = None
                        held.set()
                dst.sendall(data)
        except OSError:
            pass
        _shut(src, dst)

    def _replies(self, src: socket.socket, dst: socket.socket, held: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if held.is_set():  # the server acted; the client never hears of it
                    self.lost.set()
                    return  # (finally: the connection is cut)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src, dst)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
