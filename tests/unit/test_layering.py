"""Layering, enforced mechanically: the import-linter contracts in pyproject.toml."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "onceflow"


def test_import_contracts_hold() -> None:
    # The contracts live in pyproject.toml [tool.importlinter]; `make lint` runs the same command.
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_nothing_connects_at_import() -> None:
    # With unreachable services, importing the whole public API must still succeed at once.
    code = (
        "import onceflow, onceflow.queue, onceflow.models, onceflow.cli, onceflow.migrate, "
        "onceflow.worker"
    )
    env = {"ONCEFLOW_DATABASE_URL": "postgresql://127.0.0.1:1/x", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_no_pickle_anywhere() -> None:
    for path in PACKAGE.rglob("*.py"):
        assert "pickle" not in imported_modules(path), path
