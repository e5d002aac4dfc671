"""``onceflow demo --trace``, run as a user runs it: every process of the demo exports its
spans over OTLP/HTTP to the demo's receiver, and the report ends with one request's trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_demo_prints_one_request_trace_across_its_processes(
    database_url: str, redis_url: str
) -> None:
    env = {**os.environ, "ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url}
    args = ["demo", "--trace", "--json", "--no-faults", "--jobs", "1", "--columns", "1",
            "--clients", "2"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    report = json.loads(result.stdout)
    assert report["invariants_ok"] is True
    found = report["trace"]
    lines = found["tree"].splitlines()
    assert lines[0] == f"trace {found['trace_id']}"
    # The root is the demo client's span; the enqueue that created the request is its child.
    assert lines[1].startswith("demo [onceflow-demo]  +0.0 ms, ")
    assert any(line.startswith("  onceflow.enqueue [onceflow-demo]  +") for line in lines)
    # The worker that ran the request continued the same trace, reported in its own name.
    assert found["complete"] is True, found
    assert any(s.startswith("onceflow-worker-") for s in found["services"]), found
    assert any("[onceflow-worker-" in line for line in lines[2:]), found["tree"]


def test_without_the_sdk_it_names_the_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"  # as if not installed
        "from onceflow.cli import main\n"
        "main(['demo', '--trace'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--trace needs the OpenTelemetry SDK" in result.stderr
    assert "pip install 'onceflow[otel]'" in result.stderr
