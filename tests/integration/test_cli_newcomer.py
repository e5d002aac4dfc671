"""A newcomer's first commands: real CLI subprocesses.

The CLI runs as an installed console script would: ``python -P`` (the current
directory is *not* put on ``sys.path`` by Python itself) with ``PYTHONPATH``
naming only the onceflow under test, from a temporary project directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text

import onceflow
from onceflow.demo.procs import wait_for
from onceflow.ids import request_id_for
from tests.conftest import libpq, table_snapshot

#: The directory holding the onceflow package under test (not the project's directory).
ONCEFLOW_HOME = str(Path(onceflow.__file__).resolve().parents[1])
EXPECTED_FORM = "postgresql+psycopg://user@host:5432/db"

STAGES = """
from pydantic import BaseModel

from onceflow.tasks import Flow, StageContext

flow = Flow(name="{name}")


class GreetInput(BaseModel):
    name: str
    times: int = 1


@flow.stage("greet", input=GreetInput, worker_class="{worker_class}")
def greet(ctx: StageContext, data: GreetInput) -> dict:
    from myproject.helpers import greeting  # imported in the worker's pool process

    return {{"text": greeting(data.name) * data.times}}
"""


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``onceflow *args`` from ``cwd``, which is not on the import path unless onceflow puts it."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "onceflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=_env(env),
    )


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ONCEFLOW_APP")}
    return {**base, "PYTHONPATH": ONCEFLOW_HOME, **(extra or {})}


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a refused command (exit 1, nothing on stdout, no traceback)."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A project directory holding ``myproject/stages.py`` (its own Flow and worker class)."""
    return make_project(tmp_path)


def make_project(tmp_path: Path) -> Path:
    """:func:`project` under ``tmp_path``."""
    root = tmp_path / "proj"
    package = root / "myproject"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    token = secrets.token_hex(3)
    (package / "stages.py").write_text(
        STAGES.format(name=f"newcomer-{token}", worker_class=f"newcomer-{token}")
    )
    (package / "helpers.py").write_text("def greeting(name):\n    return f'hello {name}'\n")
    return root


# --- item 1: --app finds a module of the current directory ---------------------------------


@pytest.mark.parametrize("how", ["option", "env"])
def test_app_module_is_found_in_the_current_directory(
    clean_db: Engine, project: Path, how: str
) -> None:
    spec = "myproject.stages:flow"
    app = ["--app", spec] if how == "option" else []
    env = {"ONCEFLOW_APP": spec} if how == "env" else {}
    enqueued = cli("enqueue", *app, "--stage", "greet", "--workspace", "w", "--job", "j",
                   "--input", '{"name": "ada"}', cwd=project, env=env)  # fmt: skip
    assert enqueued.returncode == 0, enqueued.stderr
    assert json.loads(enqueued.stdout)["created"] is True
    swept = cli("sweep", *app, cwd=project, env=env)
    assert swept.returncode == 0, swept.stderr
    assert "dispatched" in json.loads(swept.stdout)


def test_worker_started_in_the_project_directory_runs_its_stage(
    clean_db: Engine, redis_url: str, project: Path, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-P", "-m", "onceflow.cli", "worker", "--app",
             "myproject.stages:flow", "--concurrency", "1", "-n", f"newcomer-{os.getpid()}@%h"],
            cwd=project, env=_env(None), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:

        def ready() -> bool:
            text = log.read_text(errors="replace")
            assert worker.poll() is None, text
            return " ready." in text

        wait_for(ready, timeout=60, what="the worker to be ready")
        assert ".> task events: ON" in log.read_text(errors="replace")  # Flower sees it
        enqueued = cli("enqueue", "--app", "myproject.stages:flow", "--stage", "greet",
                       "--workspace", "w", "--job", "j", "--input", '{"name": "ada", "times": 2}',
                       cwd=project)  # fmt: skip
        assert enqueued.returncode == 0, enqueued.stderr
        rid = json.loads(enqueued.stdout)["request_id"]

        # Polled in the table (a `show` process per poll cost a CLI start-up each time);
        # the result is then read back through the CLI, as a newcomer would.
        status_sql = text("SELECT status FROM workspace_process_requests WHERE request_id = :r")

        def finished() -> bool:
            with clean_db.connect() as conn:
                status = conn.execute(status_sql, {"r": rid}).scalar()
            assert status != "dead", log.read_text(errors="replace")
            return status == "succeeded"

        wait_for(finished, timeout=60, what="the stage to succeed")
        shown = cli("show", rid, "--json", cwd=project)
        row = json.loads(shown.stdout)
        assert (row["status"], row["result"]) == ("succeeded", {"text": "hello adahello ada"})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=20)


UNIMPORTABLE = [
    ["enqueue", "--stage", "greet", "--workspace", "w", "--job", "j"],
    ["sweep"],
    ["worker"],
    ["beat"],
    ["api"],
    ["mcp"],
]
UNDECLARED_APPS = [None, "myproject.stages:flow"]
INVALID_INPUTS = [('{"times": 2}', "name"), ('{"name": "ada", "times": "often"}', "times"),
                  ("[1]", "")]  # fmt: skip


