"""Postgres for a benchmark: the admin URL, fresh databases dropped ``WITH (FORCE)`` on the
way out whatever happens, the server's settings, and onceflow's embedded PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import make_url

from bench.harness.report import log, machine_info, psycopg_version

#: The admin URL a benchmark creates its database with (``ONCEFLOW_BENCH_DATABASE_URL``).
ADMIN_DEFAULT = "postgresql+psycopg://root@127.0.0.1:5432/postgres"
#: The application name of the harness's own connections to a private server.
HARNESS_APP = "bench-harness"


def admin_url() -> str:
    """``ONCEFLOW_BENCH_DATABASE_URL``, else the local server's ``postgres`` database."""
    return os.environ.get("ONCEFLOW_BENCH_DATABASE_URL", ADMIN_DEFAULT)


def libpq(url: str) -> str:
    """A SQLAlchemy URL as a libpq connection string."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def raw_connect(url: str) -> psycopg.Connection[Any]:
    """A plain psycopg connection in autocommit (the hand-written floors' and the harness's)."""
    return psycopg.connect(libpq(url), autocommit=True)


def database_url(server: str, name: str) -> str:
    """``server``'s URL naming database ``name``."""
    return make_url(server).set(database=name).render_as_string(hide_password=False)


@contextmanager
def fresh_databases(
    admin: str, names: Sequence[str], *, quiet: bool = False
) -> Iterator[list[str]]:
    """Empty databases ``names`` on ``admin``'s server, their URLs; each dropped
    ``WITH (FORCE)`` on the way out, whatever happens (also one created before a failure)."""
    created: list[str] = []
    try:
        with raw_connect(admin) as conn:
            for name in names:
                conn.execute(f'CREATE DATABASE "{name}"')
                created.append(name)
                if not quiet:
                    log(f"created database {name}")
        yield [database_url(admin, name) for name in names]
    finally:
        with raw_connect(admin) as conn:
            for name in created:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                if not quiet:
                    log(f"dropped database {name}")


@contextmanager
def bench_database(
    admin: str, *, prefix: str = "onceflow_bench", quiet: bool = False
) -> Iterator[str]:
    """A fresh database migrated by ``onceflow.migrate.migrate``; dropped on the way out."""
    from onceflow.migrate import migrate

    with fresh_databases(admin, [f"{prefix}_{secrets.token_hex(4)}"], quiet=quiet) as (url,):
        migrate(url)
        yield url


def postgres_settings(url: str) -> dict[str, str]:
    """The server settings a reader of a database figure wants beside it."""
    names = ("server_version", "fsync", "synchronous_commit", "shared_buffers")
    with raw_connect(url) as conn:
        return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]


class PrivatePostgres:
    """onceflow's embedded PostgreSQL 18 on a free port, in a temporary directory.

    It drives ``onceflow.embedded``'s private helpers (the server binary, the data
    directory, a restart on the same port): what ``onceflow dev-services`` runs, not a
    public API."""

    def __init__(self, prefix: str = "onceflow-cbench-") -> None:
        from onceflow import embedded

        self.embedded = embedded
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.cleanup: list[Path] = [self.root]
        deadline = time.monotonic() + 120
        self.child, pg_dir = embedded._prepare_postgres(
            embedded._postgres_bin_dir(), self.root, deadline, self.cleanup
        )
        self.probe = embedded._postgres_probe(pg_dir)
        self.child.spawn()
        self.child.wait_until_answering(self.probe, deadline)
        self.port = self.child.port
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        with self.connect() as conn:
            self.version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]

    def url(self, database: str) -> str:
        return make_url(self.admin_url).set(database=database).render_as_string(False)

    def dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def connect(self, database: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn(database), autocommit=True, application_name=HARNESS_APP, connect_timeout=5
        )

    def restart(self) -> float:
        """Crash-restart (SIGQUIT: immediate shutdown), same port; seconds until it answers."""
        process = self.child.process
        assert process is not None
        down = time.monotonic()
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Seen once under load: the postmaster outlived its immediate shutdown. Kill its
            # group (postmaster and backends: same session) so the data directory is free.
            log(f"PostgreSQL did not stop on SIGQUIT within 30 s:\n{self.child.log_tail()}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        self.start()
        return time.monotonic() - down

    def stop(self) -> None:
        """A clean stop (fast shutdown: every session ends); :meth:`start` brings it back."""
        assert self.child.process is not None
        self.child.signal_stop()
        self.child.process.wait(timeout=30)

    def start(self) -> None:
        """Start the stopped server again, on the same port; returns once it answers."""
        port = self.port
        children = self.embedded.children  # where _Child looks _free_port up
        original = children._free_port
        children._free_port = lambda: port  # respawn on the same port
        try:
            self.child.spawn()
        finally:
            children._free_port = original
        self.child.wait_until_answering(self.probe, time.monotonic() + 60)

    def close(self) -> None:
        self.embedded._stop_children([self.child])
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)


def database_machine(url: str, **more: Any) -> dict[str, Any]:
    """:func:`machine_info` of a database benchmark: the server at ``url``, its settings and
    the client libraries, then ``more``."""
    import sqlalchemy

    settings = postgres_settings(url)
    return machine_info(
        postgres=settings["server_version"],
        postgres_settings=settings,
        psycopg=psycopg_version(),
        sqlalchemy=sqlalchemy.__version__,
        **more,
    )
