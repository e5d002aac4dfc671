"""A thread that holds its connection (``onceflow.db.holding_connections``).

Inside the block a thread's statements run on one pooled connection per engine instead of
a checkout and a check-in each; it goes back to the pool at the end. What must still hold:
a nested call gets a connection of its own, a dead or dirty or stale held connection is
replaced (never reused), a forked child never touches its parent's, and the Queue's
claims and completions behave as on pool checkouts. Real Postgres; faults are real
killed backends.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from onceflow import db
from onceflow.db import fetch_one, holding_connections, make_engine, raw_connection
from onceflow.errors import ConnectionLost
from onceflow.queue import Queue
from onceflow.settings import get_settings
from tests.integration.test_db_blips import kill_backends, own_engine

APP = "onceflow-held-test"


@pytest.fixture()
def own(clean_db: Engine) -> Any:
    """An engine of the test database of its own (pool of 2, its backends named APP)."""
    eng = own_engine(clean_db, APP, pool_size=2)
    yield eng
    eng.dispose()


@pytest.fixture()
def admin_url(services: tuple[str, str]) -> str:
    return services[0]


def backend(engine: Engine) -> int:
    with raw_connection(engine) as raw:
        return int(fetch_one(raw, "SELECT pg_backend_pid() AS pid", {})["pid"])


def checked_out(engine: Engine) -> int:
    return int(engine.pool.checkedout())  # type: ignore[attr-defined]


def test_a_holding_thread_runs_every_statement_on_one_connection_and_gives_it_back(
    own: Engine,
) -> None:
    assert backend(own) >= 0 and checked_out(own) == 0  # no hold: back after each call
    with holding_connections():
        first = backend(own)
        assert checked_out(own) == 1  # held between calls
        assert {backend(own) for _ in range(5)} == {first}
        with holding_connections():  # nests: the inner end gives nothing back
            assert backend(own) == first
        assert checked_out(own) == 1
        assert db.holding()
    assert checked_out(own) == 0
    assert not db.holding()


def test_a_queue_claims_and_completes_on_the_held_connection(own: Engine) -> None:
    queue = Queue(own, get_settings())
    with holding_connections():
        pid = backend(own)
        for i in range(3):
            queue.enqueue("s", "w", f"j{i}", input={"i": i})
        claims = queue.claim_next("default", "held-worker", 3)
        assert len(claims) == 3
        for claim in claims:
            done = queue.complete(claim, {"ok": claim.request.input["i"]})
            assert done.status.value == "succeeded"
            assert done.result == {"ok": claim.request.input["i"]}
            assert done.input == claim.request.input
        assert checked_out(own) == 1 and backend(own) == pid
        # A transaction on the held connection commits, and leaves it idle for the next.
        with raw_connection(own) as raw, raw.transaction():
            raw.execute("SELECT 1")
        assert backend(own) == pid
    assert [r.status.value for r in queue.list(workspace_id="w")] == ["succeeded"] * 3


def test_a_nested_call_gets_a_connection_of_its_own(own: Engine) -> None:
    with holding_connections():
        outer = backend(own)
        with raw_connection(own) as raw, raw.transaction():
            raw.execute("CREATE TEMP TABLE held_t (x int) ON COMMIT DROP")
            inner = backend(own)  # not the held one: it is inside a transaction
            assert inner != outer
        assert backend(own) == outer


def test_a_held_connection_left_in_a_transaction_is_replaced_not_reused(
    own: Engine,
) -> None:
    with holding_connections():
        with raw_connection(own) as raw:
            first = int(raw.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            raw.execute("BEGIN")  # a caller that forgot its transaction
            raw.execute("CREATE TEMP TABLE left_open (x int)")
        second = backend(own)
        assert second != first
        with raw_connection(own) as raw:
            assert raw.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            # The forgotten transaction was rolled back with its connection.
            assert raw.execute("SELECT to_regclass('pg_temp.left_open')").fetchone() == (None,)
        # So is one a caller turned autocommit off on (its next statement would open one).
        with raw_connection(own) as raw:
            raw.autocommit = False
        assert backend(own) not in (first, second)
    assert checked_out(own) == 0


def test_a_dead_held_connection_raises_connection_lost_once_then_is_replaced(
    own: Engine, admin_url: str
) -> None:
    with holding_connections():
        first = backend(own)
        assert kill_backends(admin_url, "pid = %s", first) == 1
        with pytest.raises(ConnectionLost):
            backend(own)
        second = backend(own)
        assert second != first
        # A Queue call on it (a read, retried once after a lost connection) works too.
        assert kill_backends(admin_url, "pid = %s", second) == 1
        assert Queue(own, get_settings()).list(workspace_id="nobody") == []
        assert backend(own) not in (first, second)
    assert checked_out(own) == 0


def test_a_pool_invalidated_elsewhere_replaces_the_held_connection(own: Engine) -> None:
    with holding_connections():
        first = backend(own)
        db.invalidate_pool(own)  # what another thread does after a server restart
        assert backend(own) != first


def test_threads_hold_their_own_connections(own: Engine) -> None:
    seen: dict[str, set[int]] = {}
    ready = threading.Barrier(2, timeout=30)

    def hold(name: str) -> None:
        with holding_connections():
            pids = {backend(own)}
            ready.wait()  # both hold one now
            pids |= {backend(own) for _ in range(5)}
            seen[name] = pids

    threads = [threading.Thread(target=hold, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(seen["a"]) == 1 and len(seen["b"]) == 1
    assert seen["a"] != seen["b"]
    assert checked_out(own) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_child_forked_while_holding_never_touches_the_parents_connection(
    own: Engine,
) -> None:
    with holding_connections():
        parent = backend(own)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own own, as a prefork child builds after the fork
            code = 1
            try:
                own.dispose(close=False)  # what dispose_engines does in a child
                child = backend(own)
                os.write(write, f"{child}\n".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as r:
            child = int(r.read().strip())
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert child != parent
        # The parent's held session is intact: same backend, idle, usable.
        assert backend(own) == parent


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_fork_leaves_another_threads_open_transaction_alone(own: Engine) -> None:
    """Were the other thread's held connection collected in the child, the pool's reset
    would send ROLLBACK on the parent's socket. CPython 3.11 keeps the other threads'
    state alive in the child (so this passed without the fork snapshot too); the snapshot
    (``onceflow.db.forks``) keeps it so on an interpreter that frees it."""
    in_tx, go_on = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def holder() -> None:
        try:
            with holding_connections(), raw_connection(own) as raw, raw.transaction():
                raw.execute("CREATE TEMP TABLE fork_tx (x int) ON COMMIT DROP")
                raw.execute("INSERT INTO fork_tx VALUES (1)")
                in_tx.set()
                assert go_on.wait(60)
                raw.execute("INSERT INTO fork_tx VALUES (2)")
                outcome["rows"] = raw.execute("SELECT count(*) FROM fork_tx").fetchone()
        except BaseException as exc:  # reported to the test below
            outcome["error"] = exc

    thread = threading.Thread(target=holder)
    thread.start()
    assert in_tx.wait(60)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import gc

            gc.collect()
            own.dispose(close=False)
            with holding_connections():
                backend(own)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    go_on.set()
    thread.join(60)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "error" not in outcome, outcome.get("error")
    assert outcome["rows"] == (2,)


def test_released_from_inside_a_call_the_connection_goes_back_when_the_call_ends(
    own: Engine,
) -> None:
    db.hold_connections()
    with raw_connection(own) as raw:
        db.release_connections()
        assert raw.execute("SELECT 1").fetchone() == (1,)  # still this call's
        assert checked_out(own) == 1
    assert checked_out(own) == 0 and not db.holding()


def test_a_statement_interrupted_by_a_signal_does_not_keep_its_connection(
    own: Engine,
) -> None:
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with holding_connections():
            first = backend(own)
            with pytest.raises(Interrupted), raw_connection(own) as raw:
                signal.setitimer(signal.ITIMER_REAL, 0.2)
                raw.execute("SELECT pg_sleep(30)")
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert checked_out(own) == 0  # the interrupted one is gone, not held
            assert backend(own) != first
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_disposed_engines_held_connection_is_closed_and_replaced(
    own: Engine, admin_url: str
) -> None:
    with holding_connections():
        first = backend(own)
        own.dispose()
        second = backend(own)
        assert second != first
        with psycopg.connect(admin_url.replace("+psycopg", ""), autocommit=True) as admin:
            assert not _still_there(admin, first)  # closed, not left open in the old pool


def test_a_held_connection_older_than_pool_recycle_is_replaced(clean_db: Engine) -> None:
    """The pool recycles a connection older than ``pool_recycle`` at its checkout; a held
    one (never checked out again) is replaced as it would be, its age read from the time
    the pool opened it. ``pool_recycle=0``: every connection is too old at its next call."""
    url = clean_db.url.render_as_string(hide_password=False)
    args = {"application_name": APP, "connect_timeout": 10}
    eng = make_engine(url, pool_size=2, pool_recycle=0, connect_args=args)
    try:
        with holding_connections():
            first = backend(eng)
            assert backend(eng) != first
            assert checked_out(eng) == 1  # the old one went back; the new one is held
    finally:
        eng.dispose()


def _still_there(admin: psycopg.Connection[Any], pid: int) -> bool:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        if row.fetchone() == (0,):
            return False
        time.sleep(0.05)
    return True


def test_a_thread_holds_at_most_a_few_engines(clean_db: Engine) -> None:
    engines = [own_engine(clean_db, APP, pool_size=1) for _ in range(db.MAX_HELD_ENGINES + 1)]
    try:
        with holding_connections():
            for e in engines:
                backend(e)
            assert checked_out(engines[0]) == 0  # the least recently used went back
            assert [checked_out(e) for e in engines[1:]] == [1] * db.MAX_HELD_ENGINES
    finally:
        for e in engines:
            e.dispose()


def test_a_thread_that_ends_while_holding_returns_a_clean_connection(own: Engine) -> None:
    def forgetful() -> None:
        db.hold_connections()
        backend(own)  # and never release_connections()

    thread = threading.Thread(target=forgetful)
    thread.start()
    thread.join(60)
    import gc

    gc.collect()
    assert checked_out(own) == 0
    fairy = own.raw_connection()
    try:
        raw = fairy.driver_connection
        assert raw is not None and raw.autocommit is False  # what the pool's users expect
    finally:
        fairy.close()
