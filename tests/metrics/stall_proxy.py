"""A TCP forwarder in front of Postgres that a test can stall (stop forwarding, keep open).

A stalled proxy holds what it received (nothing is closed, nothing answers): a paused
server or a black-holed network as the client sees it. ``resume()`` forwards what it held.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Self

from sqlalchemy import make_url


class StallProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def for_url(cls, url: str) -> tuple[StallProxy, str]:
        """A proxy in front of ``url``'s server and the URL going through it."""
        parsed = make_url(url)
        proxy = cls(parsed.host or "127.0.0.1", parsed.port or 5432)
        through = parsed.set(host="127.0.0.1", port=proxy.port)
        return proxy, through.render_as_string(hide_password=False)

    def stall(self) -> None:
        self._forwarding.clear()

    def resume(self) -> None:
        self._forwarding.set()

    def close(self) -> None:
        self._closed = True
        self._forwarding.set()
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> Self:
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
            self._forwarding.wait()  # a stalled server does not answer new connections either
            server = socket.create_connection(self._target)
            self._socks += [client, server]
            self._start_pumps(client, server)

    def _start_pumps(self, client: socket.socket, server: socket.socket) -> None:
        """Forward both ways (a subclass may pump otherwise)."""
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._forwarding.wait()  # stalled: hold it, close nothing
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
