"""The layer-1 store: named domain operations on ``workspace_process_requests``.

A small typed seam (River's driver interface, PgQueuer's repository port): each
operation takes typed parameters and returns rows as :class:`Request` /
:class:`Claim` values. The SQL lives in :mod:`onceflow.queue.sql`.

:class:`Queue` is built here from one mixin per thing it owns: enqueue
(``queue/enqueue.py``), claims and fenced writes (``queue/claims.py``), operator actions
(``queue/operators.py``), reads (``queue/reads.py``), the sweeper (``queue/sweep.py``),
batches (``queue/batch.py``) and waiting for work (``queue/notify.py``).
"""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from onceflow.db import get_engine
from onceflow.payloads import canonical_json
from onceflow.queue.batch import BatchOps
from onceflow.queue.claims import ClaimOps
from onceflow.queue.enqueue import BATCH_MAX, EnqueueOps, Resolver
from onceflow.queue.notify import Waiter
from onceflow.queue.operators import OperatorOps
from onceflow.queue.reads import LIST_LIMIT_MAX, ReadOps
from onceflow.queue.sweep import Sweeper
from onceflow.settings import Settings, get_settings

log = logging.getLogger("onceflow.queue")


class Queue(EnqueueOps, ClaimOps, OperatorOps, ReadOps, Sweeper, BatchOps, Waiter):
    """The durable stage queue. Thread-safe; build one per process and share it.

    ``resolver`` (set by the :class:`~onceflow.tasks.Flow` that owns the queue)
    completes every request enqueued through it — including hand-offs — from its
    stage's declaration: worker class, dedupe, priority, attempts, validated input.
    An undeclared stage or an input that does not fit raises before anything is
    written. Without one, unset fields mean worker class ``"default"``, dedupe, priority 0.
    """

    def __init__(
        self,
        engine: Engine | str | None = None,
        settings: Settings | None = None,
        *,
        resolver: Resolver | None = None,
    ):
        self.settings = settings or get_settings()
        if engine is None or isinstance(engine, str):
            engine = get_engine(engine or self.settings.database_url)
        self.engine = engine
        self.resolver = resolver

    # enqueue, enqueue_many, enqueue_many_with, resolve: see queue/enqueue.py.
    # claim, claim_next, heartbeat, complete, hand_off, fail, fenced_retry: queue/claims.py.
    # cancel, requeue, mark_undispatched: queue/operators.py.
    # get, live_claim, list, counts: queue/reads.py.
    # rescue_expired, due_for_dispatch, prune, sweep_once, begin_sweep: see queue/sweep.py.
    # complete_many, fail_many, heartbeat_many, release, depth: see queue/batch.py.


__all__ = ["BATCH_MAX", "LIST_LIMIT_MAX", "Queue", "Resolver", "canonical_json"]
