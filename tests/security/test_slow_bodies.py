"""Slow bodies against a real `onceflow api`: a client that drips its body cannot hold
a connection (and a worker thread) for long, nor make other clients wait.

The test server gives a body 2 s to arrive (``ONCEFLOW_API_BODY_TIMEOUT_SECONDS``).
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
from sqlalchemy import Engine

from tests.acceptance.test_http_api import API_KEY, BODY_LIMIT, auth, snapshot

SLOW_CLIENTS = 40


def start_slow_body(base: str, path: str, body: bytes, sent: int) -> socket.socket:
    """A connection that sent its headers and the first ``sent`` bytes of ``body``."""
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body[:sent])
    return sock


def answer_of(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection, or the deadline."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        chunks.append(data)
    sock.close()
    return b"".join(chunks)


def test_slow_bodies_get_408_and_other_clients_are_served(
    api: str, client: httpx.Client, clean_db: Engine
) -> None:
    before = snapshot(clean_db)
    body = json.dumps({"stage": "noop", "job_id": "j-slow", "input": {"value": 1}}).encode()
    slow = [
        start_slow_body(api, "/v1/workspaces/w1/requests", body, len(body) // 2)
        for _ in range(SLOW_CLIENTS)
    ]
    # A client that keeps dripping one byte at a time is bounded by the same deadline.
    drip = start_slow_body(api, "/v1/workspaces/w1/requests", body, 1)
    # One that declares a body over the limit and stalls: 413, not a wait for the rest.
    oversize = start_slow_body(api, "/v1/workspaces/w1/requests", b"x" * 2 * BODY_LIMIT, 10)

    # While they hang, every other client is answered.
    for i in range(5):
        listed = client.get("/v1/workspaces/w1/requests", headers=auth(API_KEY))
        assert listed.status_code == 200, listed.text
        made = client.post(
            "/v1/workspaces/w1/requests",
            json={"stage": "noop", "job_id": f"j-fast-{i}", "input": {"value": i}},
            headers=auth(API_KEY),
        )
        assert made.status_code == 201, made.text
        drip.sendall(body[1 + i : 2 + i])

    deadline = time.monotonic() + 15  # for all of them: the server's bound is 2 s
    answers = [answer_of(sock, deadline) for sock in [*slow, drip]]
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b'"code":"request_timeout"' in answer.replace(b" ", b"")
    assert answer_of(oversize, deadline).startswith(b"HTTP/1.1 413 ")
    # Nothing of the slow requests was written: only the five fast ones are new.
    rows = snapshot(clean_db)["workspace_process_requests"]
    assert len(rows) == len(before["workspace_process_requests"]) + 5
