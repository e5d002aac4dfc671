"""What every benchmark in ``bench/`` shares: servers, rounds, ratios and the report.

* Servers: a fresh database on the admin server (:func:`bench_database`, created, migrated
  and dropped ``WITH (FORCE)`` on the way out, whatever happens), a private Redis
  (:func:`private_redis`), onceflow's embedded PostgreSQL (:class:`PrivatePostgres`), and a
  worker subprocess in a process group of its own (:class:`Proc`: a Celery worker, an
  ``onceflow`` command).
* Rounds: a candidate and its baseline measured in the same run, in turns
  (:func:`rotated`, :func:`interleaved`), so that a burst of outside load on a shared
  machine hits both sides alike; the figure is the median of the per-round ratios
  (:func:`per_round_ratios`), not the ratio of pooled rates.
* The report: the machine and date header (:func:`machine_info`), Markdown tables
  (:func:`table`), and the raw numbers as JSON instead (:func:`emit`).

Progress goes to stderr (:func:`log`), the report to stdout. A script imports this module
as ``bench.harness``, after putting the repository's root first on ``sys.path`` (so that a
run from another worktree measures that tree's onceflow, not the editable install's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import make_url

ROOT = Path(__file__).resolve().parent.parent
#: The admin URL a benchmark creates its database with (``ONCEFLOW_BENCH_DATABASE_URL``).
ADMIN_DEFAULT = "postgresql+psycopg://root@127.0.0.1:5432/postgres"
#: The application name of the harness's own connections to a private server.
HARNESS_APP = "bench-harness"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def admin_url() -> str:
    """``ONCEFLOW_BENCH_DATABASE_URL``, else the local server's ``postgres`` database."""
    return os.environ.get("ONCEFLOW_BENCH_DATABASE_URL", ADMIN_DEFAULT)


def bench_redis_url(default: str) -> str:
    """``ONCEFLOW_BENCH_REDIS_URL``, else ``default`` (each benchmark its own database
    number, so that two never share keys)."""
    return os.environ.get("ONCEFLOW_BENCH_REDIS_URL", default)


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- Postgres


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


