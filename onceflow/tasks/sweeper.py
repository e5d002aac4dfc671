"""Keeping a Flow's sweeper alive and its re-sends in check, on the Celery side.

- :func:`sweep_name`: the Flow's row in ``onceflow_sweeps`` (its name and stages).
- :func:`broker_backlog`: messages waiting in the broker per worker class, so the
  sweeper re-sends only wake-ups that cannot be waiting there (a backlog is not a loss).
- :func:`install_watchdog`: a worker bootstep. Every ``onceflow worker`` runs, in its
  main process, a thread that sweeps when no sweep began for 1.5 sweep intervals by the
  database clock — beat stopped, or beat's sweep task stuck behind busy pool processes.
  With beat's sweeps on time the compare-and-set never lets a watchdog win.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from celery import Celery, bootsteps

from onceflow.errors import InvalidRequest
from onceflow.keys import queue_name
from onceflow.models.requests import SweepResult
from onceflow.queue import Queue
from onceflow.settings import Settings
from onceflow.tasks.identity import worker_id

log = logging.getLogger("onceflow.sweeper")

#: A watchdog steps in when no sweep began for this many sweep intervals.
WATCHDOG_GAP_INTERVALS = 1.5
#: Beat's sweep task is a no-op if a sweep began less than this many intervals ago.
BEAT_GAP_INTERVALS = 0.5


def sweep_name(name: str, stages: Sequence[str]) -> str:
    """The key of a Flow's sweep row: its name and a digest of the stages it declares.

    Two Flows on one database sweep different stages, so each keeps its own row: one
    Flow's beat must never make another Flow's sweeps (or watchdogs) stand down.
    """
    digest = hashlib.sha256("\n".join(sorted(stages)).encode("utf-8")).hexdigest()[:16]
    return f"{name[:100]}:{digest}"


def broker_backlog(
    app: Celery, queues: Mapping[str, Sequence[str]] | Sequence[str]
) -> dict[str, int] | None:
    """Messages ready in the broker for each worker class; None if it cannot be asked.

    ``queues``: each class's broker queues (``onceflow.wc.<class>``, and where the app's
    ``task_routes`` sends its stages' wake-ups: :meth:`Flow.broker_backlog`), summed; or
    just the classes (their ``onceflow.wc.<class>`` queue each). A passive
    ``queue_declare`` (Redis and AMQP alike); a queue that does not exist holds nothing.
    Each queue gets its own channel: AMQP closes a channel on a miss.

    On RabbitMQ a missing queue is declared again, as the app declares it: a process that
    declared it once publishes to it without declaring it again (kombu remembers it per
    connection), so after the queue was deleted every wake-up it sends — the sweeper's
    re-sends included — would be dropped by the broker until a worker declares it.
    """
    if not isinstance(queues, Mapping):
        queues = {wc: _own_queue(wc) for wc in queues}
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2)
            counted: dict[str, int] = {}
            out: dict[str, int] = {}
            for wc, names in queues.items():
                total = 0
                for name in names:
                    if name not in counted:
                        counted[name] = _ready(app, conn, name)
                    total += counted[name]
                out[wc] = total
            return out
    except Exception as exc:  # kombu / redis / amqp errors: fall back to the backoff alone
        log.warning("sweep: broker queue lengths unavailable (%s); backoff alone applies", exc)
        return None


def _own_queue(worker_class: str) -> list[str]:
    try:
        return [queue_name(worker_class)]
    except InvalidRequest:  # a row from before worker classes were checked
        return []  # no queue of onceflow's can hold its wake-ups


def _ready(app: Celery, conn: Any, name: str) -> int:
    channel: Any = conn.channel()
    try:
        return int(channel.queue_declare(queue=name, passive=True).message_count)
    except conn.channel_errors:
        if conn.transport.driver_type == "amqp":
            _declare(app, conn, name)
        return 0  # no such queue: nothing waits in it
    finally:
        with contextlib.suppress(Exception):
            channel.close()


def _declare(app: Celery, conn: Any, name: str) -> None:
    """Declare queue ``name`` as ``app`` would (its ``task_queues`` entry, else the queue
    Celery creates for a missing one: type, exchange and binding alike)."""
    channel: Any = conn.channel()
    try:
        app.amqp.queues[name](channel).declare()
        log.warning("sweep: broker queue %s did not exist; declared it again", name)
    except Exception as exc:  # e.g. a queue your task_routes name but Celery cannot make
        log.warning("sweep: could not declare missing broker queue %s: %s", name, exc)
    finally:
        with contextlib.suppress(Exception):
            channel.close()


class SweptFlow(Protocol):
    """What the watchdog needs of the Flow it keeps swept (:class:`~onceflow.tasks.Flow`)."""

    @property
    def app(self) -> Celery:
        """The Flow's Celery app (its workers run the watchdog)."""
        ...

    @property
    def settings(self) -> Settings:
        """The Flow's settings."""
        ...

    @property
    def queue(self) -> Queue:
        """This process's queue."""
        ...

    @property
    def sweep_name(self) -> str:
        """The Flow's row in ``onceflow_sweeps``."""
        ...

    def run_sweep(self) -> SweepResult:
        """One sweep, not recorded."""
        ...


