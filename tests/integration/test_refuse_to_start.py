"""Long-running processes refuse, in one line and at once, a database that answers but is not
migrated to the package's head (they used to log a missing table every few seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


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
    env = {**os.environ, "ONCEFLOW_DATABASE_URL": empty_database}
    proc = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "not migrated" in line]
    assert len(lines) == 1 and "onceflow migrate" in lines[0], proc.stderr[-2000:]
    assert "NotMigrated" not in proc.stderr  # refused up front, not met in a loop
