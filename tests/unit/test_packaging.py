"""The build reads pyproject.toml without a warning (`make setup` used to print ~30 lines of
setuptools' license-table deprecation per install)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import project_copy

PREPARE = (
    "import sys; from setuptools import build_meta; "
    "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
)


def test_the_build_backend_reads_the_project_without_a_warning(tmp_path: Path) -> None:
    src = project_copy(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", PREPARE, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metadata = (out / proc.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata.splitlines()
