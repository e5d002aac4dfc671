"""What a fork does to onceflow's database state, registered once for the process.

A forked child (Celery's prefork pool, a worker's child) has only the forking thread and
a copy of the parent's memory: the parent's sockets, its pool, its threads' held
connections. The child must use none of them — returning or closing one would roll back
or close the parent's session — and must not wait on a lock another thread held at the
fork. Engines are cached per (url, pid), so the child builds its own at its first call.
"""

from __future__ import annotations

import os

from onceflow.db import engines, held


def _after_fork_in_child() -> None:
    engines.renew_lock_after_fork()
    held.after_fork_in_child()


os.register_at_fork(
    before=held.before_fork,
    after_in_parent=held.after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
