"""Long-running processes refuse, in one line and at once, a database that answers but is not
migrated to the package's head (they used to log a missing table every few seconds)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import make_url

from tests.conftest import ROOT, libpq


@pytest.fixture()
def unmigrated(services: tuple[str, str]) -> Iterator[str]:
    admin, _ = services
    name = f"onceflow_bare_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize(
    "argv",
    [
        ["work", "tests.integration.worker_app:double", "-w", "w"],
        ["beat", "--app", "tests.acceptance.stages:flow"],
        ["worker", "--app", "tests.acceptance.stages:flow"],
    ],
    ids=["work", "beat", "worker"],
)
def test_a_database_not_migrated_is_refused_at_start(unmigrated: str, argv: list[str]) -> None:
    env = {**os.environ, "ONCEFLOW_DATABASE_URL": unmigrated}
    proc = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "not migrated" in line]
    assert len(lines) == 1 and "onceflow migrate" in lines[0], proc.stderr[-2000:]
    assert "NotMigrated" not in proc.stderr  # refused up front, not met in a loop
