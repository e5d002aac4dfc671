"""docker/compose.yaml: every service command is a real `onceflow` command (no Docker here)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
ONCEFLOW_SERVICES = {
    name: svc for name, svc in COMPOSE["services"].items() if svc.get("image") == "onceflow:latest"
}


def test_the_expected_services_exist() -> None:
    assert set(COMPOSE["services"]) >= {
        "postgres", "redis", "migrate", "worker-llm", "worker-fallback", "beat", "flower", "api",
    }  # fmt: skip
    assert "noeviction" in COMPOSE["services"]["redis"]["command"]
    assert "--requirepass" in COMPOSE["services"]["redis"]["command"]
    assert "autovacuum_naptime=10s" in COMPOSE["services"]["postgres"]["command"]
    for name in ("postgres", "redis", "flower", "api"):
        assert "healthcheck" in COMPOSE["services"][name]


def _help(command: list[str]) -> subprocess.CompletedProcess[str]:
    # --help after the service's own arguments: click rejects any option that does not exist.
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", *command, "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess[str]]:
    """Each service's command run with --help; side by side (nothing is started or written)."""
    names = sorted(ONCEFLOW_SERVICES)
    with ThreadPoolExecutor(len(names)) as pool:
        results = pool.map(lambda n: _help(ONCEFLOW_SERVICES[n]["command"]), names)
        return dict(zip(names, results, strict=True))


@pytest.mark.parametrize("name", sorted(ONCEFLOW_SERVICES))
def test_service_command_exists_in_the_cli(
    name: str, helps: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    service: dict[str, Any] = ONCEFLOW_SERVICES[name]
    result = helps[name]
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
    if name != "migrate":
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_dockerfile_runs_as_non_root() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "USER onceflow" in dockerfile
    assert "slim" in dockerfile
