"""The probes ``/healthz`` and ``/readyz`` of a real ``onceflow api`` and a real
``onceflow metrics`` exporter: alive always; ready only when Postgres and Redis answer and
the database is at the package's migration head; 503 naming the failing checks otherwise,
within the probe timeout even when the database accepts connections and never answers.
No key, no rate limit, no secret in the answer.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from onceflow.health import readiness_probe
from onceflow.settings import Settings
from tests.acceptance.procs import ROOT, Proc, api_server, free_port

pytestmark = pytest.mark.slow

APP = "tests.acceptance.stages:flow"
PASSWORD = "s3cret-probe-pw"


@pytest.fixture()
def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture()
def hung_port() -> Iterator[int]:
    """A local port that accepts TCP connections (the kernel's backlog) and never answers:
    a database that hangs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def _probe(base: str, path: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers=headers, timeout=15)


def _checks(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json"), response.text
    body: dict[str, Any] = response.json()
    assert set(body["checks"]) == {"database", "migrations", "redis"}, body
    return body


# ----------------------------------------------------------------------------- the API


def test_api_probes_answer_without_a_key_past_the_rate_limits(
    tmp_path: Path, database_url: str, redis_url: str
) -> None:
    env = {
        # No key is configured (every /v1 request is refused) and the limits are tight.
        "ONCEFLOW_API_RATE_LIMIT": "1/minute",
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "1/minute",
    }
    with api_server(tmp_path, env, app=APP) as (base, _):
        refused = [httpx.get(f"{base}/v1/workspaces/w1/counts").status_code for _ in range(3)]
        assert refused[0] == 401 and refused[-1] == 429, refused  # the limits are on
        for _ in range(5):
            alive = _probe(base, "/healthz")
            assert alive.status_code == 200 and alive.json() == {"status": "alive"}
            ready = _probe(base, "/readyz", Authorization="Bearer not-a-key")
            assert ready.status_code == 200, ready.text
            body = _checks(ready)
            assert body["status"] == "ready"
            assert all(c == {"ok": True, "detail": "ok"} for c in body["checks"].values()), body


def test_api_readyz_answers_503_within_the_timeout_on_a_hung_database(
    tmp_path: Path, database_url: str, hung_port: int, closed_port: int
) -> None:
    env = {
        "ONCEFLOW_DATABASE_URL": f"postgresql+psycopg://probe:{PASSWORD}@127.0.0.1:{hung_port}/x",
        "ONCEFLOW_REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:{closed_port}/0",
        "ONCEFLOW_PROBE_TIMEOUT_SECONDS": "1",
    }
    with api_server(tmp_path, env, app=APP) as (base, proc):
        assert _probe(base, "/healthz").status_code == 200  # alive: it serves
        for attempt in range(2):
            started = time.monotonic()
            ready = _probe(base, "/readyz")
            took = time.monotonic() - started
            assert ready.status_code == 503, ready.text
            assert took < 5, took
            body = _checks(ready)
            assert body["status"] == "not ready"
            checks = body["checks"]
            assert checks["database"]["ok"] is False, body
            if attempt == 0:
                assert checks["database"]["detail"] == "timed out after 1s", body
            # The second probe waits on the first one's check, still running (no second
            # connection): it may see that check time out for good, a second after.
            assert checks["migrations"]["ok"] is False
            assert checks["redis"]["ok"] is False
            assert checks["redis"]["detail"].startswith("unreachable"), body
            for secret in (PASSWORD, str(hung_port), str(closed_port), "127.0.0.1"):
                assert secret not in ready.text
    assert PASSWORD not in proc.log()


def test_api_readyz_names_a_database_that_is_not_migrated(
    tmp_path: Path, database_url: str, redis_url: str, empty_database: str
) -> None:
    with api_server(tmp_path, {"ONCEFLOW_DATABASE_URL": empty_database}, app=APP) as (base, _):
        ready = _probe(base, "/readyz")
    assert ready.status_code == 503, ready.text
    checks = _checks(ready)["checks"]
    assert checks["database"]["ok"] is True and checks["redis"]["ok"] is True, checks
    assert checks["migrations"]["ok"] is False
    assert "not migrated" in checks["migrations"]["detail"], checks


# ----------------------------------------------------------------------- the exporter


def _exporter(tmp_path: Path, env: dict[str, str]) -> tuple[str, Proc]:
    port = free_port()
    proc = Proc(["metrics", "--port", str(port)], tmp_path / "exporter.log", env, ROOT)
    proc.wait_log("metrics on")
    return f"http://127.0.0.1:{port}", proc


def test_exporter_probes_when_everything_answers(
    tmp_path: Path, database_url: str, redis_url: str
) -> None:
    base, proc = _exporter(tmp_path, {"PYTHONPATH": str(ROOT)})
    try:
        alive = _probe(base, "/healthz")
        ready = _probe(base, "/readyz")
        metrics = _probe(base, "/metrics")
        posted = httpx.post(f"{base}/readyz", timeout=15)
        head = httpx.head(f"{base}/readyz", timeout=15)
    finally:
        proc.stop()
    assert alive.status_code == 200 and alive.json() == {"status": "alive"}
    assert ready.status_code == 200, ready.text
    assert _checks(ready)["status"] == "ready"
    assert metrics.status_code == 200 and "onceflow_database_up 1.0" in metrics.text
    assert posted.status_code == 405
    assert head.status_code == 200 and head.content == b""


def test_exporter_readyz_answers_503_with_the_database_down(
    tmp_path: Path, redis_url: str, closed_port: int
) -> None:
    env = {
        "ONCEFLOW_DATABASE_URL": f"postgresql+psycopg://probe:{PASSWORD}@127.0.0.1:{closed_port}/x",
        "ONCEFLOW_PROBE_TIMEOUT_SECONDS": "1",
        "PYTHONPATH": str(ROOT),
    }
    base, proc = _exporter(tmp_path, env)
    try:
        alive = _probe(base, "/healthz")
        started = time.monotonic()
        ready = _probe(base, "/readyz")
        took = time.monotonic() - started
    finally:
        proc.stop()
    assert alive.status_code == 200
    assert ready.status_code == 503, ready.text
    assert took < 5, took
    checks = _checks(ready)["checks"]
    assert checks["database"]["ok"] is False
    assert checks["database"]["detail"].startswith("unreachable"), checks
    assert checks["migrations"]["ok"] is False and checks["redis"]["ok"] is True, checks
    assert PASSWORD not in ready.text and PASSWORD not in proc.log()


# ------------------------------------------------------------------------ in-process


def test_a_database_url_that_cannot_be_read_fails_the_database_check(redis_url: str) -> None:
    settings = Settings(database_url=f"mysql://probe:{PASSWORD}@db/x", redis_url=redis_url)
    ready = readiness_probe(settings)()
    assert not ready.ready and ready.failing == ["database", "migrations"]
    body = ready.body()
    assert body["checks"]["database"]["detail"] == "not configured (InvalidDatabaseUrl)"
    assert body["checks"]["redis"] == {"ok": True, "detail": "ok"}
    assert PASSWORD not in str(body)
