"""``onceflow wait``: real subprocesses on the test database; its exit status says how the
request ended (0 succeeded, 1 dead or cancelled, 124 the timeout, 3 no such request)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import Engine

from onceflow import Queue
from onceflow.settings import get_settings
from tests.integration.test_wait_result import done_listeners, until


def wait_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "onceflow.cli", "wait", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def ended(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=90)
    return proc.returncode, out, err


@pytest.fixture()
def q(clean_db: Engine) -> Queue:
    return Queue(clean_db, settings=get_settings())


def test_exit_0_when_woken_by_the_completion(q: Queue, clean_db: Engine) -> None:
    rid = q.enqueue("s", "w1", "j").request_id
    claim = q.claim(rid, "worker")
    assert claim is not None
    proc = wait_cli(rid, "--workspace", "w1", "--timeout", "60")
    until(lambda: bool(done_listeners(clean_db)) or proc.poll() is not None, "LISTEN", 60)
    assert proc.poll() is None  # it waits
    q.complete(claim, {"n": 1})
    code, out, err = ended(proc)
    assert code == 0, err
    row = json.loads(out)
    assert (row["request_id"], row["status"], row["result"]) == (rid, "succeeded", {"n": 1})
    assert "claim_token" not in row


def test_exit_1_when_dead_or_cancelled(q: Queue) -> None:
    dead = q.enqueue("s", "w1", "j1").request_id
    claim = q.claim(dead, "worker")
    assert claim is not None
    q.fail(claim, "broken", retryable=False)
    cancelled = q.enqueue("s", "w1", "j2").request_id
    q.cancel(cancelled)
    for rid, status in ((dead, "dead"), (cancelled, "cancelled")):
        code, out, err = ended(wait_cli(rid))
        assert code == 1, err
        assert json.loads(out)["status"] == status


def test_exit_124_on_timeout_with_the_request_as_it_is(q: Queue) -> None:
    rid = q.enqueue("s", "w1", "j").request_id
    code, out, err = ended(wait_cli(rid, "--timeout", "0.3"))
    assert code == 124, err
    assert json.loads(out)["status"] == "queued"
    assert "did not finish" in err


def test_no_such_request_and_bad_timeouts(q: Queue) -> None:
    code, out, err = ended(wait_cli("no-such-request"))
    assert (code, out) == (3, "")
    assert "no request no-such-request" in err
    rid = q.enqueue("s", "w1", "j").request_id
    for bad in ("0", "nan", "3601", "soon"):
        code, out, err = ended(wait_cli(rid, "--timeout", bad))
        assert (code, out) == (2, ""), (bad, err)
        assert "--timeout" in err
