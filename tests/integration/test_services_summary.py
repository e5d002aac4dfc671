"""`make test` says which servers it used: one line in pytest's terminal summary.

Each check runs pytest itself in a subprocess (no pytester) and reads its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from onceflow.embedded import service_answers
from tests.conftest import ROOT, service_summary

HERE = "tests/integration/test_services_summary.py"


def run_pytest(node: str, **env: str) -> str:
    """Run one test node in a fresh pytest; its combined output."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    environ.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_the_services_fixture_gives_servers_that_answer(services: tuple[str, str]) -> None:
    """The node the summary check below runs: it asks for the session's servers."""
    assert service_answers(*services) == (True, True)


@pytest.fixture(scope="module")
def summaries(services: tuple[str, str]) -> dict[str, str]:
    """The output of each fresh pytest below, by case; the three run side by side (each its
    own process, database and, for ``embedded``, its own Valkey), so their waits overlap."""
    node = f"{HERE}::test_the_services_fixture_gives_servers_that_answer"
    runs = {
        "configured": (node, {"ONCEFLOW_TEST_DATABASE_URL": services[0],
                              "ONCEFLOW_TEST_REDIS_URL": services[1]}),
        "none": ("tests/unit/test_ids.py::test_random_ids_and_tokens_are_fresh", {}),
        # Nothing listens on port 1: the suite starts its embedded Valkey and says so.
        "embedded": (node, {"ONCEFLOW_TEST_DATABASE_URL": services[0],
                            "ONCEFLOW_TEST_REDIS_URL": "redis://127.0.0.1:1/0"}),
    }  # fmt: skip
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {k: pool.submit(run_pytest, n, **env) for k, (n, env) in runs.items()}
        return {k: f.result() for k, f in futures.items()}


def test_the_summary_names_the_configured_servers(
    services: tuple[str, str], summaries: dict[str, str]
) -> None:
    db_url, redis_url = services
    out = summaries["configured"]
    expected = service_summary(
        [("Postgres", db_url, "configured"), ("Redis", redis_url, "configured")]
    )
    assert expected in out.splitlines(), out
    assert "Postgres postgresql://" in expected
    assert "(configured), Redis redis://" in expected


def test_the_summary_says_when_no_server_was_used(summaries: dict[str, str]) -> None:
    out = summaries["none"]
    assert (
        "onceflow services: none used (no test in this run needed Postgres or Redis)"
        in out.splitlines()
    ), out


def test_the_summary_never_shows_a_password_or_the_driver() -> None:
    pg = "postgresql+psycopg://app:pg-s3cret@db.example:5432/postgres"
    redis = "redis://:redis-s3cret@cache.example:6380/3"
    line = service_summary(
        [("Postgres", pg, "configured"), ("Redis", redis, "embedded, started by the suite")]
    )
    assert line == (
        "onceflow services: Postgres postgresql://app@db.example:5432 (configured), "
        "Redis redis://cache.example:6380/3 (embedded, started by the suite)"
    )
    assert "s3cret" not in line


@pytest.mark.slow
def test_the_summary_says_when_a_server_was_embedded(
    services: tuple[str, str], summaries: dict[str, str]
) -> None:
    out = summaries["embedded"]
    line = next((x for x in out.splitlines() if x.startswith("onceflow services: ")), out)
    postgres = service_summary([("Postgres", services[0], "configured")])
    assert line.startswith(postgres + ", Redis redis://127.0.0.1:"), line
    assert line.endswith(" (embedded, started by the suite)"), line
    assert ":1/" not in line, line
