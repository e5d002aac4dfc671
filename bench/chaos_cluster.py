"""The private servers of a chaos run, and the handles that break them.

* :class:`Cluster` starts the embedded PostgreSQL 18 and Valkey 8 (``onceflow.embedded``) on free
  loopback ports, and the fault proxy (``bench/faultproxy.py``) in front of PostgreSQL. Workers
  and clients use the proxy; the harness's own checks connect directly.
* ``restart_postgres`` is a crash restart (SIGQUIT: PostgreSQL's immediate shutdown, then the
  same command line again, from ``postmaster.opts``); ``restart_redis`` is ``kill -9`` of Valkey
  (which keeps nothing on disk, so the broker queues and the locks are lost) and a new start on
  the same port.
* ``fresh_database`` creates and migrates a database per scenario and installs the audit
  triggers the checks read (``chaos_claims``, ``chaos_completions``, ``chaos_op_audit``): they
  record, in the same transaction as the event, every claim, every completion and every fenced
  op write, with the state of the claim that was current when it committed.

Everything started here is stopped by :meth:`Cluster.close` (also on Ctrl-C), by process group.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import psycopg
import redis as redis_lib
from sqlalchemy import make_url

from bench.faultproxy import ProxyControl
from bench.harness import ROOT, database_url, libpq, redis_answers
from onceflow.demo.procs import Proc, wait_for
from onceflow.embedded import PG_SYSTEM_USER, embedded_services

AUDIT_SQL = """
CREATE TABLE chaos_claims (
    id bigserial PRIMARY KEY, request_id text NOT NULL, tok text NOT NULL, attempt int,
    at timestamptz NOT NULL, lease timestamptz);
CREATE TABLE chaos_completions (
    id bigserial PRIMARY KEY, request_id text NOT NULL, tok text, old_status text,
    old_lease timestamptz, txn_now timestamptz, at timestamptz, live boolean);
CREATE TABLE chaos_op_audit (
    id bigserial PRIMARY KEY, workspace_id text, sub_doc text, op_id text, clock bigint,
    fence text, seen_tok text, seen_status text, seen_lease timestamptz, txn_now timestamptz,
    live boolean);
CREATE FUNCTION chaos_tok(t text) RETURNS text LANGUAGE sql IMMUTABLE AS
$$ SELECT CASE WHEN t IS NULL THEN NULL
          ELSE left(encode(sha256(convert_to(t, 'UTF8')), 'hex'), 16) END $$;
CREATE FUNCTION chaos_wpr_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.claim_token IS NOT NULL AND NEW.claim_token IS DISTINCT FROM OLD.claim_token THEN
        INSERT INTO chaos_claims (request_id, tok, attempt, at, lease)
        VALUES (NEW.request_id, chaos_tok(NEW.claim_token), NEW.attempts, clock_timestamp(),
                NEW.lease_expires_at);
    END IF;
    IF NEW.status = 'succeeded' AND OLD.status IS DISTINCT FROM 'succeeded' THEN
        INSERT INTO chaos_completions
            (request_id, tok, old_status, old_lease, txn_now, at, live)
        VALUES (NEW.request_id, chaos_tok(OLD.claim_token), OLD.status, OLD.lease_expires_at,
                now(), clock_timestamp(),
                OLD.status = 'running' AND OLD.lease_expires_at > now());
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_wpr_audit AFTER UPDATE ON workspace_process_requests FOR EACH ROW
    WHEN (NEW.claim_token IS DISTINCT FROM OLD.claim_token
          OR NEW.status IS DISTINCT FROM OLD.status)
    EXECUTE FUNCTION chaos_wpr_audit();
CREATE FUNCTION chaos_op_audit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE r record;
BEGIN
    SELECT claim_token, status, lease_expires_at INTO r
    FROM workspace_process_requests WHERE request_id = NEW.fence;
    INSERT INTO chaos_op_audit (workspace_id, sub_doc, op_id, clock, fence, seen_tok,
                                seen_status, seen_lease, txn_now, live)
    VALUES (NEW.workspace_id, NEW.sub_doc, NEW.op_id, NEW.clock, NEW.fence,
            chaos_tok(r.claim_token), r.status, r.lease_expires_at, now(),
            coalesce(r.status = 'running' AND r.lease_expires_at > now(), false));
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_op_audit AFTER INSERT ON workspace_sub_doc_ops FOR EACH ROW
    WHEN (NEW.fence IS NOT NULL) EXECUTE FUNCTION chaos_op_audit();
