"""Redis for a benchmark: its URL, a private server of the run's own, probes, and a
per-process client for the stage modules the workers import."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.harness.processes import wait_until


def bench_redis_url(default: str) -> str:
    """``ONCEFLOW_BENCH_REDIS_URL``, else ``default`` (each benchmark its own database
    number, so that two never share keys)."""
    return os.environ.get("ONCEFLOW_BENCH_REDIS_URL", default)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_binary() -> str:
    """``redis-server`` or ``valkey-server`` on PATH, else the embedded extra's Valkey."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        from onceflow.embedded import _valkey_executable

        binary = str(_valkey_executable())
    return binary


def start_redis(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A Redis server on ``port`` that keeps nothing on disk."""
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def redis_answers(url: str) -> bool:
    """Whether the Redis server at ``url`` answers PING (within a second)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def redis_version(url: str) -> str | None:
    """The version of the Redis server at ``url``."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        return client.info("server").get("redis_version")
    finally:
        client.close()


_redis: tuple[int, Any] | None = None


def process_redis() -> Any:
    """This process's Redis client at the settings' URL, made again in a forked child (a
    worker's pool children each get their own)."""
    global _redis
    if _redis is None or _redis[0] != os.getpid():
        import redis

        from onceflow.settings import get_settings

        _redis = (os.getpid(), redis.Redis.from_url(get_settings().redis_url))
    return _redis[1]


@contextmanager
def private_redis() -> Iterator[str]:
    """A Redis of this run's own on a free port (nothing on disk): its URL, once it answers."""
    port = free_port()
    proc = start_redis(redis_binary(), port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        if not wait_until(lambda: redis_answers(url), timeout=30, interval=0.05):
            raise RuntimeError(f"the private Redis on port {port} did not answer in 30 s")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
