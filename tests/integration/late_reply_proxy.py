"""A TCP forwarder that loses one reply: the server runs the command, the client never hears.

``lose_reply_to(pattern)`` arms it: the next request whose bytes contain ``pattern`` is
forwarded to the server, and when the server's reply comes the connection is cut instead
of delivering it. The client sees its connection fail after the server acted — as after a
socket timeout or a network cut — and redis-py resends the command once on a new
connection: the case a retried command must survive. (The listener, the sockets and their
closing are :class:`~tests.metrics.stall_proxy.StallProxy`'s; only the pumps differ.)
"""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.metrics.stall_proxy import StallProxy


class LateReplyProxy(StallProxy):
    def __init__(self, target_host: str, target_port: int) -> None:
        self._lock = threading.Lock()
        self._pattern: bytes | None = None
        self.lost = threading.Event()  # set once a reply was held back and dropped
        super().__init__(target_host, target_port)  # starts accepting: fields first

    def lose_reply_to(self, pattern: bytes) -> None:
        with self._lock:
            self._pattern = pattern
            self.lost.clear()

    def _start_pumps(self, client: socket.socket, server: socket.socket) -> None:
        held = threading.Event()  # this connection's next reply is to be lost
        threading.Thread(target=self._requests, args=(client, server, held), daemon=True).start()
        threading.Thread(target=self._replies, args=(server, client, held), daemon=True).start()

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
