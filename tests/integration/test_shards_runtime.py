"""Postgres split by workspace, the sync runtime around the router: waiting for
work on every shard's LISTEN, the standalone worker, the dashboard's tables and the
database metrics — each over 2 and 4 databases cloned from a migrated template (the
fixtures of ``test_shards``), and each with one shard's database closed to connections
(its server, shared, is untouched): the others go on.

Every wait is bounded by a deadline; only the order of events is asserted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import make_url

from onceflow import NewRequest, Queue
from onceflow.context import StageContext
from onceflow.db import fetch_all, get_engine, raw_connection
from onceflow.errors import DatabaseUnavailable
from onceflow.metrics.collector import DatabaseCollector
from onceflow.queue import Failure, sql
from onceflow.queue.overview import DEAD_LIMIT, RUNNING_LIMIT, read_tables
from onceflow.settings import get_settings
from onceflow.shards import ShardMap
from onceflow.worker import SERVICE_CONNECTIONS, Worker
from tests.acceptance.procs import wait_for
from tests.conftest import libpq
from tests.integration import test_shards
from tests.integration.test_shards import _admin, spread_workspaces
from tests.metrics.scrape import parse, total

# test_shards' fixtures: a migrated template database, and 2 or 4 shards cloned from it.
template = test_shards.template
shards = test_shards.shards

LONG = 30.0  # a wait that must end by a wake-up long before this


@contextlib.contextmanager
def closed(admin: str, url: str) -> Iterator[None]:
    """``url``'s database refuses connections, and its open ones are ended, meanwhile."""
    name = make_url(url).database
    _admin(libpq(admin), f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
    _admin(
        libpq(admin),
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'",  # noqa: S608
    )
    try:
        yield
    finally:
        _admin(libpq(admin), f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


#: How the waiter's NEXT_WORK statement begins (pg_stat_activity keeps only its first 1 KiB).
NEXT_WORK_START = sql.NEXT_WORK.sql.split("%(")[0]


def on_shard(shard_map: ShardMap, k: int, count: int, prefix: str = "ws") -> list[str]:
    """``count`` workspace ids that live on shard ``k``."""
    out, i = [], 0
    while len(out) < count:
        ws = f"{prefix}-{i}"
        if shard_map.shard_of(ws) == k:
            out.append(ws)
        i += 1
    return out


def statuses(url: str) -> Counter[str]:
    with raw_connection(get_engine(url)) as raw:
        rows = fetch_all(raw, "SELECT status FROM workspace_process_requests", {})
    return Counter(r["status"] for r in rows)


def _side(url: str) -> psycopg.Connection[Any]:
    """A connection outside the pools (a pooled one may be the one the waiter used)."""
    return psycopg.connect(libpq(url), autocommit=True)


def next_work_ran_since(url: str, since: Any) -> bool:
    """A waiter ran its 'when is the next work' query on ``url``'s database after ``since``."""
    with _side(url) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND starts_with(query, %s) AND state = 'idle' AND query_start >= %s"
            " AND pid <> pg_backend_pid())",
            (NEXT_WORK_START, since),
        ).fetchone()
    return bool(row and row[0])


def db_now(url: str) -> Any:
    with _side(url) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


class Waiting:
    """``queue.wait_for_work`` in a thread, started once its reads ran on ``ready_on``."""

    def __init__(self, queue: Queue, classes: str, ready_on: list[str]) -> None:
        since = [db_now(url) for url in ready_on]
        self.result: list[bool] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append(queue.wait_for_work(classes, LONG))
        )
        self.thread.start()
        for url, t in zip(ready_on, since, strict=True):
            wait_for(functools.partial(next_work_ran_since, url, t), what="the waiter to wait")

    def join(self) -> list[bool]:
        self.thread.join(LONG + 5)
        assert not self.thread.is_alive()
        return self.result


def listening(queue: Queue) -> list[bool]:
    """Whether each shard's listener of this process is LISTENing now."""
    current = queue._listener_pid
    assert current is not None
    return [listener.ready for listener in current[1].listeners]


# ------------------------------------------------------------------ wait_for_work


