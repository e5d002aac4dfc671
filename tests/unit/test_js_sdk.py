"""The browser SDK's pure parts under Node's test runner (``onceflow/sdk/js/test/``).

One wrapper for the whole folder: ``node --test`` runs every ``*.test.js`` there. Without
``node`` the test skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SDK = Path(__file__).resolve().parents[2] / "onceflow" / "sdk" / "js"


def test_node_tests_of_the_js_sdk_pass() -> None:
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("CI: node is not installed (Node.js >= 20 runs the JS SDK's tests)")
        pytest.skip("node is not installed")
    assert list((SDK / "test").glob("*.test.js")), "no Node tests found"
    done = subprocess.run(
        [node, "--test", "test/"], cwd=SDK, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
