"""Metrics of real prefork Celery workers, merged from the multiprocess directory, checked
against the table's truth and the counting provider stand-in."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import Engine, text

from onceflow.keys import queue_name
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import ROOT, Proc, free_port, wait_for
from tests.integration.standin import StandIn
from tests.metrics.scrape import Samples, scrape, total

APP = "tests.metrics.stages:flow"


@pytest.fixture()
def standin() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture()
def broker(redis_url: str) -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(redis_url)
    keys = [queue_name("m-work"), queue_name("m-idle"), "onceflow.metrics-test"]
    client.delete(*keys)
    yield client
    client.delete(*keys)


def truth(engine: Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def live_file_pids(path: Path) -> set[int]:
    found = (re.search(r"live\w*_(\d+)\.db$", f.name) for f in path.iterdir())
    return {int(m.group(1)) for m in found if m}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_prefork_worker_metrics_match_the_table(
    tmp_path: Path, clean_db: Engine, broker: redis_lib.Redis, standin: StandIn
) -> None:
    prom = tmp_path / "prom"
    prom.mkdir()
    port = free_port()
    env = {
        **TEST_ENV, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(prom),
        "ONCEFLOW_METRICS_PORT": str(port),
    }  # fmt: skip
    cell = "cell-" + secrets.token_hex(4)
    plan: list[dict[str, Any]] = [
        *({"stage": "m_ok", "job": f"ok{i}", "dup": i < 2} for i in range(6)),
        *({"stage": "m_flaky", "job": f"fl{i}"} for i in range(2)),
        {"stage": "m_dead", "job": "dead"},
        {"stage": "m_kill", "job": "kill"},
        *(
            {
                "stage": "m_lock",
                "job": "jl",
                "branch": f"b{i}",
                "input": {"standin": standin.url, "cell": cell},
            }
            for i in range(4)
        ),
        *({"stage": "m_op", "job": f"op{i}", "input": {"value": i}} for i in range(2)),
        *({"stage": "m_idle", "job": f"idle{i}"} for i in range(3)),
        *({"stage": "m_idle", "job": f"later{i}", "delay": 3600} for i in range(2)),
    ]
    args = ["worker", "--app", APP, "--concurrency", "2", "--worker-class", "m-work"]
    worker = Proc([*args, "-n", f"m-{os.getpid()}@%h"], tmp_path / "worker.log", env, ROOT)
    exporter = None
    try:
        # The enqueuer starts beside the worker's start-up: its wake-ups wait in the broker.
        enqueuer = subprocess.Popen(
            [sys.executable, "-m", "tests.metrics.enqueuer", json.dumps(plan)],
            env={**os.environ, **env}, cwd=ROOT,
        )  # fmt: skip
        try:
            worker.wait_log(" ready.")
        finally:
            assert enqueuer.wait(timeout=60) == 0
        busy = "SELECT count(*) FROM workspace_process_requests WHERE worker_class = 'm-work' "
        busy += "AND status NOT IN ('succeeded', 'dead')"
        wait_for(lambda: truth(clean_db, busy) == 0, timeout=30, what="the drain")

        # Children exited after one task each; those that exited cleanly marked themselves
        # dead (their live-gauge files are gone): only the SIGKILLed one may be left.
        exited = {p for p in live_file_pids(prom) if not alive(p)}
        assert len(exited) == 1, exited  # the SIGKILLed child: no hook ran
        # ...whose file still says one body in progress: without the scrape's pruning of
        # dead pids it would count forever.
        raw = MultiProcessCollector(None, str(prom))
        stale = sum(
            x.value for m in raw.collect() if m.name == "onceflow_stages_in_progress"
            for x in m.samples
        )  # fmt: skip
        assert stale == 1
        counter_pids = {f.name for f in prom.glob("counter_*.db")}
        assert len(counter_pids) >= 8, counter_pids  # recycled children wrote their counts

        claims = truth(clean_db, "SELECT sum(attempts) FROM workspace_process_requests")
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(
            lambda: total(scrape(url), "onceflow_attempts_total") == claims,
            timeout=10, what="every attempt recorded",
        )  # fmt: skip
        s = scrape(url)
        _check_against_table(s, clean_db, claims, len(plan))
        assert not {p for p in live_file_pids(prom) if not alive(p)}  # pruned by the scrape

        # Compute lock: the stand-in's call count is the truth of what was paid.
        paid = standin.calls[cell]
        assert paid >= 1
        assert total(s, "onceflow_compute_lock_total", outcome="computes") == paid
        assert total(s, "onceflow_provider_calls_saved_total") == 4 - paid

        # Op outcomes, one of each per op stage.
        for outcome in ("applied", "duplicate", "conflict", "refused"):
            assert total(s, "onceflow_ops_total", outcome=outcome) == 2, outcome

        # The standalone exporter over the same directory says the same.
        eport = free_port()
        exporter = Proc(["metrics", "--port", str(eport)], tmp_path / "exporter.log", env, ROOT)
        exporter.wait_log("metrics on")
        e = scrape(f"http://127.0.0.1:{eport}/metrics")
        for name in ("onceflow_claims_total", "onceflow_attempts_total", "onceflow_ops_total"):
            assert total(e, name) == total(s, name), name
        assert total(e, "onceflow_database_up") == 1
    finally:
        if exporter is not None:
            exporter.stop()
        worker.stop()


def _check_against_table(s: Samples, engine: Engine, claims: int, planned: int) -> None:
    def count(where: str) -> int:
        query = f"SELECT count(*) FROM workspace_process_requests WHERE {where}"  # noqa: S608
        return int(truth(engine, query))

    succeeded, dead = count("status = 'succeeded'"), count("status = 'dead'")
    rows = count("true")
    assert total(s, "onceflow_claims_total") == claims
    assert total(s, "onceflow_attempts_total", outcome="succeeded") == succeeded
    assert total(s, "onceflow_attempts_total", outcome="dead") == dead == 1
    retried = claims - succeeded - dead
    assert retried >= 2 + 1 + 1  # two flaky, the dead one's first run, the killed run
    assert total(s, "onceflow_attempts_total", outcome="retried") == retried
    assert total(s, "onceflow_leases_reclaimed_total") == 1  # the SIGKILLed run's lease
    # Durations: every run with a recorded end (the killed run's end is unknown).
    assert total(s, "onceflow_stage_duration_seconds_count") == claims - 1
    assert total(s, "onceflow_stage_duration_seconds_count", outcome="succeeded") == succeeded
    # The killed run's lapsed lease is taken back either by the sweeper (its next claim is
    # a plain pickup) or directly by a claim (a takeover: no pickup latency) — whichever
    # comes first, which load decides.
    assert total(s, "onceflow_pickup_latency_seconds_count") in (claims, claims - 1)
    # Enqueues: every row created once, the two duplicates collapsed.
    assert total(s, "onceflow_requests_enqueued_total", outcome="created") == rows == planned
    assert total(s, "onceflow_requests_enqueued_total", outcome="duplicate") == 2
    assert total(s, "onceflow_wakeups_sent_total", kind="first") == rows
    # No body runs now, in any process (the SIGKILLed child's gauge included).
    assert total(s, "onceflow_stages_in_progress") == 0
    # Live gauges from the partial indexes equal the table.
    for status, where in (
        ("queued", "status = 'queued' AND run_after <= now()"),
        ("scheduled", "status = 'queued' AND run_after > now()"),
        ("running", "status = 'running'"),
        ("dead", "status = 'dead'"),
    ):
        assert total(s, "onceflow_requests", status=status) == count(where), status
    assert total(s, "onceflow_requests", status="queued", worker_class="m-idle") == 3
    assert total(s, "onceflow_requests", status="scheduled", stage="m_idle") == 2
    assert total(s, "onceflow_requests", status="dead", stage="m_dead") == 1
    assert total(s, "onceflow_oldest_queued_age_seconds", worker_class="m-idle") > 0
    assert total(s, "onceflow_database_up") == 1
