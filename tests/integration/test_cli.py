"""The ``onceflow`` CLI as scripts use it: real subprocesses on the test database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import Engine

from onceflow.ids import request_id_for
from onceflow.keys import queue_name
from tests.conftest import table_snapshot


def onceflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_enqueue_show_status(clean_db: Engine) -> None:
    args = ["enqueue", "--stage", "evaluate", "--workspace", "w1", "--job", "j1",
            "--branch-path", "main", "--worker-class", "llm",
            "--input", '{"cols": ["fit"]}']  # fmt: skip
    first = onceflow(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    rid = request_id_for("w1", "j1", "main", "evaluate")
    assert out == {"request_id": rid, "created": True, "status": "queued", "input_mismatch": False}
    second = json.loads(onceflow(*args).stdout)
    assert (second["request_id"], second["created"]) == (rid, False)

    # The four reads change nothing, so they run side by side.
    reads = [("show", rid, "--json"), ("show", rid), ("status", "--json"), ("status",)]
    with ThreadPoolExecutor(len(reads)) as pool:
        shown, shown_text, status, status_text = pool.map(lambda a: onceflow(*a), reads)
    assert shown.returncode == 0, shown.stderr
    row = json.loads(shown.stdout)
    assert (row["status"], row["input"], row["worker_class"]) == (
        "queued",
        {"cols": ["fit"]},
        "llm",
    )
    assert "claim_token" not in row
    assert rid in shown_text.stdout

    assert json.loads(status.stdout)["counts"]["llm"]["queued"] == 1
    assert "llm" in status_text.stdout


def test_workspace_names_the_request_by_its_key(clean_db: Engine) -> None:
    """``--workspace`` on show, cancel and requeue: the request is found by (workspace, id);
    another workspace's is "no request", exit 3, and nothing changes."""
    made = onceflow("enqueue", "--stage", "s", "--workspace", "w1", "--job", "j",
                    "--worker-class", "llm")  # fmt: skip
    assert made.returncode == 0, made.stderr
    rid = json.loads(made.stdout)["request_id"]
    shown = onceflow("show", rid, "--workspace", "w1", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["workspace_id"] == "w1"
    before = table_snapshot(clean_db)
    for command in ("show", "cancel", "requeue"):
        other = onceflow(command, rid, "--workspace", "w2")
        assert (other.returncode, other.stdout) == (3, ""), (command, other.stderr)
        assert f"no request {rid}" in other.stderr and "Traceback" not in other.stderr
        bad = onceflow(command, rid, "--workspace", "")
        assert bad.returncode == 1 and "workspace_id" in bad.stderr, (command, bad.stderr)
    assert table_snapshot(clean_db) == before
    cancelled = onceflow("cancel", rid, "--workspace", "w1")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    requeued = onceflow("requeue", rid, "--workspace", "w1")
    assert requeued.returncode == 0, requeued.stderr
    assert json.loads(requeued.stdout)["status"] == "queued"
    # Without --workspace, the id alone still finds it.
    assert json.loads(onceflow("show", rid, "--json").stdout)["status"] == "queued"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["show", "nope"], 3, "no request nope"),
        (["enqueue", "--stage", "s", "--workspace", "", "--job", "j"], 1, "workspace_id"),
        (["enqueue", "--stage", "s", "--workspace", "w", "--job", "j", "--input", "{bad"], 2,
         "not JSON"),
        (["enqueue", "--stage", "s", "--workspace", "w", "--job", "j", "--input", "NaN",
          "--worker-class", "x"], 1, "not JSON"),
        (["list", "--status", "finished"], 1, "unknown status"),
    ],
)  # fmt: skip
def test_errors_go_to_stderr_with_nonzero_exit(
    clean_db: Engine, args: list[str], code: int, message: str
) -> None:
    before = table_snapshot(clean_db)
    result = onceflow(*args)
    assert result.returncode == code
    assert message in result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert table_snapshot(clean_db) == before


def test_unreachable_database_is_a_clear_error() -> None:
    result = onceflow("status", env={"ONCEFLOW_DATABASE_URL": "postgresql://127.0.0.1:1/x"})
    assert result.returncode == 1
    assert "DatabaseUnavailable" in result.stderr
    assert "Traceback" not in result.stderr


def test_migrate_is_idempotent(database_url: str) -> None:
    for _ in range(2):
        result = onceflow("migrate")
        assert result.returncode == 0, result.stderr


def test_enqueue_through_the_configured_flow_validates_and_wakes(
    clean_db: Engine, redis_url: str
) -> None:
    import redis

    from tests.acceptance.procs import ROOT

    client = redis.Redis.from_url(redis_url)
    client.delete(queue_name("t-default"))
    env = {"ONCEFLOW_APP": "tests.acceptance.stages:flow", "PYTHONPATH": str(ROOT)}
    bad = onceflow("enqueue", "--stage", "noop", "--workspace", "w", "--job", "j",
                   "--input", '{"value": "NaN-ish"}', env=env)  # fmt: skip
    assert bad.returncode == 1 and "invalid" in bad.stderr
    assert table_snapshot(clean_db) == []
    good = onceflow("enqueue", "--stage", "noop", "--workspace", "w", "--job", "j",
                    "--input", '{"value": 3}', env=env)  # fmt: skip
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["created"] is True
    assert client.llen(queue_name("t-default")) == 1  # the wake-up went to the stage's worker class
    client.delete(queue_name("t-default"))
