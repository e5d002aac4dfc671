"""Django: ``manage.py migrate`` creates onceflow's tables (so Django's test database has
them), and ``ONCEFLOW = {...}`` in settings.py reaches onceflow's settings beneath the
environment.

A small Django project is written to a temporary directory and run for real in
subprocesses (``manage.py migrate``, ``test``, ``shell``), on a fresh database each:
the Django of the acceptance tests is configured in-process and stays untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import make_url

from onceflow.health import head_revisions
from tests.conftest import libpq

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-django-pw"

SETTINGS = """
import json
import os

from onceflow.integrations.django import database_settings

SECRET_KEY = "test-only"
INSTALLED_APPS = ["onceflow.integrations.django", "probeapp"]
DATABASES = {"default": database_settings(os.environ["PROBE_DATABASE_URL"])}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
ONCEFLOW = json.loads(os.environ.get("PROBE_ONCEFLOW", "null"))
"""

MANAGE = """
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "probeproject.settings")
from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
"""

APP_TESTS = """
from django.db import connection
from django.test import TestCase


class OnceflowTables(TestCase):
    def test_the_test_database_has_onceflows_tables(self):
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass('workspace_process_requests') IS NOT NULL")
            self.assertTrue(cursor.fetchone()[0])
            cursor.execute("SELECT current_database()")
            self.assertTrue(cursor.fetchone()[0].startswith("test_"))
"""


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """The Django project: settings, manage.py and an app whose only test reads the tables."""
    (tmp_path / "probeproject").mkdir()
    (tmp_path / "probeproject" / "__init__.py").write_text("")
    (tmp_path / "probeproject" / "settings.py").write_text(SETTINGS)
    (tmp_path / "probeapp").mkdir()
    (tmp_path / "probeapp" / "__init__.py").write_text("")
    (tmp_path / "probeapp" / "tests.py").write_text(APP_TESTS)
    (tmp_path / "manage.py").write_text(MANAGE)
    return tmp_path


def manage(
    project: Path, database: str, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """``python manage.py *args`` in ``project`` on ``database``; ONCEFLOW_* from ``env`` only."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ONCEFLOW_", "DJANGO_"))}
    clean.update(env)
    clean["PROBE_DATABASE_URL"] = database
    clean["PYTHONPATH"] = os.pathsep.join([str(project), str(ROOT)])
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=project,
        env=clean,
        capture_output=True,
        text=True,
        timeout=180,
    )


def with_password(url: str) -> str:
    """``url`` carrying a password (the local server trusts the user: it is not checked)."""
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def tables_and_revision(url: str) -> tuple[bool, set[str], list[tuple[str, str]]]:
    with psycopg.connect(libpq(url)) as conn:
        found = conn.execute("SELECT to_regclass('workspace_process_requests') IS NOT NULL")
        table = bool(found.fetchone()[0])  # type: ignore[index]
        revisions = {r[0] for r in conn.execute("SELECT version_num FROM onceflow_alembic_version")}
        applied = conn.execute(
            "SELECT app, name FROM django_migrations WHERE app = 'onceflow' ORDER BY id"
        ).fetchall()
    return table, revisions, applied


def test_migrate_creates_onceflows_tables_once(project: Path, empty_database: str) -> None:
    url = with_password(empty_database)
    first = manage(project, url, "migrate", "--noinput")
    assert first.returncode == 0, first.stderr
    table, revisions, applied = tables_and_revision(empty_database)
    assert table
    assert revisions == set(head_revisions())
    assert applied == [("onceflow", "0001_onceflow_schema")]
    again = manage(project, url, "migrate", "--noinput")  # idempotent
    assert again.returncode == 0, again.stderr
    assert "No migrations to apply" in again.stdout
    assert tables_and_revision(empty_database) == (table, revisions, applied)
    # Unapplying would drop every request: refused, the tables stay.
    back = manage(project, url, "migrate", "onceflow", "zero", "--noinput")
    assert back.returncode != 0
    assert "are not dropped" in back.stderr
    assert tables_and_revision(empty_database)[:2] == (True, revisions)
    for run in (first, again, back):
        assert PASSWORD not in run.stdout + run.stderr


def test_djangos_test_database_gets_onceflows_tables(project: Path, empty_database: str) -> None:
    run = manage(project, with_password(empty_database), "test", "probeapp", "--noinput")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Ran 1 test" in run.stderr and "OK" in run.stderr, run.stderr
    assert PASSWORD not in run.stdout + run.stderr


READ = (
    "import json; from onceflow.settings import get_settings; from onceflow.tasks import Flow; "
    "s = get_settings(); print(json.dumps([s.lease_seconds, s.max_attempts, "
    "Flow().settings.lease_seconds]))"
)


def test_the_ONCEFLOW_setting_reaches_onceflows_settings_beneath_the_environment(
    project: Path, empty_database: str
) -> None:
    values = json.dumps({"lease_seconds": 42, "max_attempts": 7})
    plain = manage(project, empty_database, "shell", "-c", READ, PROBE_ONCEFLOW=values)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout.strip().splitlines()[-1]) == [42.0, 7, 42.0]
    # An environment variable that is set wins over the same name in ONCEFLOW.
    env_wins = manage(
        project, empty_database, "shell", "-c", READ,
        PROBE_ONCEFLOW=values, ONCEFLOW_LEASE_SECONDS="12",
    )  # fmt: skip
    assert env_wins.returncode == 0, env_wins.stderr
    assert json.loads(env_wins.stdout.strip().splitlines()[-1]) == [12.0, 7, 12.0]
    # Without ONCEFLOW, the fields' defaults.
    unset = manage(project, empty_database, "shell", "-c", READ)
    assert json.loads(unset.stdout.strip().splitlines()[-1])[:2] == [30.0, 5], unset.stderr


def test_a_misspelt_ONCEFLOW_setting_stops_django(project: Path, empty_database: str) -> None:
    typo = json.dumps({"lease_secnds": 42})
    run = manage(project, empty_database, "shell", "-c", READ, PROBE_ONCEFLOW=typo)
    assert run.returncode != 0
    assert "ImproperlyConfigured" in run.stderr
    assert "unknown onceflow setting(s): lease_secnds" in run.stderr
