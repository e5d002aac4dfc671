"""What a Celery worker of a Flow does around its processes (Celery signals and fork hooks).

- The database pool sized to the worker's concurrency when its tasks share one process.
- Copy-on-write friendly pool children: the collector's view frozen for each fork only.
- A prefork child's database: the parent's engines forgotten, its own connection held
  for its life, given back as it exits.
- Tracing: the SDK set up from ``OTEL_*`` as the worker starts (before the pool forks:
  the SDK starts its export thread again in each child), and each child's buffered spans
  exported before it exits (a prefork child ends without ``atexit``).

Connected when :mod:`onceflow.tasks.flow` is imported (a Flow's module imports this one).
"""

from __future__ import annotations

import gc
import os
from typing import Any

from celery.signals import (
    worker_before_create_process,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
)

from onceflow import tracing
from onceflow.db import dispose_engines, hold_connections, release_connections, size_pools_for
from onceflow.tasks.broker import hardened


@worker_init.connect
def _size_pools(sender: Any = None, **_: Any) -> None:
    """Size the database pool to the worker's concurrency when tasks share one process."""
    pool_cls = getattr(sender, "pool_cls", None)
    name = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    if any(kind in str(name) for kind in ("thread", "gevent", "eventlet")):
        size_pools_for(int(getattr(sender, "concurrency", 1) or 1))


# Copy-on-write friendly pool children (gc.freeze, as Instagram, Sentry's and Airflow's Celery
# workers do): a prefork child shares its parent's memory pages until it writes to them, and
# the cyclic garbage collector writes to every object it scans. The first full collections in
# each child cost it tens of milliseconds of CPU each and copied much of the parent's memory
# into it (docs/benchmarks.md, "Celery stage runtime"). The parent freezes what it holds just before
# each fork (the child keeps it frozen: never scanned, so never copied for the collector) and
# unfreezes it right after (the parent collects as before).
_freeze_forks = False
_frozen_for_fork = False


@worker_init.connect
def _freeze_before_forks(sender: Any = None, **_: Any) -> None:
    """Only for the workers of a Flow's app (a Flow hardens its app)."""
    global _freeze_forks
    _freeze_forks = hardened(getattr(sender, "app", None))


@worker_before_create_process.connect
def _freeze_for_fork(sender: Any = None, **_: Any) -> None:
    """Freeze for this fork (``sender``: the pool). Only when its children are forked: a
    spawned child is a new interpreter, and the unfreeze is an at-fork hook, which a spawn
    never runs (the parent would stay frozen). Not in a process whose own code froze
    objects (it manages its collector: the unfreeze would undo what it froze).

    Not collected first: Python's documentation advises against a collection before a fork
    (the memory it frees is reused by the child, in pages it then copies); with
    ``gc.collect()`` before the freeze each child keeps more private memory and pays its full
    collections again (``bench/stage_parts.py`` measures it). The collection Celery's pool
    makes right after this signal then finds nothing to scan; a
    cycle of garbage alive at the fork stays in the child, frozen: a bounded amount, once per
    child. If the pool fails between this signal and the fork (no file descriptor left for
    its pipes), the parent stays frozen until it forks its next child.
    """
    global _frozen_for_fork
    if not _freeze_forks or _frozen_for_fork or gc.get_freeze_count():
        return
    context = getattr(sender, "_ctx", None)  # billiard's: fork, spawn or forkserver
    if context is None or context.get_start_method() != "fork":
        return
    gc.freeze()
    _frozen_for_fork = True


def _unfreeze_after_fork() -> None:
    global _frozen_for_fork
    if _frozen_for_fork:
        _frozen_for_fork = False
        gc.unfreeze()


def _child_keeps_frozen() -> None:
    global _frozen_for_fork
    _frozen_for_fork = False


os.register_at_fork(after_in_parent=_unfreeze_after_fork, after_in_child=_child_keeps_frozen)


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    """A prefork child must not reuse its parent's database sockets. It runs one stage at
    a time on its main thread, statement after statement: it holds its connection
    (``onceflow.db.holding_connections``) instead of a pool checkout per statement."""
    dispose_engines()
    hold_connections()


@worker_process_shutdown.connect
def _child_exits(**_: Any) -> None:
    """The child's held connections back to its pool (closed with it as it exits), and its
    buffered spans exported: the child ends without running ``atexit``."""
    release_connections()
    tracing.flush()
