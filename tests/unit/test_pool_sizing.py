"""A worker whose stages share one process sizes the database pool to its concurrency."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

import onceflow.db as db
from onceflow.db import engines
from onceflow.tasks.worker_process import _size_pools


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = engines._min_pool_size
    yield
    engines._min_pool_size = before


@pytest.mark.parametrize("pool_cls", ["threads", "gevent", "celery.concurrency.thread"])
def test_a_threads_pool_gets_a_connection_per_task_plus_two(pool_cls: str) -> None:
    _size_pools(sender=SimpleNamespace(pool_cls=pool_cls, concurrency=16))
    engine = db.make_engine("postgresql+psycopg://u@127.0.0.1:1/x")  # never connects
    assert engine.pool.size() == 18  # type: ignore[attr-defined]


def test_prefork_keeps_the_configured_size() -> None:
    engines._min_pool_size = 0
    _size_pools(sender=SimpleNamespace(pool_cls="prefork", concurrency=16))
    engine = db.make_engine("postgresql+psycopg://u@127.0.0.1:1/x", pool_size=5)
    assert engine.pool.size() == 5  # type: ignore[attr-defined]
    assert engines._min_pool_size == 0
