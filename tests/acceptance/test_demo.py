"""The README's main command, as a newcomer runs it: on real services, and on none."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.slow


def run_demo(env: dict[str, str], *args: str) -> tuple[dict[str, Any], str]:
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    return json.loads(result.stdout), result.stderr


def test_demo_without_faults_pays_exactly_one_llm_call_per_cell(
    database_url: str, redis_url: str
) -> None:
    report, _ = run_demo(
        {"ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url},
        "--no-faults", "--jobs", "4", "--columns", "3", "--clients", "6",
    )  # fmt: skip
    assert report["invariants_ok"] is True
    assert report["embedded_services"] is False
    assert (report["cells"], report["llm_calls"], report["llm_calls_per_cell"]) == (12, 12, 1.0)
    assert report["maps_calls"] == report["commutes"] == 4
    assert report["requests_enqueued"] > report["requests_created"] == 4 * 5  # collapsed
    assert report["requests_succeeded"] == report["requests_created"]
    assert report["leases_reclaimed"] == 0 and report["op_retries"] == 0


def test_demo_with_faults_accounts_for_every_extra_call(database_url: str, redis_url: str) -> None:
    report, stderr = run_demo(
        {"ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url},
        "--jobs", "4", "--columns", "3", "--clients", "6",
    )  # fmt: skip
    assert report["invariants_ok"] is True, report["checks"]
    assert report["worker_killed"] is True
    assert "kill -9" in stderr
    assert report["requests_succeeded"] == report["requests_created"]
    assert 0 <= report["extra_llm_calls"] <= report["llm_calls_in_flight_at_kill"]
    assert report["leases_reclaimed"] >= 1  # the killed worker's requests were reclaimed
    assert report["op_retries"] >= 1  # dropped responses were retried, applied once


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fresh_machine_path_starts_embedded_services_and_cleans_up() -> None:
    pg_port, redis_port = _closed_port(), _closed_port()
    marker = uuid.uuid4().hex  # inherited by every process the demo starts
    report, stderr = run_demo(
        {
            "ONCEFLOW_DATABASE_URL": f"postgresql+psycopg://127.0.0.1:{pg_port}/onceflow",
            "ONCEFLOW_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
            "ONCEFLOW_TEST_MARKER": marker,
        },
        "--no-faults", "--jobs", "2", "--columns", "2", "--clients", "4",
    )  # fmt: skip
    assert "starting the embedded servers" in stderr
    assert report["embedded_services"] is True
    assert report["invariants_ok"] is True
    assert report["llm_calls_per_cell"] == 1.0
    # Nothing left behind: no server, worker or beat process that the demo started survives.
    assert [p.pid for p in psutil.process_iter() if _has_marker(p, marker)] == []


def _has_marker(proc: psutil.Process, marker: str) -> bool:
    try:
        return proc.environ().get("ONCEFLOW_TEST_MARKER") == marker
    except (psutil.Error, OSError):
        return False
