"""``onceflow demo --browser``: a real headless Chromium tab among the demo's clients.

The tab imports the SDK from the demo's own ``onceflow api``, claims ``evaluate`` requests of
the pull class ``tabs`` with a PullWorker, computes cells with ``ctx.computeOnce`` against the
same compute locks as the Celery workers, calls the counting LLM stand-in, and writes cards
with a WorkspaceClient. The invariants hold with it: one provider call per cell.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.acceptance.procs import ROOT
from tests.acceptance.test_demo import redis_left_as_found
from tests.browser.conftest import CHROMIUM

pytestmark = pytest.mark.slow
SMALL = ["--jobs", "2", "--columns", "2", "--clients", "4", "--no-faults"]


def demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "demo", *args],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip


def test_demo_with_a_browser_tab_keeps_every_invariant(database_url: str, redis_url: str) -> None:
    if shutil.which(CHROMIUM) is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI: Debian's chromium is not installed at {CHROMIUM}")
        pytest.skip(f"Debian's chromium is not installed at {CHROMIUM}")
    env = {"ONCEFLOW_DATABASE_URL": database_url, "ONCEFLOW_REDIS_URL": redis_url}
    # The dashboard tests' Celery worker (package-scoped) may still declare its own queues.
    with redis_left_as_found(redis_url, ignore=(b"t-dash",)):  # api and tab leave no key
        result = demo(env, "--json", "--browser", *SMALL)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    report: dict[str, Any] = json.loads(result.stdout)
    tab = report["browser"]
    assert tab is not None, report
    assert (tab["error"], tab["stage_errors"]) == (None, [])
    # The tab claimed and ran its own evaluate requests (one per job), each succeeded...
    assert tab["stages_run"] >= tab["requests_created"] == tab["requests_succeeded"] == 2
    assert tab["leader"] is True  # the one leader of this browser (Web Locks)
    # ...got every cell of them through computeOnce, by one of the protocol's paths...
    assert tab["cells"] == 2 * 2
    assert set(tab["paths"]) <= {"preflight", "waited", "double_check", "computed"}
    assert tab["cards_written"] == 2  # ...and its WorkspaceClient's cards were acknowledged.
    # With the tab among the clients, still one provider call per cell, and every invariant.
    assert (report["cells"], report["llm_calls"]) == (4, 4)
    assert report["checks"]["the browser tab ran its stages (a PullWorker in Chromium)"] is True
    assert tab["keys_logged"] is False  # the api's log and the page's console: no key
    assert all(report["checks"].values()), report["checks"]
    assert report["invariants_ok"] is True
    assert report["requests_created"] == 2 * 6  # 4 stages + the agent's and the tab's branches
    assert "of_demo_" not in result.stdout + result.stderr  # the run's keys are never printed


def test_demo_browser_without_chromium_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Any,
) -> None:
    # Nothing answers at this database URL: had the demo started anything, it would say so.
    env = {
        "ONCEFLOW_CHROMIUM": str(tmp_path / "no-chromium"),
        "ONCEFLOW_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
    }
    result = demo(env, "--browser", *SMALL)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--browser needs Chromium at" in lines[0] and "nothing was started" in lines[0]