class SweepWatchdog(bootsteps.StartStopStep):
    """A worker bootstep: the thread that sweeps when nobody else did (beat is down).

    It runs in the worker's main process (not in a pool child), so a pool busy with
    long stages does not stop it. Every half interval it asks the database-clock
    compare-and-set with a gap of 1.5 intervals; the one process that wins sweeps.
    """

    label = "onceflow sweep watchdog"
    # After the pool forked its children: they start without this thread's sockets.
    requires = ("celery.worker.components:Pool",)
    flow: SweptFlow  # set on the subclass install_watchdog makes

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def include_if(self, parent: Any) -> bool:
        """Only when enabled (``ONCEFLOW_SWEEP_WATCHDOG``, on by default)."""
        return bool(self.flow.settings.sweep_watchdog)

    def start(self, parent: Any) -> None:
        """Build the Flow's queue (and its engine) here, then start the watchdog thread.

        The pool forks replacement children from this process at any time (a child
        killed by a time limit, ``max_tasks_per_child``). Were the thread to build them
        on first use, it could hold the Flow's queue lock or the engine cache's lock at
        the instant of a fork, and the child — which takes both in its
        ``worker_process_init`` hook and ``Flow.queue`` — would wait forever. Built now,
        before the thread exists, the thread only ever reads them. (A forked child also
        gets fresh locks: see :mod:`onceflow.db.forks` and ``Flow._queue_lock``.)
        """
        _ = [shard.engine for shard in self.flow.queue.shards()]
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="onceflow-sweep-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self, parent: Any) -> None:
        """Stop the thread (a sweep in progress finishes first, briefly waited for)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def terminate(self, parent: Any) -> None:
        """As :meth:`stop`."""
        self.stop(parent)

    def _run(self) -> None:
        interval = self.flow.settings.sweep_interval_seconds
        gap = WATCHDOG_GAP_INTERVALS * interval
        wait = 0.0
        while not self._stop.wait(wait):
            wait = interval / 2
            try:
                turn = self.flow.queue.begin_sweep(
                    self.flow.sweep_name, f"watchdog@{worker_id()}", min_gap=gap
                )
                if turn.won:
                    result = self.flow.run_sweep()
                    log.info(
                        "watchdog sweep (no sweep for %.1fs): %d rescued, %d wake-ups",
                        gap,
                        len(result.rescued),
                        len(result.to_dispatch),
                    )
                else:
                    # Wake when the gap could lapse (a database-clock duration), at the latest
                    # after half an interval.
                    wait = min(interval / 2, max(turn.next_in, 0.01))
            except Exception as exc:  # a database or broker outage: try again later
                log.warning("sweep watchdog: %s: %s", type(exc).__name__, exc)


def install_watchdog(flow: SweptFlow) -> None:
    """Add the watchdog bootstep for ``flow`` to its Celery app's workers."""
    step = type("SweepWatchdog", (SweepWatchdog,), {"flow": flow, "__module__": __name__})
    flow.app.steps["worker"].add(step)


__all__ = ["SweepWatchdog", "broker_backlog", "install_watchdog", "sweep_name"]
