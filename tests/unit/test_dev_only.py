"""Dev-only code stays off the runtime: importing onceflow, its CLI, its worker runtime or
its integrations loads neither the demo nor the embedded dev servers (whose set-up may
create a system user with ``useradd``). The CLI's dev commands import them when run.

A fresh interpreter per check (the test session may have imported them already).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

DEV_ONLY = ("onceflow.demo", "onceflow.embedded")


@pytest.mark.parametrize(
    "module",
    [
        "onceflow",
        "onceflow.cli",
        "onceflow.tasks",
        "onceflow.worker",
        "onceflow.integrations.fastapi",
        "onceflow.integrations.pull",
    ],
)
def test_importing_the_runtime_loads_no_dev_only_code(module: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"print(sorted(m for m in sys.modules if m.startswith({DEV_ONLY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_dev_commands_still_find_them() -> None:
    """``onceflow demo --help`` and ``onceflow dev-services --help`` run (the commands exist;
    their modules are imported when they run, not at the CLI's start)."""
    for command in ("demo", "dev-services"):
        out = subprocess.run(
            [sys.executable, "-m", "onceflow.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "Usage" in out.stdout
