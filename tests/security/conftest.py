"""The security suite reuses the acceptance fixtures: real workers, a real API server."""

from pathlib import Path

import pytest

from tests.acceptance.conftest import runtime
from tests.acceptance.test_http_api import api, celery_worker, client

__all__ = ["api", "celery_worker", "client", "runtime"]


_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in tests/security is part of the security suite (``-m security``)."""
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.security)
