"""Long-running processes refuse to start wrong, in one line and at once: a database that
answers but is not migrated to the package's head (they used to log a missing table every
few seconds), a Flow with no stage to run, an app module that raises when imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _cli(argv: list[str], database_url: str) -> subprocess.CompletedProcess[str]:
    """``onceflow <argv>`` on ``database_url``, as a process of its own (60 s at most)."""
    env = {**os.environ, "ONCEFLOW_DATABASE_URL": database_url}
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["work", "tests.integration.worker_app:double", "-w", "w"],
        ["beat", "--app", "tests.acceptance.stages:flow"],
        ["worker", "--app", "tests.acceptance.stages:flow"],
    ],
    ids=["work", "beat", "worker"],
)
def test_a_database_not_migrated_is_refused_at_start(empty_database: str, argv: list[str]) -> None:
    proc = _cli(argv, empty_database)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "not migrated" in line]
    assert len(lines) == 1 and "onceflow migrate" in lines[0], proc.stderr[-2000:]
    assert "NotMigrated" not in proc.stderr  # refused up front, not met in a loop


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["worker", "--app", "tests.integration.empty_flow:flow"], "no stage a Celery worker runs"),
        (["beat", "--app", "tests.integration.empty_flow:flow"], "declares no stages"),
        (["worker", "--app", "tests.integration.broken_app:flow"], "raised RuntimeError"),
        (["beat", "--app", "tests.integration.broken_app:flow"], "raised RuntimeError"),
    ],
    ids=["worker-no-stages", "beat-no-stages", "worker-broken-app", "beat-broken-app"],
)
def test_nothing_to_run_or_an_app_that_raises_is_refused_in_one_line(
    database_url: str, argv: list[str], says: str
) -> None:
    proc = _cli(argv, database_url)
    assert proc.returncode != 0
    assert says in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
