"""A database that stops answering (no error, nothing closed) bounds every scrape."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import Engine

from onceflow.metrics.collector import DatabaseCollector
from tests.metrics.stall_proxy import StallProxy

# Generous: a scrape that does not answer by then is stuck, not slow.
DEADLINE_SECONDS = 30.0


def _up(body: str) -> float:
    lines = [ln for ln in body.splitlines() if ln.startswith("onceflow_database_up ")]
    assert len(lines) == 1, body
    return float(lines[0].split()[1])


def test_a_stalled_database_answers_database_up_0_and_recovers(
    clean_db: Engine, database_url: str
) -> None:
    proxy, through = StallProxy.for_url(database_url)
    with proxy:
        reg = CollectorRegistry()
        reg.register(DatabaseCollector(through, timeout=1.0))
        assert _up(generate_latest(reg).decode()) == 1.0  # connected through the proxy
        proxy.stall()
        answers: dict[int, float] = {}

        def scrape(i: int) -> None:
            answers[i] = _up(generate_latest(reg).decode())

        # Concurrent scrapes: one holds the collector's connection, the others wait for it.
        threads = [threading.Thread(target=scrape, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_SECONDS)
        assert not any(t.is_alive() for t in threads), "a scrape hung on the stalled database"
        assert answers == {0: 0.0, 1: 0.0, 2: 0.0}
        proxy.resume()
        assert _up(generate_latest(reg).decode()) == 1.0  # a new connection, answering again
