"""A Flow's prefork worker freezes the collector's view of its objects for each fork only.

The child keeps its parent's objects out of its collections (copy-on-write pages stay
shared); the parent unfreezes them right after the fork and collects them as before.
Real ``os.fork`` and Celery's own signal; the worker's start is a real one in
``tests/acceptance/test_runtime.py`` (the stage reports its ``gc.get_freeze_count()``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from types import SimpleNamespace

import billiard
import pytest
from celery import Celery
from celery.signals import worker_before_create_process

from onceflow.tasks import Flow, worker_process


class Pool:
    """What the signal's sender (billiard's pool) holds: its start method's context."""

    def __init__(self, method: str) -> None:
        self._ctx = billiard.get_context(method)


FORKING_POOL = Pool("fork")


def _fork_and_report() -> int:
    """Fork; the child reports its freeze count. Returns it (the parent's own is unchanged)."""
    worker_before_create_process.send(sender=FORKING_POOL)  # what billiard's pool sends first
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, str(gc.get_freeze_count()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        count = int(pipe.read())
    os.waitpid(pid, 0)
    return count


@pytest.fixture()
def unfrozen() -> Iterator[None]:
    assert gc.get_freeze_count() == 0
    yield
    worker_process._freeze_forks = False
    gc.unfreeze()


def test_a_flow_workers_children_start_with_the_parents_objects_frozen(unfrozen: None) -> None:
    worker_process._freeze_before_forks(sender=SimpleNamespace(app=Flow().app))
    assert _fork_and_report() > 10_000  # the modules, classes, functions … of this process
    assert gc.get_freeze_count() == 0  # the parent collects as before
    assert _fork_and_report() > 10_000  # and again for a replacement child


def test_another_apps_worker_is_left_as_celery_runs_it(unfrozen: None) -> None:
    worker_process._freeze_before_forks(sender=SimpleNamespace(app=Celery("not-a-flow")))
    assert _fork_and_report() == 0
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_own_objects_keeps_them_frozen(unfrozen: None) -> None:
    """Its code manages the collector (e.g. froze after warming up): the worker leaves that."""
    worker_process._freeze_before_forks(sender=SimpleNamespace(app=Flow().app))
    gc.freeze()
    frozen = gc.get_freeze_count()
    # (a frozen object freed since counts no more: hence the margin)
    assert _fork_and_report() > frozen - 1_000  # the child inherits what the process froze
    assert gc.get_freeze_count() > frozen - 1_000  # and the parent still has it frozen


def test_a_pool_that_spawns_its_children_is_not_frozen_for(unfrozen: None) -> None:
    """A spawned child is a new interpreter, and a spawn runs no at-fork hook: a freeze
    would never be undone in the parent."""
    worker_process._freeze_before_forks(sender=SimpleNamespace(app=Flow().app))
    for method in ("spawn", "forkserver"):
        worker_before_create_process.send(sender=Pool(method))
        assert gc.get_freeze_count() == 0
        assert not worker_process._frozen_for_fork


def test_the_freeze_does_not_collect_first(unfrozen: None) -> None:
    """A collection before the fork frees memory the child then reuses in shared pages, which
    it copies (measured: 15 MB more private memory per child): garbage is frozen, not freed."""
    import weakref

    class Node:
        cycle: Node

    worker_process._freeze_before_forks(sender=SimpleNamespace(app=Flow().app))
    gc.disable()  # no automatic collection between here and the check
    try:
        node = Node()
        node.cycle = node
        ref = weakref.ref(node)
        del node  # garbage now, freed only by a collection
        worker_before_create_process.send(sender=FORKING_POOL)
        assert gc.get_freeze_count() > 0
        assert ref() is not None
    finally:
        worker_process._unfreeze_after_fork()  # no fork happened: undo as the parent would
        gc.enable()
