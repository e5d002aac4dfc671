"""The documentation site: its generated reference pages cover the code, and it builds.

The settings, metrics and HTTP API pages are rendered from the code at every build
(docs/plugins/); these tests hold them to the code's own lists, so a new setting, metric
or route cannot be left out. The last test builds the site with ``mkdocs build --strict``
from a copy of the files a clone would have (tracked and new files; nothing ignored, so no
built site, venv or cache), as CI's ``make docs`` does from its fresh clone.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "docs" / "plugins"
sys.path.insert(0, str(PLUGINS))

import griffe_sphinx_roles  # noqa: E402
import http_api_page  # noqa: E402
import markdown_text  # noqa: E402
import metrics_page  # noqa: E402
import settings_page  # noqa: E402

from onceflow.settings import Settings  # noqa: E402

#: The reference pages of the Python API and the modules each documents whole.
MODULE_PAGES = {
    "tasks": "onceflow.tasks",
    "worker": "onceflow.worker",
    "locks": "onceflow.locks",
    "cache": "onceflow.cache",
    "spend": "onceflow.spend",
    "oplog": "onceflow.oplog",
    "models": "onceflow.models",
    "integrations": "onceflow.integrations.fastapi",
    "testing": "onceflow.testing",
}


def test_settings_page_has_every_setting() -> None:
    page = settings_page.render()
    for name in Settings.model_fields:
        var = f"ONCEFLOW_{name.upper()}"
        assert f"## `{var}` {{ #{var.lower()} }}" in page, var
        assert f"](#{var.lower()})" in page, f"{var} missing from the summary table"


def test_settings_page_has_every_variable_read_outside_the_model() -> None:
    """A variable the package reads by name is a setting or listed under 'Read outside'."""
    settings = {f"ONCEFLOW_{name.upper()}" for name in Settings.model_fields}
    named = set()
    for path in (ROOT / "onceflow").rglob("*.py"):
        named.update(re.findall(r"\"((?:ONCEFLOW|CELERY|PROMETHEUS)_[A-Z_]+)\"", path.read_text()))
    missing = named - settings - set(settings_page.OTHER_VARIABLES)
    assert not missing, f"variables read but not on the settings page: {sorted(missing)}"


def test_metrics_page_has_every_metric_and_only_those() -> None:
    from onceflow.metrics.definitions import METRIC_NAMES

    names = {m.name for m in metrics_page.all_metrics()}
    assert names == METRIC_NAMES
    page = metrics_page.render()
    for name in METRIC_NAMES:
        assert f"| `{name}` |" in page, name


def test_metrics_page_shows_labels() -> None:
    by_name = {m.name: m for m in metrics_page.all_metrics()}
    assert by_name["onceflow_requests_enqueued_total"].labels == (
        "worker_class",
        "stage",
        "outcome",
    )
    assert by_name["onceflow_requests"].labels == ("worker_class", "stage", "status")
    assert by_name["onceflow_requests"].kind == "gauge"


def test_http_api_page_has_every_route_and_schema() -> None:
    schema = http_api_page.openapi_schema()
    page = http_api_page.render(schema)
    ops = http_api_page.operations(schema)
    assert len(ops) >= 15
    for method, path, op in ops:
        assert f"### `{method} {path}`" in page, (method, path)
        for param in op.get("parameters", []):
            assert f"| `{param['name']}` | {param['in']} |" in page, (path, param["name"])
    for name in schema["components"]["schemas"]:
        assert f"### {name} {{ #{http_api_page.anchor(name)} }}" in page, name


def test_http_api_schema_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page shows the defaults, whatever the building machine's environment says."""
    before = http_api_page.openapi_schema()
    monkeypatch.setenv("ONCEFLOW_API_MAX_BODY_BYTES", "2048")
    monkeypatch.setenv("ONCEFLOW_APP", "no.such.module:flow")
    assert http_api_page.openapi_schema() == before


