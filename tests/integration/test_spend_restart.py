"""A Redis restart mid-window (no persistence: the provider's state is gone) does not let
the limits grant more than one window's worth: the window counts as full until it has
passed. A Redis server of the test's own is restarted; the shared one is never touched."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from onceflow.errors import LimitsUnavailable, PermitTimeout
from onceflow.spend import Provider
from tests.integration.redis_cluster import server_binary
from tests.integration.spend_parts import most_in_any_window, redis_ms


class OwnRedis:
    """A redis-server without persistence on a free port, which the test restarts."""

    def __init__(self) -> None:
        binary = server_binary()
        if binary is None:
            pytest.fail("no redis-server or valkey-server binary to restart")
        self.binary = binary
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                if probe.ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture()
def own_redis() -> Iterator[OwnRedis]:
    server = OwnRedis()
    server.start()
    yield server
    server.stop()


def _grants_around_a_restart(server: OwnRedis, cold_start: str) -> tuple[list[int], int, Provider]:
    """Take permits as fast as they come (rpm 10 over 2 s windows); restart the server half a
    second after the first window is full; go on 3 s more. (grant times, restart ms, provider)."""
    provider = Provider(f"p-{uuid.uuid4().hex[:8]}", rpm=10, window_seconds=2,
                        cold_start=cold_start, redis_url=server.url)  # type: ignore[arg-type]  # fmt: skip
    grants: list[int] = []
    restarted_at = 0
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if len(grants) == 10 and not restarted_at:
            time.sleep(0.5)
            server.stop()
            server.start()
            restarted_at = redis_ms(server.url)
            end = time.monotonic() + 3.0
        try:
            with provider.permit("ws", timeout=0) as permit:
                grants.append(permit.granted_at_ms)
        except (PermitTimeout, LimitsUnavailable):
            time.sleep(0.01)
    return grants, restarted_at, provider


@pytest.mark.slow
@pytest.mark.parametrize("cold_start", ["known", "full"])
def test_after_a_restart_the_window_counts_as_full(own_redis: OwnRedis, cold_start: str) -> None:
    grants, restarted_at, provider = _grants_around_a_restart(own_redis, cold_start)
    assert most_in_any_window(grants, 2000) <= 10
    after = [g for g in grants if g > restarted_at]
    assert after, "the limits never came back after the restart"
    assert min(after) >= restarted_at + 2000 - 5  # a whole window of caution
    assert provider.stats()["state_lost"] == 1  # counted by the new server


@pytest.mark.slow
def test_cold_start_empty_trusts_the_restarted_server(own_redis: OwnRedis) -> None:
    """What ``cold_start="empty"`` means: right after a restart the window is taken as
    empty, and the window that spans the restart is granted twice over."""
    grants, restarted_at, _ = _grants_around_a_restart(own_redis, "empty")
    assert min(g for g in grants if g > restarted_at) < restarted_at + 1000
    assert most_in_any_window(grants, 2000) > 10
