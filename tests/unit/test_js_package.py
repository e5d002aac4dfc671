"""The browser SDK folder (onceflow/sdk/js) as the npm package ``@onceflow/client``.

``npm pack --dry-run --json`` (offline: no registry is asked) says what a publish would
ship: the modules and their type declarations and the README, no tests. package.json's
entry points name shipped files, and every relative import of a shipped module (or of a
declaration file) resolves to a shipped file — a package that imports a file it does not
ship breaks only for the people who install it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

SDK = Path(__file__).resolve().parents[2] / "onceflow" / "sdk" / "js"
MODULES = ["index", "transport", "workspace-client", "pull-worker", "permit", "tabs"]
REQUIRED = {f"{m}.js" for m in MODULES} | {f"{m}.d.ts" for m in MODULES} | {"README.md"}
# import/export … from "…", import("…"), and bare side-effect imports: import "…"
IMPORT = re.compile(
    r"""(?:\bfrom\s*|\bimport\s*\(\s*|\bimport\s+)(["'])(?P<spec>[^"']+)\1""", re.MULTILINE
)


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``npm pack --dry-run --json`` of the SDK folder (skipped without npm, failed on CI)."""
    npm = shutil.which("npm")
    if npm is None:
        if _on_ci():
            pytest.fail("CI: npm is not installed")
        pytest.skip("npm is not installed")
    cache = tmp_path_factory.mktemp("npm-cache")
    result = subprocess.run(
        [npm, "pack", "--dry-run", "--json", "--offline", "--ignore-scripts",
         "--cache", str(cache)],
        cwd=SDK, capture_output=True, text=True, timeout=60,
        env={**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    (package,) = json.loads(result.stdout)
    assert isinstance(package, dict)
    return package


def shipped(packed: dict[str, Any]) -> set[str]:
    return {str(f["path"]) for f in packed["files"]}


def test_the_package_ships_the_modules_their_declarations_and_the_readme(
    packed: dict[str, Any],
) -> None:
    files = shipped(packed)
    assert packed["name"] == "@onceflow/client"
    assert files >= REQUIRED, f"missing from the package: {sorted(REQUIRED - files)}"


def test_the_package_ships_no_tests(packed: dict[str, Any]) -> None:
    tests = [
        f for f in shipped(packed)
        if f.startswith(("test/", "tests/", "__tests__/"))
        or re.search(r"\.(test|spec)\.[cm]?[jt]s$", f)
    ]  # fmt: skip
    assert tests == []


def test_package_json_entry_points_name_shipped_files(packed: dict[str, Any]) -> None:
    meta = json.loads((SDK / "package.json").read_text())
    files = shipped(packed)
    targets = [meta["main"], meta["types"]]
    exports = meta["exports"]
    root = exports.get(".", exports) if isinstance(exports, dict) else exports
    targets += [root["types"], root["default"]] if isinstance(root, dict) else [root]
    for target in targets:
        name = target.removeprefix("./")
        assert (SDK / name).is_file(), f"package.json names {target}, which does not exist"
        assert name in files, f"package.json names {target}, which the package does not ship"
    assert meta["type"] == "module"


def test_every_relative_import_resolves_to_a_shipped_file(packed: dict[str, Any]) -> None:
    files = shipped(packed)
    sources = sorted(f for f in files if f.endswith((".js", ".d.ts")))
    assert sources
    checked = 0
    for name in sources:
        text = (SDK / name).read_text(encoding="utf-8")
        base = Path(name).parent
        for match in IMPORT.finditer(text):
            spec = match.group("spec")
            if not spec.startswith("."):
                continue  # only relative imports: the SDK has no dependencies
            target = os.path.normpath(base / spec)
            if name.endswith(".d.ts") and target.endswith(".js"):
                target = target.removesuffix(".js") + ".d.ts"  # what TypeScript resolves
            assert target in files, f"{name} imports {spec}: {target} is not in the package"
            checked += 1
    assert checked >= len(MODULES) - 1  # index re-exports every module


def test_the_import_pattern_sees_every_form() -> None:
    sample = (
        "import { a } from \"./a.js\";\nexport * from './b.js';\n"
        'const c = await import("./c.js");\nimport "./d.js";\nimport x from "pkg";\n'
    )
    assert [m.group("spec") for m in IMPORT.finditer(sample)] == [
        "./a.js", "./b.js", "./c.js", "./d.js", "pkg",
    ]  # fmt: skip