@dataclass
class Refusals:
    """The refused commands of items 1 and 2, run side by side on an emptied table (none of
    them may write, so none can see another), and what the table held once all had run."""

    elsewhere: Path
    unimportable: dict[str, subprocess.CompletedProcess[str]]
    undeclared: dict[str | None, subprocess.CompletedProcess[str]]
    invalid: dict[tuple[str, str], subprocess.CompletedProcess[str]]
    table_after: list[tuple[object, ...]]


@pytest.fixture(scope="module")
def refusals(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Refusals:
    from onceflow.models import metadata

    project = make_project(tmp_path_factory.mktemp("refusals"))
    elsewhere = project.parent / "not-the-project"
    elsewhere.mkdir()
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE " + ", ".join(sorted(metadata.tables))))
    app = ["--app", "myproject.stages:flow"]
    greet = [*app, "--stage", "greet", "--workspace", "w", "--job", "j"]
    with ThreadPoolExecutor(4) as pool:
        unimportable = {c[0]: pool.submit(cli, *c, *app, cwd=elsewhere) for c in UNIMPORTABLE}
        undeclared = {
            a: pool.submit(cli, "enqueue", *(["--app", a] if a else []), "--stage", "grete",
                           "--workspace", "w", "--job", "j", cwd=project)
            for a in UNDECLARED_APPS
        }  # fmt: skip
        invalid = {
            (payload, how): pool.submit(cli, "enqueue", *greet, "--input", payload, *extra,
                                        cwd=project)
            for payload, _ in INVALID_INPUTS
            for how, extra in (("model", []), ("class", ["--worker-class", "elsewhere"]))
        }  # fmt: skip
        done = Refusals(
            elsewhere,
            {k: f.result() for k, f in unimportable.items()},
            {k: f.result() for k, f in undeclared.items()},
            {k: f.result() for k, f in invalid.items()},
            [],
        )
    done.table_after = table_snapshot(engine)
    return done


@pytest.mark.parametrize("command", UNIMPORTABLE)
def test_an_app_that_cannot_be_imported_is_one_line_naming_the_fix(
    refusals: Refusals, command: list[str]
) -> None:
    line = one_line(refusals.unimportable[command[0]])
    assert "'myproject.stages'" in line and str(refusals.elsewhere) in line
    assert "PYTHONPATH" in line and "--app module:attribute" in line
    assert refusals.table_after == []


def test_a_missing_import_inside_the_app_module_is_named(clean_db: Engine, project: Path) -> None:
    (project / "myproject" / "stages.py").write_text("import not_installed_anywhere\n")
    line = one_line(cli("sweep", "--app", "myproject.stages:flow", cwd=project))
    assert "importing the app module 'myproject.stages' failed" in line
    assert "not_installed_anywhere" in line


# --- item 2: enqueue goes through the app's declaration ------------------------------------


@pytest.mark.parametrize("app", UNDECLARED_APPS)
def test_enqueue_refuses_a_stage_the_app_does_not_declare(
    refusals: Refusals, app: str | None
) -> None:
    # None: the default app, which declares nothing
    line = one_line(refusals.undeclared[app])
    assert line.startswith("onceflow: UnknownStage:") and "'grete'" in line
    assert "--worker-class" in line
    assert refusals.table_after == []


def test_enqueue_of_an_undeclared_stage_on_a_named_worker_class(
    clean_db: Engine, project: Path
) -> None:
    result = cli("enqueue", "--app", "myproject.stages:flow", "--stage", "raw_stage",
                 "--workspace", "w", "--job", "j", "--worker-class", "pull-only",
                 "--input", '{"anything": [1]}', cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stderr
    rid = json.loads(result.stdout)["request_id"]
    assert rid == request_id_for("w", "j", "", "raw_stage")
    row = json.loads(cli("show", rid, "--json", cwd=project).stdout)
    assert (row["worker_class"], row["input"]) == ("pull-only", {"anything": [1]})
    helptext = " ".join(cli("enqueue", "--help", cwd=project).stdout.split())
    assert "Naming it also enqueues a stage the app does not declare" in helptext


@pytest.mark.parametrize(("payload", "named"), INVALID_INPUTS)
def test_enqueue_refuses_input_that_does_not_fit_the_model(
    refusals: Refusals, payload: str, named: str
) -> None:
    line = one_line(refusals.invalid[payload, "model"])
    assert "input of stage 'greet' is invalid" in line and named in line
    # A class the stage does not declare is refused before the input is looked at.
    line = one_line(refusals.invalid[payload, "class"])
    assert "is served by worker class" in line and "not 'elsewhere'" in line
    assert refusals.table_after == []


# --- item 4: a malformed or unmigrated database is one line naming the fix ---------------

BAD_URLS = [
    ("not-a-url", "not a URL"),
    ("mysql://app:s3cret-pw@db.example/app", "needs PostgreSQL"),
    ("postgresql://app:s3cret-pw@127.0.0.1:54x2/app", "port '54x2' is not a number"),
    ("postgresql+psycopg://app:s3cret-pw@127.0.0.1:99999/app", "port 99999"),
]
DB_COMMANDS = [
    ["migrate"],
    ["status"],
    ["list"],
    ["show", "r1"],
    ["cancel", "r1"],
    ["requeue", "r1"],
    ["wait", "r1"],
    ["enqueue", "--stage", "greet", "--workspace", "w", "--job", "j", "--input", '{"name": "a"}'],
    ["enqueue", "--stage", "raw", "--workspace", "w", "--job", "j", "--worker-class", "x"],
    ["sweep"],
    ["worker"],
    ["api"],
    ["mcp"],
    ["demo", "--jobs", "1"],
]


def each_line(
    commands: list[list[str]], project: Path, env: dict[str, str]
) -> list[tuple[list[str], str]]:
    """Each command's one line of output; the commands run at once (each is a process)."""
    with ThreadPoolExecutor(4) as pool:
        lines = pool.map(lambda command: one_line(cli(*command, cwd=project, env=env)), commands)
        return list(zip(commands, lines, strict=True))


@pytest.fixture(scope="module")
def malformed_url_lines(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[tuple[list[str], str]]]:
    """Each bad URL's commands and their lines; every URL's commands run in one pool (none of
    them reaches a database, so none can see another)."""
    project = make_project(tmp_path_factory.mktemp("malformed"))
    runs = [
        (url, command)
        for url, _ in BAD_URLS
        for command in (DB_COMMANDS if url.startswith("mysql") else [["migrate"], ["status"]])
    ]

    def line(run: tuple[str, list[str]]) -> str:
        env = {"ONCEFLOW_DATABASE_URL": run[0], "ONCEFLOW_APP": "myproject.stages:flow"}
        return one_line(cli(*run[1], cwd=project, env=env))

    with ThreadPoolExecutor(4) as pool:
        lines = list(pool.map(line, runs))
    by_url: dict[str, list[tuple[list[str], str]]] = {url: [] for url, _ in BAD_URLS}
    for (url, command), text_ in zip(runs, lines, strict=True):
        by_url[url].append((command, text_))
    return by_url


@pytest.mark.parametrize(("url", "problem"), BAD_URLS)
def test_a_malformed_database_url_is_one_line(
    malformed_url_lines: dict[str, list[tuple[list[str], str]]], url: str, problem: str
) -> None:
    commands = DB_COMMANDS if url.startswith("mysql") else [["migrate"], ["status"]]
    assert [command for command, _ in malformed_url_lines[url]] == commands
    for command, line in malformed_url_lines[url]:
        assert "InvalidDatabaseUrl" in line and problem in line, (command, line)
        assert EXPECTED_FORM in line
        assert "s3cret-pw" not in line


@pytest.fixture()
def unmigrated_url(services: tuple[str, str]) -> Iterator[str]:
    """A fresh, empty database (unique name) on the test server, with a password in its URL
    (the server trusts local connections, so the password is never checked), dropped after."""
    admin_url, _ = services
    name = f"onceflow_unmigrated_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = make_url(admin_url).set(database=name, password="s3cret-pw")
        yield url.render_as_string(hide_password=False)
    finally:
        with psycopg.connect(libpq(admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_an_unmigrated_database_says_run_migrate(project: Path, unmigrated_url: str) -> None:
    env = {"ONCEFLOW_DATABASE_URL": unmigrated_url, "ONCEFLOW_APP": "myproject.stages:flow"}
    shown = make_url(unmigrated_url)._replace(password=None).render_as_string(hide_password=False)
    for command, line in each_line(DB_COMMANDS[1:10], project, env):
        assert line.startswith("onceflow: NotMigrated: "), (command, line)
        assert f"the database at {shown} is not migrated: run `onceflow migrate`" in line
        assert "s3cret-pw" not in line
    migrated = cli("migrate", cwd=project, env=env)
    assert migrated.returncode == 0, migrated.stderr
    status = cli("status", "--json", cwd=project, env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == {"counts": {}}


def test_worker_flags_for_a_fair_benchmark_reach_celery(
    clean_db: Engine, redis_url: str, project: Path, tmp_path: Path
) -> None:
    """``onceflow worker`` passes the flags a benchmark beside bare Celery needs: task events
    off (a Flow's own app has them on in its config, which ``-E`` alone cannot undo), no
    gossip, mingle or worker heartbeat — read back from Celery's own banner and log."""
    log = tmp_path / "worker.log"
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-P", "-m", "onceflow.cli", "worker", "--app",
             "myproject.stages:flow", "--concurrency", "1", "--pool", "solo", "--no-events",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", f"flags-{os.getpid()}@%h"],
            cwd=project, env=_env(None), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:

        def ready() -> bool:
            text = log.read_text(errors="replace")
            assert worker.poll() is None, text
            return " ready." in text

        wait_for(ready, timeout=60, what="the worker to be ready")
        text = log.read_text(errors="replace")
        assert ".> task events: OFF" in text, text
        assert "mingle: searching for neighbors" not in text, text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
