"""A real `onceflow api` with operator keys and a real Celery worker, for the dashboard tests."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.demo import procs
from onceflow.integrations.fastapi import hash_key
from onceflow.keys import counters_workspaces_key, queue_name
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, api_server
from tests.conftest import TEST_ARTIFACTS

APP = "tests.browser.stages:flow"
VIEWER_KEY = "of_test_dash_viewer_0123456789abcdef"
ADMIN_KEY = "of_test_dash_admin_0123456789abcdefg"
API_KEY = "of_test_dash_api_key_0123456789abcdef"  # an API key: not an operator key
WC = "t-dash"
HOLD_WC = "t-dash-hold"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="package")
def dashboard_api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[tuple[str, procs.Proc]]:
    """A real `onceflow api` serving the dashboard: (base URL, process)."""
    env = {
        **TEST_ENV,
        "ONCEFLOW_OPERATOR_KEYS": json.dumps(
            {hash_key(VIEWER_KEY): ["viewer"], hash_key(ADMIN_KEY): ["admin"]}
        ),
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): ["*"]}),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
    }
    with api_server(tmp_path_factory.mktemp("dash-api"), env, app=APP) as (url, proc):
        yield url, proc
    log_text = proc.log()
    for secret in (VIEWER_KEY, ADMIN_KEY, API_KEY):
        assert secret not in log_text  # keys are never logged


@pytest.fixture(scope="package")
def dashboard_worker(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[procs.Proc]:
    """A real Celery worker (prefork, 2 children: one may hold a long stage) of the stages."""
    redis_lib.Redis.from_url(redis_url).delete(queue_name(WC), queue_name(HOLD_WC))
    env = {**TEST_ENV, "PYTHONPATH": str(ROOT)}
    worker = procs.start_worker(
        tmp_path_factory.mktemp("dash-worker"), APP, WC, HOLD_WC, concurrency=2, env=env, cwd=ROOT,
        name="dash",
    )  # fmt: skip
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture()
def dash(clean_db: Engine, redis_url: str) -> Iterator[Any]:
    """The dashboard stages' flow on an empty table, with clean test keys in Redis."""
    os.environ.update(TEST_ENV)
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    from tests.browser import stages

    client = redis_lib.Redis.from_url(redis_url)
    for key in client.scan_iter("onceflow-test:dash:*"):
        client.delete(key)
    for key in client.scan_iter("onceflow:{dash-*"):
        client.delete(key)
    client.delete(queue_name(WC), queue_name(HOLD_WC), counters_workspaces_key())
    yield stages
    get_settings.cache_clear()


def artifacts_dir() -> Path:
    """Where test artefacts go: $ONCEFLOW_TEST_ARTIFACTS, else <repo>/test-artifacts/."""
    path = Path(TEST_ARTIFACTS or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path
