"""The demo's counting stand-ins: a request sent by a caller that was then killed is counted
before the demo takes its count (``StandIn.quiesce``), so every extra provider call of the
kill fault is accounted for (a flake of ``test_demo_with_faults_…`` under load)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading

from onceflow.demo.standins import StandIn, _Handler

KEY = "test-key"

# A caller that writes ``n`` whole chat-completion requests (one per connection), says so,
# and waits to be killed without reading an answer; with ``partial``, one more connection
# gets half a request line.
CALLER = textwrap.dedent(
    """
    import json, socket, sys, time
    port, n, partial = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    conns = []
    for i in range(n):
        body = json.dumps({"model": "m", "messages": [
            {"role": "user", "content": f"cell: job-{i}/eval:fit\\nscore it"}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\n"
                f"Authorization: Bearer test-key\\r\\nContent-Type: application/json\\r\\n"
                f"Content-Length: {len(body)}\\r\\n\\r\\n").encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + body)
        conns.append(s)
    if partial:
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/compl")
        conns.append(s)
    print("sent", flush=True)
    time.sleep(600)
    """
)


def _killed_caller(server: StandIn, n: int, *, partial: bool = False) -> None:
    """Run CALLER against ``server`` while the server cannot read (its lock held, so its
    serving thread waits to accept: the requests pile up in the kernel's queue, as on a
    loaded machine), kill -9 it once it has written everything, then let the server go."""
    port = str(server.server_address[1])
    with server._lock:  # the stand-in's own lock: accepting and counting wait on it
        proc = subprocess.Popen(
            [sys.executable, "-c", CALLER, port, str(n), "1" if partial else "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            with selectors.DefaultSelector() as sel:  # a deadline on the caller's word
                sel.register(proc.stdout, selectors.EVENT_READ)
                assert sel.select(timeout=60), "the caller did not finish writing in 60 s"
            assert proc.stdout.readline().strip() == "sent"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            proc.stdout.close()  # type: ignore[union-attr]


def test_requests_of_a_killed_caller_are_all_counted_once_quiesced() -> None:
    server = StandIn("llm", latency=0.01, api_key=KEY).start()
    try:
        _killed_caller(server, 20, partial=True)
        assert server.quiesce(timeout=30)
        per_key = server.stats()["per_key"]
        assert per_key == {f"job-{i}/eval:fit": 1 for i in range(20)}
    finally:
        server.stop()


def test_an_idle_connection_holds_no_request_and_is_not_waited_for() -> None:
    server = StandIn("llm", latency=0.01, api_key=KEY).start()
    try:
        host, port = server.server_address[:2]
        with socket.create_connection((str(host), int(port))):  # a browser's preconnect
            _killed_caller(server, 3)
            assert server.quiesce(timeout=30)
            assert server.stats()["total"] == 3
    finally:
        server.stop()


class _StallingHandler(_Handler):
    """Stalls a request after it was read off the socket, before anything looks at it: the
    moment a loaded machine can deschedule a handler thread for."""

    go = threading.Event()

    def parse_request(self) -> bool:
        if self.raw_requestline.startswith(b"POST"):  # a call; not quiesce's own probe
            self.go.wait(timeout=60)
        return super().parse_request()


class _StallingStandIn(StandIn):
    handler = _StallingHandler


def test_a_request_read_but_not_yet_counted_is_waited_for() -> None:
    """A live caller's whole request taken off the socket (nothing left to read there), its
    handler not yet past the request line: quiesce must not call that settled."""
    _StallingHandler.go.clear()
    server = _StallingStandIn("llm", latency=0.01, api_key=KEY).start()
    try:
        host, port = server.server_address[:2]
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "cell: job-1/eval:fit\nx"}]}
        ).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((str(host), int(port))) as caller:
            caller.sendall(head + body)
            assert not server.quiesce(timeout=1.0)  # the stalled request is not counted yet
            assert server.stats()["total"] == 0
            _StallingHandler.go.set()
            assert server.quiesce(timeout=30)
            assert server.stats()["per_key"] == {"job-1/eval:fit": 1}
    finally:
        _StallingHandler.go.set()
        server.stop()


def test_quiesce_on_a_stopped_server_says_false_instead_of_raising() -> None:
    server = StandIn("llm", latency=0.01, api_key=KEY).start()
    server.stop()
    assert server.quiesce(timeout=2) is False


def test_stats_over_http_are_not_counted_as_calls() -> None:
    import urllib.request

    server = StandIn("llm", latency=0.01, api_key=KEY).start()
    try:
        assert server.quiesce(timeout=30)
        with urllib.request.urlopen(f"{server.url}/stats", timeout=10) as resp:  # noqa: S310
            assert json.load(resp) == {"total": 0, "per_key": {}}
    finally:
        server.stop()
