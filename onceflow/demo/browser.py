"""``onceflow demo --browser``: a real headless browser tab among the demo's clients.

The demo starts an ``onceflow api`` for its flow with per-run keys (stored hashed in the
api's ``ONCEFLOW_API_KEYS`` / ``ONCEFLOW_WORKER_KEYS``: an API key scoped to the run's
workspace, a worker key scoped to the pull class ``tabs``), then launches Debian's
Chromium through Playwright (``/usr/bin/chromium`` or ``$ONCEFLOW_CHROMIUM``; nothing
downloads a browser) and opens :file:`browser_tab.html` at the API's origin. The page
imports ``/sdk/index.js``, enqueues ``evaluate`` for every job on its own branch for the
class ``tabs``, runs a ``PullWorker`` that computes each column cell with
``ctx.computeOnce`` (the same compute locks as the Celery workers, the same prompt at the
counting LLM stand-in), and writes one card per job with a ``WorkspaceClient``.

The keys reach the page as an argument of ``page.evaluate`` (memory only: never in a URL,
never in a log line). The LLM key handed to the page is the run's throwaway stand-in key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from onceflow.demo.procs import Proc

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ENV = "ONCEFLOW_CHROMIUM"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]  # fmt: skip
TAB_BRANCH = "tab"
#: Seconds between two looks at the page's progress (the wait itself has a deadline).
POLL = 0.2


def chromium_path() -> str:
    """Where the demo looks for Chromium: ``$ONCEFLOW_CHROMIUM``, else Debian's."""
    return os.environ.get(CHROMIUM_ENV) or CHROMIUM


def browser_problem() -> str | None:
    """Why ``--browser`` cannot run here (one line), or None when it can."""
    path = chromium_path()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)) and shutil.which(path) is None:
        return (
            f"--browser needs Chromium at {path} (apt-get install chromium, or set "
            f"{CHROMIUM_ENV}); nothing was started"
        )
    if importlib.util.find_spec("playwright") is None:
        return (
            "--browser needs Playwright for Python (pip install 'onceflow[dev]'; it uses the "
            "installed Chromium, no browser download); nothing was started"
        )
    return None


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hash_key(key: str) -> str:
    """The stored form of a key (the api compares hashes only)."""
    from onceflow.integrations.fastapi import hash_key as hashed

    return hashed(key)


@dataclass
class TabKeys:
    """The run's keys for the tab: fresh random secrets, never printed."""

    api_key: str = field(default_factory=lambda: "of_demo_api_" + secrets.token_urlsafe(24))
    worker_key: str = field(default_factory=lambda: "of_demo_wk_" + secrets.token_urlsafe(24))

    def __repr__(self) -> str:
        return "TabKeys(<hidden>)"

    def env(self, workspace: str, worker_class: str) -> dict[str, str]:
        """The api's key tables: hashes only, each key scoped to what the tab needs."""
        return {
            "ONCEFLOW_API_KEYS": json.dumps({hash_key(self.api_key): [workspace]}),
            "ONCEFLOW_WORKER_KEYS": json.dumps({hash_key(self.worker_key): [worker_class]}),
        }


def start_api(app: str, log_dir: Path, env: dict[str, str]) -> tuple[Proc, str]:
    """A real ``onceflow api`` for ``app`` on a free port: (process, base URL). It is up
    once its log says ``Application startup complete``."""
    port = free_port()
    args = ["api", "--app", app, "--port", str(port), "--log-level", "info"]
    return Proc(args, log_dir / "api.log", env=env), f"http://127.0.0.1:{port}"


@dataclass
class TabOutcome:
    """What the tab reported (its ``status()``), or why it failed."""

    status: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    #: Whether a key of the run appeared in the api's or the page's log (checked at the end).
    keys_logged: bool | None = None


def keys_in(paths: list[Path], keys: TabKeys, extra: tuple[str, ...] = ()) -> bool:
    """True if any of the run's keys (or ``extra`` secrets) appears in one of the files."""
    secrets_ = [keys.api_key, keys.worker_key, *extra]
    for path in paths:
        text = path.read_text(errors="replace") if path.exists() else ""
        if any(secret in text for secret in secrets_):
            return True
    return False


