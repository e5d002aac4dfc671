"""``onceflow api --workers 2``: two API processes on one port, sharing only Postgres and
Redis. A long-poll claim waiting in one process is woken by an enqueue sent through the
other (the database's NOTIFY reaches every process's listener).

Which process serves a connection is read from the operating system: the uvicorn child
whose socket has the client's port at its far end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest
from sqlalchemy import Engine

from onceflow.demo.procs import Proc
from onceflow.integrations.fastapi import hash_key
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import _ENV, APP, ROOT, free_port, wait_for
from tests.integration.test_wait_for_work import checked_since, db_now

pytestmark = pytest.mark.slow

API_KEY = "of_test_api_workers_api_0123456789abcdef"
WORKER_KEY = "of_test_api_workers_pull_0123456789ab"
PULL = "t-pull"
# Clients opened to find one served by the other process; the kernel spreads accepts.
TRIES = 40


@pytest.fixture()
def api(tmp_path_factory: pytest.TempPathFactory, runtime: object) -> Iterator[tuple[str, Proc]]:
    port = free_port()
    env = {
        **_ENV,
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): ["w1"]}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(WORKER_KEY): [PULL]}),
        "ONCEFLOW_API_RATE_LIMIT": "",
    }
    args = ["api", "--app", APP, "--port", str(port), "--workers", "2"]
    proc = Proc(args, tmp_path_factory.mktemp("api2") / "api.log", env=env, cwd=ROOT)
    try:
        wait_for(lambda: proc.log().count("Application startup complete") >= 2, what="2 workers")
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


def served_by(proc: Proc, client_port: int) -> int:
    """The pid of the API process whose accepted socket talks to ``client_port``."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        for conn in child.net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == client_port:
                return child.pid
    raise AssertionError(f"no API process serves client port {client_port}")


def connected(url: str, key: str, proc: Proc) -> tuple[httpx.Client, int]:
    """A keep-alive client and the pid of the process its connection landed on."""
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    probe = http.get("/healthz")
    assert probe.status_code == 200, probe.text
    _, port = probe.extensions["network_stream"].get_extra_info("client_addr")
    return http, served_by(proc, port)


def test_a_waiter_in_one_process_is_woken_by_an_enqueue_through_the_other(
    api: tuple[str, Proc], clean_db: Engine
) -> None:
    url, proc = api
    enqueuer, enqueue_pid = connected(url, API_KEY, proc)
    clients = [enqueuer]
    try:
        waiter = None
        for _ in range(TRIES):
            http, pid = connected(url, WORKER_KEY, proc)
            clients.append(http)
            if pid != enqueue_pid:
                waiter = http
                break
        assert waiter is not None, "every connection landed on one process"

        since = db_now(clean_db)
        answers: list[httpx.Response] = []
        poll = threading.Thread(
            target=lambda: answers.append(
                waiter.post(
                    f"/v1/worker-classes/{PULL}/claims", json={"worker_id": "other", "wait": 30}
                )
            )
        )
        poll.start()
        # It sleeps in its process's line (whose look at the database shows the wait).
        wait_for(lambda: checked_since(clean_db, since), what="the waiter to sleep")
        made = enqueuer.post(
            "/v1/workspaces/w1/requests",
            json={
                "stage": "noop",
                "job_id": "across",
                "input": {"value": 1},
                "worker_class": PULL,
            },
        )
        assert made.status_code == 201, made.text
        poll.join(60)
        assert not poll.is_alive()
        (answer,) = answers
        assert answer.status_code == 201, answer.text
        assert answer.json()["request_id"] == made.json()["request_id"]
        # The connections did not move: the enqueue went through one process, the claim
        # through the other.
        _, port = answer.extensions["network_stream"].get_extra_info("client_addr")
        assert served_by(proc, port) != enqueue_pid
    finally:
        for http in clients:
            http.close()