def test_wait_for_work_wakes_on_an_enqueue_into_any_shard(shards: list[str]) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    try:
        assert queue.wait_for_work("sw", 0.01) is False  # starts a listener per shard
        wait_for(lambda: all(listening(queue)), what="every shard's listener")
        assert len(listening(queue)) == len(shards)
        for k in range(len(shards)):
            waiting = Waiting(queue, "sw", shards)
            assert waiting.thread.is_alive()
            ws = on_shard(shard_map, k, 1)[0]
            queue.enqueue_many([NewRequest(ws, f"j{k}", "s", worker_class="sw")])
            assert waiting.join() == [True]
            (claim,) = queue.claim_next("sw", "w")
            assert claim.request.workspace_id == ws
    finally:
        queue.close()


def test_wait_for_work_wakes_for_the_open_shards_while_one_is_closed(
    shards: list[str], services: tuple[str, str]
) -> None:
    """Shard 0's database refuses connections: a waiter still wakes on the other shards'
    commits (its listener and NEXT_WORK there fail, nothing raises), and wakes when
    shard 0's listener is back (whatever committed meanwhile is claimable again)."""
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    open_urls = shards[1:]
    try:
        assert queue.wait_for_work("sc", 0.01) is False
        wait_for(lambda: all(listening(queue)), what="every shard's listener")
        with closed(services[0], shards[0]):
            wait_for(lambda: not listening(queue)[0], what="shard 0's listener to drop")
            for k in range(1, len(shards)):
                waiting = Waiting(queue, "sc", open_urls)
                assert waiting.thread.is_alive()  # neither raised nor gave up on shard 0
                ws = on_shard(shard_map, k, 1)[0]
                queue.enqueue_many([NewRequest(ws, f"j{k}", "s", worker_class="sc")])
                assert waiting.join() == [True]
                (claim,) = queue.claim_next("sc", "w")  # shard 0 skipped, not fatal
                assert claim.request.workspace_id == ws
            waiting = Waiting(queue, "sc", open_urls)
            assert waiting.thread.is_alive()
        # Open again: shard 0's listener comes back and wakes the waiter (not its timeout).
        assert waiting.join() == [True]
        wait_for(lambda: all(listening(queue)), what="shard 0's listener to reconnect")
        ws0 = on_shard(shard_map, 0, 1)[0]
        waiting = Waiting(queue, "sc", shards)
        queue.enqueue_many([NewRequest(ws0, "j0", "s", worker_class="sc")])
        assert waiting.join() == [True]
    finally:
        queue.close()


def test_claim_next_skips_a_closed_shard_and_raises_only_when_none_answers(
    shards: list[str], services: tuple[str, str]
) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    spaces = spread_workspaces(shard_map, 1)
    queue.enqueue_many([NewRequest(ws, "j", "s", worker_class="cn") for ws in spaces])
    with closed(services[0], shards[0]):
        got = queue.claim_next("cn", "w", 100)
        assert sorted(c.request.workspace_id for c in got) == sorted(
            ws for ws in spaces if shard_map.shard_of(ws) != 0
        )
    (last,) = queue.claim_next("cn", "w", 100)
    assert shard_map.shard_of(last.request.workspace_id) == 0
    one = Queue(shards[0])  # one database: its error, as always
    with closed(services[0], shards[0]), pytest.raises(DatabaseUnavailable):
        one.claim_next("cn", "w")
    with contextlib.ExitStack() as stack:
        for url in shards:
            stack.enter_context(closed(services[0], url))
        with pytest.raises(DatabaseUnavailable):
            queue.claim_next("cn", "w")


# ------------------------------------------------------------------ the standalone worker


@pytest.fixture()
def sharded_settings(shards: list[str]) -> Iterator[None]:
    """ONCEFLOW_DATABASE_URLS names the shards (what a worker built from settings uses)."""
    os.environ["ONCEFLOW_DATABASE_URLS"] = ",".join(shards)
    get_settings.cache_clear()
    try:
        yield
    finally:
        os.environ.pop("ONCEFLOW_DATABASE_URLS", None)
        get_settings.cache_clear()


def _recording() -> tuple[Counter[str], Any]:
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def body(ctx: StageContext) -> dict[str, Any]:
        with lock:
            seen[ctx.request.request_id] += 1
        return {"ws": ctx.request.workspace_id}

    return seen, body


