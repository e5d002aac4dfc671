"""Layering, enforced mechanically: which sub-package may import which (STYLE.md point 12)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "onceflow"

# sub-package -> sub-packages it must never import
FORBIDDEN = {
    "models": {"queue", "tasks", "locks", "oplog", "integrations", "cli", "demo"},
    "queue": {"tasks", "locks", "oplog", "integrations", "cli", "demo"},
    "locks": {"tasks", "integrations", "cli", "demo"},
    "oplog": {"tasks", "integrations", "cli", "demo"},
    # A stage body's context and the standalone worker run without Celery.
    "context": {"tasks", "integrations", "cli", "demo", "worker"},
    "worker": {"tasks", "integrations", "cli", "demo"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    offenders = []
    root = PACKAGE / layer
    paths = sorted(root.rglob("*.py")) if root.is_dir() else [PACKAGE / f"{layer}.py"]
    assert paths and all(p.exists() for p in paths)
    for path in paths:
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "onceflow" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert offenders == []


def test_nothing_connects_at_import() -> None:
    import subprocess
    import sys

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
