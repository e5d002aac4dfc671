"""The README's main command, as a newcomer runs it: on real services, and on none."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import psutil
import pytest
from sqlalchemy import make_url


def run_demo(env: dict[str, str]) -> tuple[dict[str, object], str]:
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "demo", "--json", "--jobs", "10"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_demo_on_the_configured_database(database_url: str) -> None:
    report, _ = run_demo({"ONCEFLOW_DATABASE_URL": database_url})
    assert report["invariants_ok"] is True
    assert report["embedded"] is False
    assert (report["requests_enqueued"], report["requests_created"]) == (80, 10)
    assert report["stage_runs"] == report["succeeded"] == 20
    assert report["runs_per_request_max"] == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_fresh_machine_path_starts_embedded_postgres_and_cleans_up() -> None:
    pg_port, redis_port = _closed_port(), _closed_port()
    before = {p.pid for p in psutil.process_iter()}
    report, stderr = run_demo(
        {
            "ONCEFLOW_DATABASE_URL": f"postgresql+psycopg://127.0.0.1:{pg_port}/onceflow",
            "ONCEFLOW_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        }
    )
    assert "starting the embedded PostgreSQL" in stderr
    assert report["embedded"] is True
    assert report["invariants_ok"] is True
    assert report["runs_per_request_max"] == 1
    # Nothing left behind: the embedded server's port is closed and no postgres lingers.
    port = make_url(str(report["database"])).port
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(port or 0))) != 0
    # (Matched on the port: other suites may run embedded servers of their own meanwhile.)
    leftovers = [
        p.info for p in psutil.process_iter(["pid", "name", "cmdline"])
        if p.info["pid"] not in before
        and p.info["name"] in ("postgres", "valkey-server")
        and str(port) in " ".join(p.info["cmdline"] or [])
    ]  # fmt: skip
    assert leftovers == []