class BrowserTab(threading.Thread):
    """The tab client: Chromium, one page, the tab's work; ``outcome`` once it ends.

    Playwright's sync API belongs to the thread that started it, so the whole browser
    lives in this thread; :meth:`stop` asks the page to stop, and the thread closes it.
    The page is loaded first (``ready`` is set then, or when the thread ends); its work
    starts on :meth:`go`, so the tab races the other clients from the same start line.
    """

    def __init__(self, api_url: str, config: dict[str, Any], log_dir: Path,
                 timeout: float) -> None:  # fmt: skip
        super().__init__(name="demo-browser-tab", daemon=True)
        self.api_url = api_url
        self._config = config  # holds the keys: never logged
        self.log_path = log_dir / "browser-tab.log"
        self.timeout = timeout
        self.outcome = TabOutcome()
        self.keys: TabKeys | None = None
        self._halt = threading.Event()
        self._go = threading.Event()
        #: Set by the caller once the api answers (the page's origin).
        self.api_up = threading.Event()
        self.ready = threading.Event()

    def stop(self) -> None:
        """Ask the tab to stop (its thread closes the browser)."""
        self._halt.set()
        self._go.set()

    def go(self) -> None:
        """Start the page's work (once ``ready``)."""
        self._go.set()

    def run(self) -> None:
        try:
            status = self._run()
            if status.get("error"):
                self.outcome.error = str(status["error"]).splitlines()[0][:300]
        except Exception as exc:  # the report says what went wrong; the run goes on
            self.outcome.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        finally:
            self.ready.set()

    def _run(self) -> dict[str, Any]:
        from playwright.sync_api import sync_playwright

        page_html = resources.files("onceflow.demo").joinpath("browser_tab.html").read_text()
        url = f"{self.api_url}/__demo__/tab.html"
        with open(self.log_path, "a", encoding="utf-8") as log, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=ARGS)
            try:
                context = browser.new_context()
                # The page (at the API's origin) calls the LLM stand-in on another loopback
                # port: Chromium's Local Network Access asks the user first, as a person
                # would allow it for a local dev server; headless, the demo allows it.
                context.grant_permissions(["local-network-access"], origin=self.api_url)

                def fulfil(route: Any) -> None:
                    route.fulfill(status=200, content_type="text/html; charset=utf-8",
                                  body=page_html)  # fmt: skip

                context.route(url, fulfil)
                page = context.new_page()

                def on_console(message: Any) -> None:
                    log.write(f"console.{message.type}: {message.text}\n")

                def on_error(error: Any) -> None:
                    log.write(f"pageerror: {error}\n")

                page.on("console", on_console)
                page.on("pageerror", on_error)
                while not self.api_up.wait(0.1):
                    if self._halt.is_set():
                        raise RuntimeError("the tab was stopped before it started")
                page.goto(url)
                page.wait_for_function(
                    "() => window.onceflowDemo && (window.onceflowDemo.ready"
                    " || window.onceflowDemo.loadError)",
                    timeout=30_000,
                )
                load_error = page.evaluate("() => window.onceflowDemo.loadError || null")
                if load_error:
                    raise RuntimeError(f"the SDK did not load in the page: {load_error}")
                self.ready.set()
                self._go.wait()
                if self._halt.is_set():
                    raise RuntimeError("the tab was stopped before it started")
                page.evaluate("config => window.onceflowDemo.start(config)", self._config)
                deadline = time.monotonic() + self.timeout
                while True:
                    status: dict[str, Any] = page.evaluate("() => window.onceflowDemo.status()")
                    self.outcome.status = status
                    if status["done"]:
                        return status
                    if self._halt.is_set() or time.monotonic() > deadline:
                        page.evaluate("() => window.onceflowDemo.stop()")
                        why = "stopped" if self._halt.is_set() else f"not done in {self.timeout}s"
                        raise RuntimeError(f"the tab was {why}")
                    time.sleep(POLL)
            finally:
                browser.close()


def tab_config(*, api_url: str, keys: TabKeys, workspace: str, worker_class: str,
               llm_url: str, llm_key: str, jobs: list[str],
               columns: list[str]) -> dict[str, Any]:  # fmt: skip
    """What the page's ``start(config)`` gets (keys included: memory only)."""
    return {
        "baseUrl": api_url,
        "apiKey": keys.api_key,
        "workerKey": keys.worker_key,
        "workspace": workspace,
        "workerClass": worker_class,
        "branch": TAB_BRANCH,
        "jobs": jobs,
        "columns": columns,
        "llmUrl": llm_url,
        "llmKey": llm_key,
        "llmModel": os.environ.get("ONCEFLOW_DEMO_LLM_MODEL", "standin-1"),
    }