# ---------------------------------------------------------------------------- Redis, ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_binary() -> str:
    """``redis-server`` or ``valkey-server`` on PATH, else the embedded extra's Valkey."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        from onceflow.embedded import _valkey_executable

        binary = str(_valkey_executable())
    return binary


def start_redis(binary: str, port: int) -> subprocess.Popen[bytes]:
    """A Redis server on ``port`` that keeps nothing on disk."""
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def redis_answers(url: str) -> bool:
    """Whether the Redis server at ``url`` answers PING (within a second)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def redis_version(url: str) -> str | None:
    """The version of the Redis server at ``url``."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        return client.info("server").get("redis_version")
    finally:
        client.close()


_redis: tuple[int, Any] | None = None


def process_redis() -> Any:
    """This process's Redis client at the settings' URL, made again in a forked child (a
    worker's pool children each get their own)."""
    global _redis
    if _redis is None or _redis[0] != os.getpid():
        import redis

        from onceflow.settings import get_settings

        _redis = (os.getpid(), redis.Redis.from_url(get_settings().redis_url))
    return _redis[1]


@contextmanager
def private_redis() -> Iterator[str]:
    """A Redis of this run's own on a free port (nothing on disk): its URL, once it answers."""
    port = free_port()
    proc = start_redis(redis_binary(), port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        if not wait_until(lambda: redis_answers(url), timeout=30, interval=0.05):
            raise RuntimeError(f"the private Redis on port {port} did not answer in 30 s")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------------- processes


class Proc:
    """A worker subprocess in its own process group, logging to a file; stop() ends it all."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str]):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop(); one run each
        self.launched = time.time()
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            tail = "\n".join(self.log().splitlines()[-20:])
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{tail}")

    def wait_log(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {text!r} in its log after {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        stop_group(self.popen)
        self._log.close()


class ProcessPool:
    """A standing pool of spawned benchmark processes (``multiprocessing`` spawn: the client
    side is Python, and threads would serialise its work on the GIL), each driven by its
    parent over a pipe. ``target(*args_of(i), pipe)`` runs in process ``i``; it sends
    ``"ready"`` once set up, then answers each message, until it receives ``None``."""

    def __init__(self, target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]],
                 n: int) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.pipes: list[Pipe] = []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=target, args=(*args_of(i), child), daemon=True)
                proc.start()
                self.procs.append(proc)
                self.pipes.append(parent)
            for pipe in self.pipes:
                if pipe.recv() != "ready":
                    raise RuntimeError("a benchmark process failed to start")
        except BaseException:
            self.close()
            raise

    def ask(self, n: int, msg: Any) -> list[Any]:
        """``msg`` to the first ``n`` processes at once, then their answers."""
        for pipe in self.pipes[:n]:
            pipe.send(msg)
        return [pipe.recv() for pipe in self.pipes[:n]]

    def together(
        self, n: int, warm: Any, go: Callable[[float], Any]
    ) -> tuple[list[Any], list[Any]]:
        """The warm-up message to ``n`` processes, then ``go(start_at)``: they all start
        at ``start_at`` (``time.perf_counter``, one clock across processes), 0.2 s on.
        The answers to both."""
        warmed = self.ask(n, warm)
        return warmed, self.ask(n, go(time.perf_counter() + 0.2))

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def run_until(
    op: Callable[[], int | None], start_at: float, duration: float
) -> tuple[int, float, bool]:
    """In a pool's process: wait for ``start_at``, then call ``op`` for ``duration`` seconds.
    ``op`` returns the ops it did (``None``: one), ``0`` when there is nothing left to do.
    The ops done, the seconds since ``start_at``, and whether the work ran out."""
    while time.perf_counter() < start_at:
        time.sleep(0.001)
    deadline = start_at + duration
    count, exhausted = 0, False
    while time.perf_counter() < deadline:
        done = op()
        if done is None:
            done = 1
        if not done:
            exhausted = True
            break
        count += done
    return count, time.perf_counter() - start_at, exhausted


def stop_group(popen: subprocess.Popen[Any], grace: float = 20) -> None:
    """SIGTERM to ``popen``'s process group, SIGKILL to whatever of it is left."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            popen.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)  # any pool child left behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=10)


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc``); a process gone counts 0."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def wait_until(cond: Callable[[], Any], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``cond`` until truthy or ``timeout``; returns whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something truthy, and return that; ``TimeoutError``
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stack_samples(
    paths: Iterable[Path], thread: str, buckets: Sequence[tuple[str, str]]
) -> tuple[dict[str, int], dict[str, int], int]:
    """py-spy's raw (folded) stacks in ``paths``, of the threads whose stack holds
    ``thread``: the samples per bucket (the first of ``buckets``' ``(marker, bucket)`` whose
    marker a frame holds, else ``other``), those of them waiting in psycopg, and all."""
    counts: dict[str, int] = {}
    db_wait: dict[str, int] = {}
    total = 0
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if thread not in stack or not count.isdigit():
                continue
            frames = stack.split(";")
            name = next((b for m, b in buckets if any(m in f for f in frames)), "other")
            counts[name] = counts.get(name, 0) + int(count)
            if any("psycopg" in f and "wait" in f for f in frames):
                db_wait[name] = db_wait.get(name, 0) + int(count)
            total += int(count)
    return counts, db_wait, total


# ---------------------------------------------------------------------------- rounds, ratios


def rotated(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order of ``names``: each one first in turn, so none always runs first."""
    k = r % len(names) if names else 0
    return [*names[k:], *names[:k]]


def interleaved(
    contenders: dict[str, Callable[[], None]], calls: int, rounds: int, warmup: int = 200
) -> dict[str, Any]:
    """``rounds`` rounds of ``calls`` calls of each contender, in :func:`rotated` order, after
    ``warmup`` calls each (connections, scripts, caches); per contender its calls, the
    seconds they took and calls per second."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    spent = dict.fromkeys(contenders, 0.0)
    for r in range(rounds):
        for name in rotated(list(contenders), r):
            fn = contenders[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            spent[name] += time.perf_counter() - start
    total = calls * rounds
    return {name: {"pairs": total, "seconds": s, "per_s": total / s} for name, s in spent.items()}


def per_round_ratios(side: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """The ratio of each round's candidate figure to its baseline's of the same round, and
    their median (the figure a report gives: one slow round cannot carry it)."""
    ratios = [s / b for s, b in zip(side, base, strict=True)]
    return {"ratios": ratios, "median": statistics.median(ratios)}


def median_or_none(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def latency_ms(xs: Sequence[float]) -> dict[str, float]:
    """Seconds as a latency summary in milliseconds: p50, p99, mean, max."""
    return {
        "p50_ms": pct(xs, 50) * 1e3,
        "p99_ms": pct(xs, 99) * 1e3,
        "mean_ms": statistics.fmean(xs) * 1e3,
        "max_ms": max(xs) * 1e3,
    }


# ---------------------------------------------------------------------------- the report


def loadavg(sep: str = " ") -> str:
    """The 1, 5 and 15 minute load averages, or ``n/a``."""
    try:
        with open("/proc/loadavg") as f:
            return sep.join(f.read().split()[:3])
    except OSError:
        return "n/a"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine_info(**more: Any) -> dict[str, Any]:
    """The report's header: the date, the machine, Python, then ``more`` (servers' and
    libraries' versions) in the order given."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu_model(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        **more,
    }


def psycopg_version() -> str:
    return f"{psycopg.__version__} ({psycopg.pq.__impl__})"


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


def ok(met: bool) -> str:
    """A target's verdict in a table cell."""
    return "met" if met else "**missed**"


def row(cells: Iterable[Any]) -> str:
    """One Markdown table row (an empty cell as ``| |``)."""
    return "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """A Markdown table's lines: ``align`` has one letter a column (``l`` or ``r``; every
    column right-aligned but the first when empty)."""
    align = align or "l" + "r" * (len(header) - 1)
    return [
        row(header),
        row("---:" if a == "r" else "---" for a in align),
        *(row(r) for r in rows),
    ]


def command_line(
    doc: str | None, json_help: str = "print the raw numbers as JSON", *, full: bool = False
) -> argparse.ArgumentParser:
    """A benchmark's command line, with ``--json`` (the raw numbers on stdout instead of the
    Markdown report): described by its docstring's first paragraph, or all of it
    (``full``, as written)."""
    if full:
        p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    else:
        p = argparse.ArgumentParser(description=(doc or "").split("\n\n", 1)[0])
    p.add_argument("--json", action="store_true", help=json_help)
    return p


def command_header(res: dict[str, Any]) -> str:
    """A report's first line: the command that made it, its date and its wall time."""
    return (
        f"Command: `.venv/bin/python {res['command']}` · {res['machine']['date']} · wall time "
        f"{res['wall_seconds']:.0f} s"
    )


def header(info: dict[str, Any], *more: str) -> str:
    """A report's first line: the date, the CPUs, the PostgreSQL server, then ``more``."""
    return " · ".join(
        [info["date"], f"nproc {info['nproc']}", f"PostgreSQL {info['postgres']}", *more]
    )


def finish(
    results: dict[str, Any], started: float, as_json: bool, render: Callable[[Any], str]
) -> int:
    """The end of a run: the load average and the wall time into ``results``, then the
    report (:func:`emit`); the exit status."""
    results["loadavg_end"] = loadavg()
    results["wall_seconds"] = time.perf_counter() - started
    log(f"done in {results['wall_seconds']:.0f}s")
    emit(results, as_json, render)
    return 0


def emit(results: Any, as_json: bool, render: Callable[[Any], str]) -> None:
    """The run's report on stdout: the raw numbers as JSON, or ``render``'s Markdown."""
    if as_json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(render(results))
