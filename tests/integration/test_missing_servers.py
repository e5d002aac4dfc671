"""A machine without RabbitMQ: its tests skip, saying so in one line; under CI=true they fail.

Runs pytest on one RabbitMQ test in a subprocess whose broker URL names a closed port, on
this run's Postgres and Redis.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.conftest import ROOT

RABBIT_TEST = "tests/acceptance/test_rabbitmq.py::test_a_hand_off_chain_completes"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(services: tuple[str, str], ci: str | None) -> subprocess.CompletedProcess[str]:
    db_url, redis_url = services
    child = {k: v for k, v in os.environ.items() if k != "CI"}
    child.update(
        ONCEFLOW_TEST_DATABASE_URL=db_url,
        ONCEFLOW_TEST_REDIS_URL=redis_url,
        ONCEFLOW_TEST_AMQP_URL=f"amqp://guest:guest@127.0.0.1:{_closed_port()}//",
    )
    if ci is not None:
        child["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", RABBIT_TEST, "-q", "-p", "no:randomly"],
        cwd=ROOT, env=child, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_without_rabbitmq_its_tests_skip_and_the_summary_names_it(
    services: tuple[str, str],
) -> None:
    proc = _run(services, ci=None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "1 skipped" in out, out[-3000:]
    assert "onceflow services: no RabbitMQ at amqp://" in out, out[-3000:]


def test_under_ci_a_missing_rabbitmq_fails_the_run(services: tuple[str, str]) -> None:
    proc = _run(services, ci="true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "RabbitMQ does not answer" in out, out[-3000:]
