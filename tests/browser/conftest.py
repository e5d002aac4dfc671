"""What the browser tests share: Debian's Chromium, real `onceflow api` processes, a Celery worker.

* ``browser``: one headless Chromium (``/usr/bin/chromium`` through Playwright's
  ``executable_path``; nothing downloads a browser) for the whole package;
* ``dashboard_api`` / ``dashboard_worker`` / ``dash``: the dashboard tests' server and worker;
* ``sdk_api``: an `onceflow api` with API and worker keys for the SDK tests, and
  :func:`open_tab`: a page at the API's own origin (so ``import "/sdk/index.js"`` and the
  ``/v1`` calls are same-origin, as in a deployment that serves its app beside the API).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.demo import procs
from onceflow.demo.standins import StandIn
from onceflow.integrations.fastapi import hash_key
from onceflow.keys import counters_workspaces_key, queue_name
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, api_server
from tests.conftest import TEST_ARTIFACTS

APP = "tests.browser.stages:flow"
VIEWER_KEY = "of_test_dash_viewer_0123456789abcdef"
ADMIN_KEY = "of_test_dash_admin_0123456789abcdefg"
API_KEY = "of_test_dash_api_key_0123456789abcdef"  # an API key: not an operator key
# An admin key limited to the workspaces "dash-ws1" and "dash-own-*": other workspaces'
# payloads are withheld from it.
SCOPED_KEY = "of_test_dash_scoped_0123456789abcdef"
SCOPED_WORKSPACES = ["dash-ws1", "dash-own-*"]
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
            {
                hash_key(VIEWER_KEY): ["viewer"],
                hash_key(ADMIN_KEY): ["admin"],
                hash_key(SCOPED_KEY): {"roles": ["admin"], "workspaces": SCOPED_WORKSPACES},
            }
        ),
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(API_KEY): ["*"]}),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
    }
    with api_server(tmp_path_factory.mktemp("dash-api"), env, app=APP) as (url, proc):
        yield url, proc
    log_text = proc.log()
    for secret in (VIEWER_KEY, ADMIN_KEY, API_KEY, SCOPED_KEY):
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


CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, for the whole package (skipped without it; failed on CI)."""
    if not os.path.exists(CHROMIUM) or shutil.which(CHROMIUM) is None:
        reason = f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"CI: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


# ------------------------------------------------------------------------- the SDK

SDK_APP = "tests.browser.sdk_stages:flow"
SDK_API_KEY = "of_test_sdk_api_key_0123456789abcdef"  # workspaces sdk-*
SDK_WORKER_KEY = "of_test_sdk_worker_key_0123456789ab"  # worker classes t-tab*
SDK_WORKSPACES = ["sdk-w1", "sdk-w2", "sdk-w3", "sdk-w4", "sdk-w5", "sdk-w6"]


@pytest.fixture(scope="package")
def sdk_api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[tuple[str, procs.Proc]]:
    """A real `onceflow api` for the SDK tests: (base URL, process). Keys never logged."""
    env = {
        **TEST_ENV,
        "PYTHONPATH": str(ROOT),
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(SDK_API_KEY): SDK_WORKSPACES}),
        "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(SDK_WORKER_KEY): ["*"]}),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": "",
        "ONCEFLOW_API_SSE_KEEPALIVE_SECONDS": "1",
    }
    with api_server(tmp_path_factory.mktemp("sdk-api"), env, app=SDK_APP) as (url, proc):
        yield url, proc
    log_text = proc.log()
    for secret in (SDK_API_KEY, SDK_WORKER_KEY):
        assert secret not in log_text  # keys are never logged


def open_tab(context: Any, base_url: str, body: str, name: str = "tab") -> Any:
    """A new page of ``context`` at ``{base_url}/__test__/{name}.html`` holding ``body``.

    The page is served by Playwright (``context.route``) at the API's origin, so it is
    same-origin with ``/sdk/`` and ``/v1``; a reload is served the same page again.
    """
    url = f"{base_url}/__test__/{name}.html"

    def fulfil(route: Any) -> None:
        route.fulfill(status=200, content_type="text/html; charset=utf-8", body=body)

    context.route(url, fulfil)
    page = context.new_page()
    page.goto(url)
    return page


#: The LLM stand-in's key (a test value, never a real one): the pages send it to the stand-in.
LLM_KEY = "sk-test-standin-not-a-secret-0123456789"  # a stand-in's key, never a real one


@pytest.fixture(scope="module")
def llm() -> Iterator[StandIn]:
    """The counting LLM stand-in (CORS-enabled: the tabs call it directly)."""
    server = StandIn("llm", latency=0.3, api_key=LLM_KEY).start()
    yield server
    server.stop()
