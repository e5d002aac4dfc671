"""Flower never starts with its UI open on credentials that parse to nothing.

``ONCEFLOW_FLOWER_BASIC_AUTH`` is parsed by one function for the CLI's check and
for flower.cfg: a value with an empty or malformed entry is refused by
``onceflow flower`` (one line, rc != 0, the value not repeated) and by flower.cfg
itself when Flower is started without the CLI; nothing listens. A good value
still makes Flower require auth.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.acceptance.procs import APP, ROOT, free_port, wait_for
from tests.acceptance.test_flower import get

pytestmark = pytest.mark.slow
CELERY_APP = "tests.acceptance.stages:app"

# The secret parts are distinctive, to check that no message repeats them.
REFUSED = [",", " , ", ":", "zorro-user:", ":sekrit-pw", "ops:good-horse,", "ops:good-horse,:"]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start(argv: list[str], value: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    env.update(ONCEFLOW_FLOWER_BASIC_AUTH=value, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def outcome(argv: list[str], value: str, port: int, log: Path) -> tuple[int | None, str, bool]:
    """(exit code or None if still running, output, whether anything listened on ``port``)."""
    proc = start(argv, value, log)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and not listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        heard = listening(port)
        code = proc.poll()
    finally:
        stop(proc)
    return code, log.read_text(errors="replace"), heard


def secret_parts(value: str) -> list[str]:
    return [p for entry in value.split(",") for p in entry.split(":") if len(p.strip()) > 3]


def cli_outcome(value: str, log: Path) -> tuple[int | None, str, bool]:
    """:func:`outcome` of ``onceflow flower`` on a port of its own, with ``value``."""
    port = free_port()
    argv = ["-m", "onceflow.cli", "flower", "--app", APP, "--port", str(port)]
    return outcome(argv, value, port, log)


@pytest.fixture(scope="module")
def cli_outcomes(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[int | None, str, bool]]:
    """The outcome of every refused value, the CLIs run side by side (each its own process,
    log and port: none can see another), so the waits for them overlap."""
    logs = tmp_path_factory.mktemp("flower-refusals")
    with ThreadPoolExecutor(len(REFUSED)) as pool:
        results = pool.map(lambda iv: cli_outcome(iv[1], logs / f"{iv[0]}.log"), enumerate(REFUSED))
        return dict(zip(REFUSED, results, strict=True))


@pytest.mark.parametrize("value", REFUSED)
def test_cli_refuses_credentials_that_parse_to_nothing_or_are_malformed(
    value: str, cli_outcomes: dict[str, tuple[int | None, str, bool]]
) -> None:
    code, output, heard = cli_outcomes[value]
    assert not heard, f"Flower listened with ONCEFLOW_FLOWER_BASIC_AUTH={value!r}"
    assert code not in (None, 0), output
    [line] = output.strip().splitlines()
    assert line.startswith("onceflow: refusing to start Flower: ONCEFLOW_FLOWER_BASIC_AUTH")
    assert all(part not in output for part in secret_parts(value))


def test_flower_cfg_refuses_them_too_without_the_cli(tmp_path: Path) -> None:
    port = free_port()
    argv = ["-m", "celery", "-A", CELERY_APP, "flower", "--conf=flower.cfg", f"--port={port}"]
    code, output, heard = outcome(argv, ",", port, tmp_path / "flower.log")
    assert not heard and code not in (None, 0), output
    assert "refusing to start Flower" in output


def test_the_parser_keeps_good_entries_and_names_the_bad_one_only() -> None:
    from onceflow.flower_auth import InvalidBasicAuth, parse_basic_auth

    assert parse_basic_auth("ops:pw") == ["ops:pw"]
    assert parse_basic_auth(" ops:a:b , admin:x ") == ["ops:a:b", "admin:x"]
    with pytest.raises(InvalidBasicAuth, match="entry 2 of 2") as caught:
        parse_basic_auth("ops:pw,admin:")
    assert "admin" not in str(caught.value) and "pw" not in str(caught.value)


def test_good_credentials_still_require_auth(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    argv = ["-m", "onceflow.cli", "flower", "--app", APP, "--port", str(port)]
    proc = start(argv, "ops:correct-horse,admin:with:colon", tmp_path / "flower.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(base + "/api/workers")[0] != 0, timeout=60, what="Flower answers")
        assert get(base + "/")[0] == 401
        assert get(base + "/api/workers")[0] == 401
        assert get(base + "/api/workers", "ops:wrong")[0] == 401
        assert get(base + "/api/workers", "ops:correct-horse")[0] == 200
        assert get(base + "/api/workers", "admin:with:colon")[0] == 200
    finally:
        stop(proc)