def test_the_worker_drains_the_workspaces_of_every_shard(
    shards: list[str], sharded_settings: None
) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    spaces = spread_workspaces(shard_map, 3)
    items = [NewRequest(ws, f"j{i}", "s", worker_class="wk") for i, ws in enumerate(spaces)]
    ids = [r.request_id for r in queue.enqueue_many(items)]
    seen, body = _recording()
    worker = Worker(None, "wk", body, concurrency=3, prefetch=2)  # from the settings
    assert worker.queue.shard_map == shard_map and worker.shard_count == len(shards)
    pools = [shard.engine.pool.size() for shard in worker.queue.shards()]  # type: ignore[attr-defined]
    assert pools == [3 + SERVICE_CONNECTIONS] * len(shards)  # one pool per shard, sized
    with worker:
        wait_for(lambda: sum(seen.values()) >= len(ids), what="every request to run")
        # Enqueued while the worker waits: woken by any shard's NOTIFY.
        more = [NewRequest(ws, f"late{i}", "s", worker_class="wk") for i, ws in enumerate(spaces)]
        ids += [r.request_id for r in queue.enqueue_many(more)]
        wait_for(
            lambda: all(statuses(url)["succeeded"] == 2 * 3 for url in shards),
            what="every shard's requests to succeed",
        )
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}
    assert worker.stats.succeeded == len(ids)


def test_the_worker_keeps_draining_the_open_shards_while_one_is_closed(
    shards: list[str], services: tuple[str, str]
) -> None:
    settings = get_settings().model_copy(update={"sweep_interval_seconds": 0.3})
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(settings=settings, shard_map=shard_map)
    spaces = spread_workspaces(shard_map, 2)
    first = [NewRequest(ws, f"a{i}", "s", worker_class="wd") for i, ws in enumerate(spaces)]
    queue.enqueue_many(first)
    seen, body = _recording()
    per_shard = 2
    with (
        closed(services[0], shards[0]),
        Worker(queue, "wd", body, concurrency=2, lease_seconds=3) as worker,
    ):
        open_ = shards[1:]
        wait_for(
            lambda: all(statuses(url)["succeeded"] == per_shard for url in open_),
            what="the open shards' requests to succeed",
        )
        # More work for the open shards, while shard 0 stays closed: still drained.
        later = [
            NewRequest(ws, f"b{i}", "s", worker_class="wd")
            for i, ws in enumerate(spaces)
            if shard_map.shard_of(ws) != 0
        ]
        queue.enqueue_many(later)
        wait_for(
            lambda: all(statuses(url)["succeeded"] == 2 * per_shard for url in open_),
            what="the later requests of the open shards to succeed",
        )
        assert worker.stats.succeeded == 2 * per_shard * len(open_)
        # Open again: shard 0's listener comes back, its requests run.
        _admin(
            libpq(services[0]),
            f'ALTER DATABASE "{make_url(shards[0]).database}" ALLOW_CONNECTIONS true',
        )
        wait_for(
            lambda: statuses(shards[0])["succeeded"] == per_shard,
            what="the reopened shard's requests to succeed",
        )
    assert set(seen.values()) == {1} and len(seen) == len(spaces) + 2 * len(shards[1:])
    queue.close()


# ------------------------------------------------------------------ dashboard and metrics


