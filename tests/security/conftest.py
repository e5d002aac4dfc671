"""The security suite reuses the acceptance fixtures: real workers, a real API server."""

from tests.acceptance.conftest import runtime
from tests.acceptance.test_http_api import api, celery_worker, client

__all__ = ["api", "celery_worker", "client", "runtime"]
