"""A prefork child never inherits a lock held by the sweep watchdog's thread.

The watchdog runs in a prefork worker's main process, which forks replacement pool
children at any time. A child forked while another thread holds the Flow's queue lock or
``onceflow.db.engines._lock`` must still get its queue and engine (real fork, real Postgres).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from pydantic import BaseModel
from sqlalchemy import text

import onceflow.db.engines
from onceflow.demo.procs import wait_for
from onceflow.tasks import Flow
from onceflow.tasks.worker_process import _after_fork


class Empty(BaseModel):
    pass


def test_a_child_forked_while_a_thread_holds_the_locks_gets_its_queue(database_url: str) -> None:
    flow = Flow(name="fork-test")

    @flow.stage("fork_s", input=Empty, worker_class="fork-wc")
    def body(ctx: Any, data: Empty) -> dict[str, Any]:
        return {}

    held, release = threading.Event(), threading.Event()

    def watchdog_like() -> None:  # holds both locks, as a first-use build would
        with flow._queue_lock(), onceflow.db.engines._lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=watchdog_like)
    thread.start()
    assert held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: what a new pool process does first
        code = 1
        try:
            _after_fork()  # dispose_engines: takes onceflow.db.engines._lock
            with flow.queue.engine.connect() as conn:  # Flow.queue: takes Flow._lock
                code = 0 if conn.execute(text("SELECT 1")).scalar_one() == 1 else 1
        finally:
            os._exit(code)
    release.set()
    thread.join(timeout=60)

    def exited() -> int | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) + 1 if done else None  # +1: truthy for 0

    try:
        assert wait_for(exited, timeout=30, what="the forked child to build its queue") == 1
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