def _populate(queue: Queue, shard_map: ShardMap) -> None:
    """On every shard: queued, running and dead rows, more running and dead than the
    dashboard's limits in total (so the merge must cut)."""
    per = RUNNING_LIMIT // len(shard_map) + 10
    spaces = spread_workspaces(shard_map, 1)
    items = [
        NewRequest(ws, f"r{i}", "s", worker_class="dr") for ws in spaces for i in range(per)
    ] + [NewRequest(ws, f"q{i}", "s", worker_class="dq") for ws in spaces for i in range(3)]
    items += [
        NewRequest(ws, f"d{i}", "s", worker_class="dd", max_attempts=1)
        for ws in spaces
        for i in range(DEAD_LIMIT // len(shard_map) + 5)
    ]
    queue.enqueue_many(items)
    held = []
    while claims := queue.claim_next("dr", "w", 500, lease_seconds=600):
        held += claims
    dead = []
    while claims := queue.claim_next("dd", "w", 500):
        dead += claims
    queue.fail_many([Failure(c, {"type": "E"}, retryable=False) for c in dead])


def _one_shard(url: str) -> dict[str, Any]:
    return read_tables(get_engine(url))


def test_the_dashboard_tables_merge_the_shards_and_survive_a_closed_one(
    shards: list[str], services: tuple[str, str]
) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    _populate(queue, shard_map)
    engines = [shard.engine for shard in queue.shards()]
    before = [_one_shard(url) for url in shards]
    merged = read_tables(engines)
    parts = [_one_shard(url) for url in shards]
    for wc in ("dr", "dq", "dd"):
        for status in ("queued", "scheduled", "running", "dead"):
            assert merged["depth"][wc]["s"][status] == sum(
                p["depth"].get(wc, {}).get("s", {}).get(status, 0) for p in parts
            )
    # The oldest age is the largest of the shards' (ages grow: read between two reads).
    ages = [[p["oldest_queued_age_seconds"]["dq"] for p in ps] for ps in (before, parts)]
    assert max(ages[0]) <= merged["oldest_queued_age_seconds"]["dq"] <= max(ages[1])
    union_running = sorted(
        (r for p in parts for r in p["running"]),
        key=lambda r: (r["lease_expires_at"], r["request_id"]),
    )
    assert len(union_running) > RUNNING_LIMIT
    assert len(merged["running"]) == RUNNING_LIMIT
    newest = sorted(union_running, key=lambda r: r["request_id"])
    newest = sorted(newest, key=lambda r: r["lease_expires_at"], reverse=True)
    assert [r["request_id"] for r in merged["running"]] == [
        r["request_id"] for r in newest[:RUNNING_LIMIT]
    ]
    assert len(merged["dead"]) == DEAD_LIMIT
    finished = [r["finished_at"] for r in merged["dead"]]
    assert finished == sorted(finished, reverse=True)
    union_dead = sorted((r["finished_at"] for p in parts for r in p["dead"]), reverse=True)
    assert finished == union_dead[:DEAD_LIMIT]
    assert merged["shards_unavailable"] == [] and merged["depth_lower_bound"] == []
    with closed(services[0], shards[0]):
        partial = read_tables(engines)
        assert partial["shards_unavailable"] == [0]
        assert partial["depth"]["dq"]["s"]["queued"] == sum(
            p["depth"]["dq"]["s"]["queued"] for p in parts[1:]
        )
        every = contextlib.ExitStack()
        with every:
            for url in shards[1:]:
                every.enter_context(closed(services[0], url))
            with pytest.raises(DatabaseUnavailable):
                read_tables(engines)


def test_the_database_collector_sums_the_shards_and_marks_a_closed_one(
    shards: list[str], services: tuple[str, str]
) -> None:
    shard_map = ShardMap.from_urls(shards)
    queue = Queue(shard_map=shard_map)
    _populate(queue, shard_map)
    reg = CollectorRegistry()
    reg.register(DatabaseCollector(shards))

    def scrape() -> Any:
        return parse(generate_latest(reg).decode())

    def one(url: str) -> Any:
        single = CollectorRegistry()
        single.register(DatabaseCollector(url))
        return parse(generate_latest(single).decode())

    samples = scrape()
    parts = [one(url) for url in shards]
    for k in range(len(shards)):
        assert total(samples, "onceflow_database_up", shard=str(k)) == 1
        assert total(parts[k], "onceflow_database_up") == 1
    for wc, status in (("dr", "running"), ("dq", "queued"), ("dd", "dead")):
        want = sum(total(p, "onceflow_requests", worker_class=wc, status=status) for p in parts)
        assert want > 0
        assert total(samples, "onceflow_requests", worker_class=wc, status=status) == want
    with closed(services[0], shards[0]):
        samples = scrape()
        assert total(samples, "onceflow_database_up", shard="0") == 0
        for k in range(1, len(shards)):
            assert total(samples, "onceflow_database_up", shard=str(k)) == 1
        want = sum(
            total(p, "onceflow_requests", worker_class="dq", status="queued") for p in parts[1:]
        )
        assert total(samples, "onceflow_requests", worker_class="dq", status="queued") == want
    samples = scrape()  # open again: every shard answers again
    assert all(
        total(samples, "onceflow_database_up", shard=str(k)) == 1 for k in range(len(shards))
    )
