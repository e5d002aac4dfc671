"""The API's /metrics keeps unseen pids' live gauges; the API and the exporter can leave out
the database collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import Engine

from onceflow.integrations.fastapi.auth import hash_key
from tests.acceptance.procs import ROOT, Proc, api_server, free_port
from tests.metrics.test_exposure import APP, VIEWER, get

_WRITER = """
from prometheus_client import Gauge
Gauge("rev_live_probe", "a live gauge", multiprocess_mode="livesum").set(1)
"""


def test_api_metrics_keep_unseen_pids_and_skip_the_database_when_told(
    tmp_path: Path, clean_db: Engine
) -> None:
    prom = tmp_path / "prom"
    prom.mkdir()
    # A process that wrote a live gauge and is gone (as seen from here: like a worker in
    # another pid namespace, whose pid this API cannot see).
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    subprocess.run([sys.executable, "-c", _WRITER], env=env, check=True, timeout=60)
    files = sorted(p.name for p in prom.iterdir())
    assert any(name.startswith("gauge_livesum_") for name in files), files
    server_env = {
        "ONCEFLOW_OPERATOR_KEYS": json.dumps({hash_key(VIEWER): ["viewer"]}),
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
        "ONCEFLOW_METRICS_DATABASE": "false",
    }
    with api_server(tmp_path, server_env, app=APP) as (base, _proc):
        status, body = get(f"{base}/metrics", VIEWER)
    assert status == 200
    assert "rev_live_probe 1.0" in body  # the unseen pid's live gauge is still served
    assert set(files) <= {p.name for p in prom.iterdir()}  # and its file is still there
    assert "onceflow_database_up" not in body  # no database collector on this target


def test_exporter_without_database_runs_no_count(tmp_path: Path, database_url: str) -> None:
    prom = tmp_path / "prom"
    prom.mkdir()
    port = free_port()
    env = {
        "ONCEFLOW_DATABASE_URL": database_url,
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
        "PYTHONPATH": str(ROOT),
    }
    args = ["metrics", "--port", str(port), "--no-database"]
    proc = Proc(args, tmp_path / "exporter.log", env, ROOT)
    try:
        proc.wait_log("metrics on")
        status, body = get(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.stop()
    assert status == 200
    assert "onceflow_database_up" not in body and "# TYPE onceflow_requests gauge" not in body
