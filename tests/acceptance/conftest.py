"""Fixtures for tests with real Celery workers on the real Redis broker."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import Engine

from onceflow.keys import queue_name

# Short leases and fast retries, for every process the tests start (workers read these too).
TEST_ENV = {
    "ONCEFLOW_BACKOFF_BASE_SECONDS": "0.2",
    "ONCEFLOW_BACKOFF_MAX_SECONDS": "1",
    "ONCEFLOW_SWEEP_INTERVAL_SECONDS": "0.5",
    "ONCEFLOW_REDISPATCH_AFTER_SECONDS": "30",
}


@pytest.fixture()
def runtime(clean_db: Engine, redis_url: str) -> Iterator[Any]:
    """The test flow on an empty table and clean broker queues, with fast test settings."""
    os.environ.update(TEST_ENV)
    from onceflow.settings import get_settings

    get_settings.cache_clear()
    from tests.acceptance import stages

    client = redis_lib.Redis.from_url(redis_url)
    for key in client.scan_iter("onceflow-test:*"):
        client.delete(key)
    for wc in ["t-default", "t-block", "t-fail", "t-kill", "t-purge", "t-pickle"]:
        client.delete(queue_name(wc))
    client.delete("onceflow")
    yield stages
    get_settings.cache_clear()


def executions(redis_url: str, request_id: str) -> list[dict[str, Any]]:
    """Every recorded start of the stage body for ``request_id``."""
    client = redis_lib.Redis.from_url(redis_url)
    return [json.loads(x) for x in client.lrange(f"onceflow-test:exec:{request_id}", 0, -1)]


def processed(redis_url: str, request_id: str) -> int:
    """How many Celery messages for ``request_id`` the workers processed."""
    value = redis_lib.Redis.from_url(redis_url).get(f"onceflow-test:processed:{request_id}")
    return int(value or 0)


def release(redis_url: str, request_id: str, attempt: int) -> None:
    """Let the blocker stage's run number ``attempt`` return."""
    redis_lib.Redis.from_url(redis_url).rpush(f"onceflow-test:release:{request_id}:{attempt}", 1)
