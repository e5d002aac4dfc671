"""A small loopback TCP fault proxy for the chaos suite: latency, blackhole, reset, refuse.

Runs as its own process (so its forwarding never competes with the harness for the GIL)::

    python bench/faultproxy.py --upstream 127.0.0.1:5432

It prints one line, ``LISTEN <port> CONTROL <port>``, then forwards every connection made to
``LISTEN`` to the upstream. The harness changes the faults at run time over the control port,
one JSON object per line, each answered by one JSON line (:class:`ProxyControl` does this):

* ``{"cmd": "latency", "seconds": 0.2}`` — every chunk, both directions, is delivered that much
  later (order kept; throughput is not serialised by the delay);
* ``{"cmd": "blackhole", "on": true}`` — nothing is forwarded either way and new connections
  hang (accepted, never answered): a partition. Held data flows again when it is lifted, as TCP
  retransmission would deliver it;
* ``{"cmd": "reset"}`` — every open connection is closed with a TCP reset (both sides);
* ``{"cmd": "refuse", "on": true}`` — new connections are reset at once;
* ``{"cmd": "upstream", "host": "127.0.0.1", "port": 5433}`` — where new connections go;
* ``{"cmd": "stats"}`` — connections open and accepted so far.

Loopback only: it binds 127.0.0.1 and refuses an upstream elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
CHUNK = 65536


@dataclass
class _State:
    upstream: tuple[str, int]
    latency: float = 0.0
    refuse: bool = False
    open_gate: asyncio.Event = field(default_factory=asyncio.Event)
    conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = field(
        default_factory=set
    )
    accepted: int = 0


def _abort(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN: the peer sees ECONNRESET."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport = writer.transport
    with contextlib.suppress(Exception):
        transport.abort()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, st: _State) -> None:
    """Forward one direction: a reader task stamps chunks, a writer task delivers them when due.

    Raises if either side fails (a reset), so the caller can reset the other connection too.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        while True:
            data = await reader.read(CHUNK)
            await queue.put((loop.time() + st.latency, data))
            if not data:
                return

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write_eof()
                return
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await st.open_gate.wait()
            writer.write(data)
            await writer.drain()

    tasks = [asyncio.create_task(receive()), asyncio.create_task(deliver())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            exc = task.exception()
            if exc is not None:
                raise exc
    finally:
        for task in tasks:
            task.cancel()


async def _handle(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, st: _State
) -> None:
    st.accepted += 1
    if st.refuse:
        _abort(client_w)
        return
    up_w: asyncio.StreamWriter | None = None
    key: tuple[asyncio.StreamWriter, asyncio.StreamWriter | None] = (client_w, None)
    st.conns.add(key)
    try:
        await st.open_gate.wait()  # a blackhole: the connection hangs until it is lifted
        try:
            up_r, up_w = await asyncio.open_connection(*st.upstream)
        except OSError:
            _abort(client_w)
            return
        st.conns.discard(key)
        key = (client_w, up_w)
        st.conns.add(key)
        pending = {
            asyncio.create_task(_pump(client_r, up_w, st)),
            asyncio.create_task(_pump(up_r, client_w, st)),
        }
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                # One side was reset (a server crash, a killed backend): reset the other side
                # too, as a real connection would fail, instead of leaving it hanging.
                _abort(client_w)
                _abort(up_w)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
    finally:
        st.conns.discard(key)
        for w in (client_w, up_w):
            if w is not None:
                with contextlib.suppress(Exception):
                    w.close()


async def _control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, st: _State) -> None:
    while line := await reader.readline():
        try:
            msg = json.loads(line)
            reply = _apply(msg, st)
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": str(exc)}
        writer.write((json.dumps(reply) + "\n").encode())
        await writer.drain()
    writer.close()


def _apply(msg: dict[str, Any], st: _State) -> dict[str, Any]:
    cmd = msg["cmd"]
    if cmd == "latency":
        st.latency = max(0.0, float(msg["seconds"]))
    elif cmd == "blackhole":
        if msg["on"]:
            st.open_gate.clear()
        else:
            st.open_gate.set()
    elif cmd == "reset":
        for client_w, up_w in list(st.conns):
            _abort(client_w)
            _abort(up_w)
    elif cmd == "refuse":
        st.refuse = bool(msg["on"])
    elif cmd == "upstream":
        host = str(msg.get("host", LOOPBACK))
        if host != LOOPBACK:
            raise ValueError("the fault proxy forwards to loopback only")
        st.upstream = (host, int(msg["port"]))
    elif cmd != "stats":
        raise ValueError(f"unknown command {cmd!r}")
    return {
        "ok": True,
        "open": len(st.conns),
        "accepted": st.accepted,
        "latency": st.latency,
        "blackhole": not st.open_gate.is_set(),
        "refuse": st.refuse,
    }


async def serve(upstream: tuple[str, int], listen_port: int = 0) -> None:
    """Run the proxy until cancelled; announce the ports on stdout."""
    if upstream[0] != LOOPBACK:
        raise SystemExit("faultproxy: the upstream must be on 127.0.0.1")
    st = _State(upstream)
    st.open_gate.set()
    proxy = await asyncio.start_server(lambda r, w: _handle(r, w, st), LOOPBACK, listen_port)
    control = await asyncio.start_server(lambda r, w: _control(r, w, st), LOOPBACK, 0)
    port = proxy.sockets[0].getsockname()[1]
    cport = control.sockets[0].getsockname()[1]
    print(f"LISTEN {port} CONTROL {cport}", flush=True)
    async with proxy, control:
        await asyncio.gather(proxy.serve_forever(), control.serve_forever())


class ProxyControl:
    """The harness's handle on a proxy process: start it, change its faults, stop it."""

    def __init__(self, upstream_port: int, log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--upstream",
             f"{LOOPBACK}:{upstream_port}"],
            stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().decode().split()
        if len(line) != 4 or line[0] != "LISTEN":
            self.stop()
            raise RuntimeError(f"fault proxy did not start (see {log})")
        self.port = int(line[1])
        self._sock = socket.create_connection((LOOPBACK, int(line[3])), timeout=10)
        self._file = self._sock.makefile("rwb")

    def command(self, cmd: str, **args: Any) -> dict[str, Any]:
        """Send one control command; its JSON answer (raises if the proxy refused it)."""
        self._file.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self._file.flush()
        reply: dict[str, Any] = json.loads(self._file.readline())
        if not reply.get("ok"):
            raise RuntimeError(f"fault proxy refused {cmd}: {reply}")
        return reply

    def latency(self, seconds: float) -> None:
        """Delay every chunk by ``seconds`` (0: none)."""
        self.command("latency", seconds=seconds)

    def blackhole(self, on: bool) -> None:
        """Start or end a partition."""
        self.command("blackhole", on=on)

    def reset(self) -> None:
        """Reset every open connection."""
        self.command("reset")

    def heal(self) -> None:
        """No latency, no blackhole, no refusal."""
        self.command("latency", seconds=0.0)
        self.command("blackhole", on=False)
        self.command("refuse", on=False)

    def stop(self) -> None:
        """Stop the proxy process (its whole group), always."""
        with contextlib.suppress(Exception):
            self._sock.close()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    """``python bench/faultproxy.py --upstream 127.0.0.1:PORT [--listen-port N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--upstream", required=True, help="127.0.0.1:PORT")
    parser.add_argument("--listen-port", type=int, default=0)
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    started = time.monotonic()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve((host, int(port)), args.listen_port))
    print(f"faultproxy: stopped after {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