def test_text_escapes_html_outside_code_and_links_pages() -> None:
    out = markdown_text.text(
        'keys as {"<sha256>": ["*"]}, `a|<b>` and docs/reliability.md', page="reference/x.md"
    )
    assert "&lt;sha256&gt;" in out
    assert "\\*" in out
    assert "`a|<b>`" in out
    assert "[docs/reliability.md](../reliability.md)" in out
    assert markdown_text.text("docs/no-such-page.md", page="x.md") == "docs/no-such-page.md"


def test_sphinx_roles_become_optional_references() -> None:
    import griffe

    module = griffe.Module("m")
    out = griffe_sphinx_roles.rewrite(
        module,
        "Use :class:`~onceflow.Queue` and :meth:`Queue.wait\n<onceflow.queue.done.DoneWaiter.wait>`"
        ", for example::\n\n    q = Queue()\n",
    )
    assert '<autoref identifier="onceflow.Queue" optional><code>Queue</code></autoref>' in out
    assert (
        '<autoref identifier="onceflow.queue.done.DoneWaiter.wait" optional>'
        "<code>Queue.wait</code></autoref>"
    ) in out
    assert "for example:\n\n    q = Queue()" in out


def _fresh_checkout(dest: Path) -> Path:
    """The files a clone plus ``git add`` of every new file would have, copied to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` of a fresh checkout; the built site's directory."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    checkout = _fresh_checkout(tmp_path_factory.mktemp("checkout"))
    site = checkout / "site"
    env = {**os.environ, "PYTHONPATH": str(checkout), "NO_MKDOCS_2_WARNING": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("ONCEFLOW_")}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return site


@pytest.mark.slow
def test_site_builds_strict_from_a_fresh_checkout(built_site: Path) -> None:
    for page in (
        "index.html",
        "reference/settings/index.html",
        "reference/metrics/index.html",
        "reference/http-api/index.html",
        "reference/cli/index.html",
        "explanation/guarantees/index.html",
    ):
        assert (built_site / page).is_file(), page
    schema = json.loads((built_site / "reference/openapi.json").read_text())
    # Built in a fresh process, as the site is: this test process's op-type registry also
    # holds the op types other test modules register.
    fresh = subprocess.run(
        [sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
         "import http_api_page; print(json.dumps(http_api_page.openapi_schema()))", str(PLUGINS)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert schema == json.loads(fresh.stdout)


def _text(path: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", path.read_text()))


@pytest.mark.slow
def test_cli_page_has_every_command(built_site: Path) -> None:
    from onceflow.cli import main

    page = (built_site / "reference/cli/index.html").read_text()
    for name in main.commands:  # type: ignore[attr-defined]
        assert f'id="onceflow-{name}"' in page, name


@pytest.mark.slow
def test_python_reference_documents_every_public_name(built_site: Path) -> None:
    import importlib

    import onceflow

    top = _text(built_site / "reference/python/onceflow/index.html")
    for name in onceflow.__all__:
        assert name in top, f"onceflow.{name} is on no reference page"
    for page, module_name in MODULE_PAGES.items():
        module: Any = importlib.import_module(module_name)
        built = (built_site / f"reference/python/{page}/index.html").read_text()
        for name in module.__all__:
            assert f'id="{module_name}.{name}"' in built, f"{module_name}.{name}"


def test_every_test_a_page_names_exists() -> None:
    """``tests/….py::test_name`` on a page (the guarantees, the failure model) names a test
    function of that file, so a renamed or removed test cannot leave a page pointing at
    nothing."""
    import ast

    named = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path, name in named.findall(page.read_text()):
            source = ROOT / path
            functions = (
                {
                    node.name
                    for node in ast.walk(ast.parse(source.read_text()))
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                if source.is_file()
                else set()
            )
            if name not in functions:
                missing.append(f"{page.relative_to(ROOT)}: {path}::{name}")
    assert not missing, "\n".join(missing)
