"""The embedded PostgreSQL: initdb, its socket directory, its probe, and its child process."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from onceflow.embedded.base import (
    _HOST,
    PG_SYSTEM_USER,
    EmbeddedServicesError,
)
from onceflow.embedded.children import (
    _Child,
    _Probe,
    _read_log_tail,
)
from onceflow.embedded.system_user import (
    _chown_tree,
    _ensure_system_user,
    _ensure_traversable,
    _prepare_install_for_other_user,
)

_log = logging.getLogger("onceflow.embedded")


# --------------------------------------------------------------------------- PostgreSQL


def _initdb(
    bin_dir: Path,
    pg_dir: Path,
    log_path: Path,
    *,
    cwd: Path,
    run_as: tuple[int, int] | None,
    deadline: float,
) -> None:
    was_empty = not pg_dir.exists() or not any(pg_dir.iterdir())
    pg_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if run_as is not None:
        os.chown(pg_dir, *run_as)
    uid, gid = run_as if run_as is not None else (None, None)
    argv = [
        str(bin_dir / "initdb"),
        "-D",
        str(pg_dir),
        "--auth=trust",
        "-U",
        "postgres",
        "--encoding=UTF8",
        # The C locale exists everywhere; inheriting LANG makes initdb fail on machines whose
        # locale is not installed, and sorting rules of a dev server do not matter.
        "--locale=C",
    ]
    started = time.monotonic()
    with log_path.open("ab") as log:
        offset = log_path.stat().st_size
        try:
            # Keyword arguments alike only by shape to the queue's SQL column lists.
            subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
                user=uid,
                group=gid,
                extra_groups=[] if run_as is not None else None,
                timeout=max(1.0, deadline - time.monotonic()),
                check=True,
            )
        except BaseException as exc:
            # A half-written cluster would make every later start fail with "directory exists but
            # is not empty"; it holds no data yet, so discard it (only if it held nothing before).
            if was_empty:
                shutil.rmtree(pg_dir, ignore_errors=True)
            if isinstance(exc, subprocess.CalledProcessError | subprocess.TimeoutExpired):
                raise EmbeddedServicesError(
                    f"initdb failed for {pg_dir} ({exc}); last lines of {log_path}:\n"
                    f"{_read_log_tail(log_path, offset)}"
                ) from exc
            raise
    _log.info("initdb %s took %.2fs", pg_dir, time.monotonic() - started)


def _socket_dir(data_dir: Path) -> tuple[Path, bool]:
    """Directory for PostgreSQL's unix socket, and whether it is a temporary one to remove.

    A unix socket path must fit in ~104 bytes (sun_path); a deep data directory gets a short
    private directory under the system temp dir instead.
    """
    candidate = data_dir / "pg-socket"
    if len(os.fsencode(candidate / ".s.PGSQL.65535.lock")) < 100:
        candidate.mkdir(mode=0o700, exist_ok=True)
        return candidate, False
    return Path(tempfile.mkdtemp(prefix="onceflow-pg-")), True


def _postgres_probe(pg_dir: Path) -> _Probe:
    def probe(child: _Child, timeout: float) -> str | None:
        import psycopg

        try:
            with psycopg.connect(
                host=_HOST,
                port=child.port,
                user="postgres",
                dbname="postgres",
                connect_timeout=max(1, math.ceil(timeout)),
            ) as conn:
                row = conn.execute("SELECT current_setting('data_directory')").fetchone()
        except psycopg.Error as exc:
            return str(exc).strip() or type(exc).__name__
        # The port could have been taken by someone else's server between picking and binding it;
        # only our own cluster counts as answering.
        if row is None or Path(str(row[0])) != pg_dir:
            return f"port {child.port} is answered by another PostgreSQL ({row!r})"
        return None

    return probe


def _prepare_postgres(
    bin_dir: Path, data_dir: Path, deadline: float, cleanup_dirs: list[Path]
) -> tuple[_Child, Path]:
    run_as: tuple[int, int] | None = None
    if os.geteuid() == 0:
        # PostgreSQL refuses to run as root ("root execution of the PostgreSQL server is not
        # permitted"), so it runs as an unprivileged system user that must reach its files.
        run_as = _ensure_system_user(PG_SYSTEM_USER)
        _prepare_install_for_other_user(bin_dir)
        _ensure_traversable(data_dir)
    pg_dir = data_dir / "pg"
    log_path = data_dir / "postgres.log"
    if (pg_dir / "PG_VERSION").exists():
        if run_as is not None:
            _chown_tree(pg_dir, *run_as)
    else:
        _initdb(bin_dir, pg_dir, log_path, cwd=data_dir, run_as=run_as, deadline=deadline)
    socket_dir, temporary = _socket_dir(data_dir)
    if temporary:
        cleanup_dirs.append(socket_dir)
    if run_as is not None:
        os.chown(socket_dir, *run_as)

    def argv(port: int) -> list[str]:
        return [
            str(bin_dir / "postgres"),
            "-D",
            str(pg_dir),
            "-p",
            str(port),
            "-h",
            _HOST,
            "-k",
            str(socket_dir),
            # Dev/test server: trading crash safety for speed is the point. Never use these
            # settings for data you want to keep across a power cut or an OS crash.
            # synchronous_commit keeps the server's default (on), as in production: claims
            # and heartbeats turn it off for their own transactions and completions rely on
            # the default, so a server-wide "off" would hide that difference.
            "-c",
            "fsync=off",
            "-c",
            "full_page_writes=off",
            # As docker/compose.yaml: autovacuum every 10 s, so a claim_next loop's claim
            # index does not gather a minute of claimed rows' entries (docs/how-to/operate.md).
            "-c",
            "autovacuum_naptime=10s",
        ]

    child = _Child(
        "PostgreSQL",
        argv,
        log_path=log_path,
        cwd=data_dir,
        # SIGINT is PostgreSQL's "fast" shutdown: abort sessions, checkpoint, exit.
        stop_signal=signal.SIGINT,
        run_as=run_as,
    )
    return child, pg_dir
