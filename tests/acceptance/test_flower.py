"""A real Flower started with flower.cfg: auth required, and stage tasks visible by name."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from onceflow import Status
from tests.acceptance.procs import APP, ROOT, Proc, free_port, stop_all, wait_for, worker_args

pytestmark = pytest.mark.slow
CREDENTIALS = "ops:correct-horse-battery"


def get(url: str, credentials: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)  # noqa: S310 - loopback http only
    if credentials:
        token = base64.b64encode(credentials.encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - loopback
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def test_flower_refuses_to_start_without_credentials() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "flower", "--app", APP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            k: v for k, v in __import__("os").environ.items() if k != "ONCEFLOW_FLOWER_BASIC_AUTH"
        },
    )
    assert result.returncode == 1
    assert "refusing to start Flower without credentials" in result.stderr


def test_flower_requires_auth_and_lists_stage_tasks(runtime: Any, tmp_path: Path) -> None:
    port = free_port()
    flower = Proc(
        ["flower", "--app", APP, "--conf", "flower.cfg"],
        tmp_path / "flower.log",
        env={
            "ONCEFLOW_FLOWER_BASIC_AUTH": CREDENTIALS,
            "ONCEFLOW_FLOWER_PORT": str(port),
            "PYTHONPATH": str(ROOT),
        },
        cwd=ROOT,
    )
    # The worker starts beside Flower (its start-up overlaps Flower's); nothing is enqueued
    # until both answer.
    worker = Proc(worker_args("t-default", name="flower"), tmp_path / "worker-flower.log",
                  env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(base + "/api/workers")[0] != 0, timeout=60, what="Flower answers")
        assert get(base + "/api/tasks")[0] == 401
        assert get(base + "/api/tasks", "ops:wrong")[0] == 401
        assert get(base + "/")[0] == 401
        worker.wait_log(" ready.")
        result = runtime.flow.enqueue("noop", "w1", "j-flower", "main", {"value": 3})
        rid = result.request_id
        wait_for(lambda: runtime.flow.queue.get(rid).status is Status.SUCCEEDED, what="success")

        def seen() -> list[dict[str, Any]]:
            status, body = get(base + "/api/tasks", CREDENTIALS)
            if status != 200:
                return []
            tasks = json.loads(body).values()
            return [t for t in tasks if t.get("state") == "SUCCESS" and rid in str(t.get("args"))]

        [task] = wait_for(seen, timeout=30, what="the task in Flower")
        assert task["name"] == "onceflow.stage.noop"
        # The wake-up names the request by its key: id and workspace (never the token).
        key = [rid, "w1"]
        assert task["args"] in (str(key), str(tuple(key)), key)
        assert "succeeded" in str(task["result"])
        assert "token" not in json.dumps(task)
    finally:
        stop_all([worker, flower])
