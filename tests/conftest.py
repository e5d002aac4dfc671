"""Test fixtures on real services: one database per run, migrated, dropped at the end.

The servers come from ``ONCEFLOW_TEST_DATABASE_URL`` / ``ONCEFLOW_TEST_REDIS_URL``
(else the usual ``ONCEFLOW_DATABASE_URL`` / ``ONCEFLOW_REDIS_URL``, else the
defaults on 127.0.0.1). When they do not answer, the embedded servers of the
``embedded`` extra are started instead, saying so in one line. A service that
can be neither reached nor started fails the run; nothing is skipped.

The RabbitMQ tests' broker (``rabbitmq_url``) comes from ``ONCEFLOW_TEST_AMQP_URL``, else
guest on 127.0.0.1:5672. There is no embedded RabbitMQ: where none answers, the tests that
ask for one are skipped, and the run's summary line names the missing server; under
``CI=true`` they fail instead (CI has one, so a skip there would hide a regression).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import ArgumentError

# Scrub the environment at import: the suite must not depend on a developer's settings.
_SERVER_DB = os.environ.get("ONCEFLOW_TEST_DATABASE_URL") or os.environ.get("ONCEFLOW_DATABASE_URL")
_SERVER_REDIS = os.environ.get("ONCEFLOW_TEST_REDIS_URL") or os.environ.get("ONCEFLOW_REDIS_URL")
_SERVER_AMQP = os.environ.get("ONCEFLOW_TEST_AMQP_URL")
#: Where tests save artefacts (screenshots): $ONCEFLOW_TEST_ARTIFACTS, read before the scrub.
TEST_ARTIFACTS = os.environ.get("ONCEFLOW_TEST_ARTIFACTS")
#: $ONCEFLOW_TEST_PARTITIONS=N: the run's database is migrated with its workspace tables
#: hash-partitioned by workspace in N partitions (ONCEFLOW_PARTITIONS); unset: plain tables.
TEST_PARTITIONS = int(os.environ.get("ONCEFLOW_TEST_PARTITIONS") or 0) or None
for _name in [n for n in os.environ if n.startswith("ONCEFLOW_")]:
    del os.environ[_name]

DEFAULT_DB = "postgresql+psycopg://127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
ROOT = Path(__file__).resolve().parent.parent


def project_copy(dest: Path) -> Path:
    """What a build of the package reads (pyproject.toml, README, LICENSE, the package),
    copied to ``dest``: a build's scratch files (egg-info, build/) never land in the tree."""
    import shutil

    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(
        ROOT / "onceflow", dest / "onceflow", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


def libpq(url: str) -> str:
    """A SQLAlchemy URL as a libpq connection string."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def services() -> Iterator[tuple[str, str]]:
    """(admin database URL, redis URL) of servers that answer; embedded ones if need be."""
    from onceflow.embedded import embedded_services, service_answers

    db_url = _SERVER_DB or DEFAULT_DB
    redis_url = _SERVER_REDIS or DEFAULT_REDIS
    db_ok, redis_ok = service_answers(db_url, redis_url)
    db_origin = "configured" if _SERVER_DB else "default URL"
    redis_origin = "configured" if _SERVER_REDIS else "default URL"
    if db_ok and redis_ok:
        _USED_SERVICES[:] = [("Postgres", db_url, db_origin), ("Redis", redis_url, redis_origin)]
        yield db_url, redis_url
        return
    missing = [n for n, ok in (("Postgres", db_ok), ("Redis", redis_ok)) if not ok]
    print(
        f"\nonceflow tests: {' and '.join(missing)} not answering at the configured URLs; "
        "starting the embedded servers",
        file=sys.stderr,
    )
    with embedded_services(postgres=not db_ok, redis=not redis_ok) as emb:
        used = (db_url if db_ok else emb.database_url), (redis_url if redis_ok else emb.redis_url)
        embedded = "embedded, started by the suite"
        _USED_SERVICES[:] = [
            ("Postgres", used[0], db_origin if db_ok else embedded),
            ("Redis", used[1], redis_origin if redis_ok else embedded),
        ]
        yield used


# (service, URL, where it came from) of the servers this run used, for the terminal summary.
_USED_SERVICES: list[tuple[str, str, str]] = []


def service_summary(used: list[tuple[str, str, str]]) -> str:
    """The summary line naming the servers a run used: URLs without driver or password.

    ``used`` holds ``(service, URL, origin)`` triples; empty when no test needed a server.
    """
    if not used:
        return "onceflow services: none used (no test in this run needed Postgres or Redis)"
    parts = []
    for service, url, origin in used:
        try:
            u = make_url(url)
        except ArgumentError:  # a URL SQLAlchemy cannot parse: name its scheme only
            parts.append(f"{service} {url.split(':', 1)[0]}://… ({origin})")
            continue
        scheme = u.drivername.split("+")[0]
        user = f"{u.username}@" if u.username else ""
        port = f":{u.port}" if u.port else ""
        # Redis keeps its database number (/N); a Postgres database name is the admin one.
        path = f"/{u.database}" if scheme.startswith("redis") and u.database else ""
        parts.append(f"{service} {scheme}://{user}{u.host or ''}{port}{path} ({origin})")
    return "onceflow services: " + ", ".join(parts)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which servers the run used: configured, default or embedded; and which were missing."""
    terminalreporter.write_line(service_summary(_USED_SERVICES))
    for line in _MISSING_SERVICES:
        terminalreporter.write_line(line)


#: One line per server some tests needed and none answered (their tests were skipped).
_MISSING_SERVICES: list[str] = []


def in_ci() -> bool:
    """CI=true: a test that needs something missing fails instead of skipping."""
    return os.environ.get("CI", "").lower() in ("true", "1")


@pytest.fixture(scope="session")
def rabbitmq_url(services: tuple[str, str]) -> Iterator[str]:
    """The AMQP URL of a RabbitMQ that answers, on a vhost of this run's own.

    The vhost is made with ``rabbitmqctl`` (``add_vhost``, ``set_permissions`` for the URL's
    user) and deleted at the end, so runs side by side never share a queue. Where
    ``rabbitmqctl`` cannot (not installed, not allowed, another server), the URL's own vhost
    is used, said in the summary line: the tests then delete the queues they use. (After
    ``services``, which names Postgres and Redis in that line first.)
    """
    from kombu import Connection

    base = _SERVER_AMQP or DEFAULT_AMQP
    origin = "configured" if _SERVER_AMQP else "default URL"
    problem = _amqp_problem(base)
    if problem is not None:
        reason = f"RabbitMQ does not answer at {Connection(base).as_uri()}: {problem}"
        if in_ci():
            pytest.fail(reason)
        _MISSING_SERVICES.append(
            f"onceflow services: no RabbitMQ at {Connection(base).as_uri()} — its tests were "
            "skipped (set ONCEFLOW_TEST_AMQP_URL, or start one; under CI=true they fail)"
        )
        pytest.skip(reason)
    vhost = f"onceflow_test_{os.getpid()}_{secrets.token_hex(3)}"
    url = _with_vhost(base, vhost)
    user = Connection(base).userid or "guest"
    added = _rabbitmqctl("add_vhost", vhost)
    usable = (
        bool(added)
        and bool(_rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*"))
        and _amqp_problem(url) is None  # the vhost is on the server the URL names
    )
    if not usable:
        if added:
            _rabbitmqctl("delete_vhost", vhost)
        _USED_SERVICES.append(("RabbitMQ", base, f"{origin}, its own vhost"))
        yield base
        return
    _USED_SERVICES.append(("RabbitMQ", url, f"{origin}, vhost {vhost} of this run"))
    try:
        yield url
    finally:
        _rabbitmqctl("delete_vhost", vhost)


def _amqp_problem(url: str) -> str | None:
    """Why the AMQP broker at ``url`` cannot be used; None when it answers."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # kombu/amqp errors: the reason is the message
        return f"{type(exc).__name__}: {exc}"
    return None


def _with_vhost(url: str, vhost: str) -> str:
    """``url`` on the virtual host ``vhost`` (an AMQP URL's path)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))


def _rabbitmqctl(*args: str) -> bool | None:
    """Run ``rabbitmqctl args``: True if it succeeded, False if it failed, None if there
    is no ``rabbitmqctl`` to run."""
    import shutil
    import subprocess

    exe = shutil.which("rabbitmqctl")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-q", *args], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="session")
def database_url(services: tuple[str, str]) -> Iterator[str]:
    """A fresh database for this run (unique name), migrated to head, dropped at the end.

    With ``ONCEFLOW_TEST_PARTITIONS=N`` its workspace tables are hash-partitioned in N
    partitions (the name says so: ``onceflow_test_p<N>_…``).
    """
    from onceflow.migrate import migrate

    admin_url, _ = services
    layout = f"p{TEST_PARTITIONS}_" if TEST_PARTITIONS else ""
    name = f"onceflow_test_{layout}{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    os.environ["ONCEFLOW_DATABASE_URL"] = url  # for subprocesses: CLI, workers
    _reset_settings()
    try:
        migrate(url, partitions=TEST_PARTITIONS)
        if TEST_PARTITIONS:
            _check_partitioned(url, TEST_PARTITIONS)
        yield url
    finally:
        from onceflow.db import dispose_engines

        dispose_engines()
        with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _check_partitioned(url: str, partitions: int) -> None:
    """Fail the run unless every workspace table has ``partitions`` partitions."""
    from onceflow.db import make_engine
    from onceflow.migrations.partitioning import WORKSPACE_TABLES, layout

    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            found = layout(conn)
    finally:
        engine.dispose()
    if found != dict.fromkeys(WORKSPACE_TABLES, partitions):
        pytest.fail(f"ONCEFLOW_TEST_PARTITIONS={partitions}, but the test database has {found}")


@pytest.fixture()
def empty_database(services: tuple[str, str]) -> Iterator[str]:
    """An empty database of the test's own (not migrated), dropped at the end."""
    admin = services[0]
    name = f"onceflow_empty_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(libpq(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url(services: tuple[str, str]) -> str:
    """The Redis URL of this run."""
    os.environ["ONCEFLOW_REDIS_URL"] = services[1]
    _reset_settings()
    return services[1]


def _reset_settings() -> None:
    from onceflow.settings import get_settings

    get_settings.cache_clear()


@pytest.fixture(scope="session")
def engine(database_url: str) -> Engine:
    """This process's engine on the test database."""
    from onceflow.db import get_engine

    return get_engine(database_url)


@pytest.fixture()
def clean_db(engine: Engine) -> Engine:
    """The test database with every table emptied before the test."""
    from onceflow.models import metadata

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE " + ", ".join(sorted(metadata.tables))))
    return engine


@pytest.fixture()
def queue(clean_db: Engine) -> object:
    """A :class:`onceflow.Queue` on an empty table."""
    from onceflow.queue import Queue
    from onceflow.settings import get_settings

    return Queue(clean_db, settings=get_settings())


@pytest.fixture(params=["sync", "async"])
def api_queue(request: pytest.FixtureRequest, clean_db: Engine) -> Iterator[object]:
    """The queue on an empty table, once as :class:`onceflow.Queue` and once as
    :class:`onceflow.AsyncQueue` driven through ``tests.both_apis.Blocking``."""
    from onceflow.queue import AsyncQueue, Queue
    from onceflow.settings import get_settings
    from tests.both_apis import both

    url = clean_db.url.render_as_string(hide_password=False)
    yield from both(
        lambda: Queue(clean_db, settings=get_settings()),
        lambda: AsyncQueue(url, get_settings()),
        request.param,
    )


@pytest.fixture(params=["sync", "async"])
def api_oplog(request: pytest.FixtureRequest, clean_db: Engine, redis_url: str) -> Iterator[object]:
    """The op log on empty tables, once as :class:`onceflow.OpLog` and once as
    :class:`onceflow.AsyncOpLog` driven through ``tests.both_apis.Blocking``."""
    from onceflow.oplog import AsyncOpLog, OpLog
    from onceflow.settings import get_settings
    from tests.both_apis import both

    url = clean_db.url.render_as_string(hide_password=False)
    yield from both(
        lambda: OpLog(clean_db, get_settings()),
        lambda: AsyncOpLog(url, get_settings()),
        request.param,
    )


def table_snapshot(engine: Engine) -> list[tuple[object, ...]]:
    """Every row of the queue table, for 'bad input changes nothing' checks."""
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(text("SELECT * FROM workspace_process_requests ORDER BY 1"))
        ]


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Temporarily set environment variables."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def trace_spans() -> Iterator[Any]:
    """An OpenTelemetry SDK installed as this process's global tracer provider for one test,
    exporting to memory (the fixture's value: an ``InMemorySpanExporter``); the global
    provider is unset again afterwards, so other tests run untraced (no SDK)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