"""


class Cluster:
    """Private PostgreSQL + Valkey + fault proxy, and every process started against them."""

    def __init__(self, work: Path | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self.work = work or Path(self._stack.enter_context(tempfile.TemporaryDirectory(
            prefix="onceflow-chaos-")))  # fmt: skip
        self.work.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []
        self._own_servers: list[subprocess.Popen[bytes]] = []
        try:
            emb = self._stack.enter_context(embedded_services(self.work / "servers"))
            self._stack.callback(self._stop_own_servers)  # runs before embedded's stop
            self.admin_url = emb.database_url  # direct, for the harness
            self.redis_url = emb.redis_url
            self.pg_port = make_url(self.admin_url).port or 5432
            self.data_dir = emb.data_dir
            self.proxy = ProxyControl(self.pg_port, self.work / "faultproxy.log")
            self._stack.callback(self.proxy.stop)
        except BaseException:
            self._stack.close()
            raise

    # ------------------------------------------------------------------ URLs and databases

    def proxied_url(self, database: str) -> str:
        """The URL workers and clients use: through the fault proxy."""
        return (
            make_url(self.admin_url)
            .set(port=self.proxy.port, database=database)
            .render_as_string(hide_password=False)
        )

    def direct_url(self, database: str) -> str:
        """The harness's own URL to ``database`` (never faulted by the proxy)."""
        return database_url(self.admin_url, database)

    def fresh_database(self, name: str) -> None:
        """Create ``name`` (dropping a leftover), migrate it, install the audit triggers."""
        from onceflow.migrate import migrate

        with psycopg.connect(libpq(self.admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
            # The embedded server runs with synchronous_commit=off (a dev server): a crash would
            # lose commits already acknowledged, which is the server's choice, not a finding.
            conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = on')
        migrate(self.direct_url(name))
        with psycopg.connect(libpq(self.direct_url(name)), autocommit=True) as conn:
            conn.execute(AUDIT_SQL)

    def drop_database(self, name: str) -> None:
        """Drop a scenario's database (best effort)."""
        url = libpq(self.admin_url)
        with contextlib.suppress(psycopg.Error), psycopg.connect(url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def flush_redis(self) -> None:
        """Empty Valkey: no wake-up, lock or counter of an earlier scenario survives."""
        client = redis_lib.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            client.flushall()
        finally:
            client.close()

    # ------------------------------------------------------------------ processes

    def start(self, args: list[str], log: Path, env: dict[str, str]) -> Proc:
        """A onceflow CLI process (own process group), remembered for :meth:`stop_procs`."""
        proc = Proc(args, log, env=env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop_procs(self) -> None:
        """Stop every CLI process started so far (SIGTERM, then SIGKILL of its group), all at
        once: each is a warm shutdown of its own, and one after another they took seconds."""
        procs, self.procs = self.procs, []

        def stop(proc: Proc) -> None:
            with contextlib.suppress(Exception):
                proc.stop()

        with ThreadPoolExecutor(max(1, len(procs))) as pool:
            list(pool.map(stop, procs))

    # ------------------------------------------------------------------ server faults

    def _pg_pid(self) -> int:
        text = (self.data_dir / "pg" / "postmaster.pid").read_text()
        return int(text.splitlines()[0])

    def restart_postgres(self) -> float:
        """Crash-restart PostgreSQL (immediate shutdown, same port); returns seconds down."""
        opts = (self.data_dir / "pg" / "postmaster.opts").read_text().strip()
        argv = shlex.split(opts)
        pid = self._pg_pid()
        down = time.monotonic()
        os.kill(pid, signal.SIGQUIT)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=30)
        user = pwd.getpwnam(PG_SYSTEM_USER) if os.geteuid() == 0 else None
        log = open(self.data_dir / "postgres.log", "ab")  # noqa: SIM115 - handed to the child
        self._own_servers.append(
            subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
                user=user.pw_uid if user else None,
                group=user.pw_gid if user else None,
                extra_groups=[] if user else None,
            )
        )
        log.close()
        wait_for(self.postgres_answers, timeout=60, interval=0.05, what="PostgreSQL back")
        return time.monotonic() - down

    def postgres_answers(self) -> bool:
        """Whether PostgreSQL answers a query on its own port."""
        try:
            with psycopg.connect(libpq(self.admin_url), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def restart_redis(self, down_seconds: float = 1.0) -> float:
        """``kill -9`` Valkey (its queues and locks are gone), start it again on the same port."""
        client = redis_lib.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        # Valkey rewrites its process title, so the command line is rebuilt as embedded starts it.
        port = str(make_url(self.redis_url).port)
        argv = [psutil.Process(pid).exe(), "--port", port, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.data_dir / "valkey")]  # fmt: skip
        down = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(timeout=30)
        time.sleep(down_seconds)  # the outage itself: nothing to wait for
        log = open(self.data_dir / "valkey.log", "ab")  # noqa: SIM115 - handed to the child
        self._own_servers.append(
            subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.data_dir, start_new_session=True,
            )
        )  # fmt: skip
        log.close()
        wait_for(self.redis_answers, timeout=30, interval=0.05, what="Valkey back")
        return time.monotonic() - down

    def redis_answers(self) -> bool:
        """Whether Valkey answers PING."""
        return redis_answers(self.redis_url)

    def _stop_own_servers(self) -> None:
        for popen in self._own_servers:
            if popen.poll() is None:
                popen.send_signal(signal.SIGINT)  # fast shutdown for PostgreSQL; Valkey exits
        for popen in self._own_servers:
            try:
                popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(timeout=15)

    def close(self) -> None:
        """Stop everything: CLI processes, the proxy, the servers (in that order)."""
        try:
            self.stop_procs()
        finally:
            self._stack.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
