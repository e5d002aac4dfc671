"""The layer-1 store: named domain operations on ``workspace_process_requests``.

A small typed seam (River's driver interface, PgQueuer's repository port): each
operation takes typed parameters and returns rows as :class:`Request` /
:class:`Claim` values. The SQL lives in :mod:`onceflow.queue.sql`, by name; each
operation is written once as steps (:mod:`onceflow.connector`) and served by
:class:`Queue` (sync, on the process's pooled connections) and :class:`AsyncQueue`
(asyncio, on a psycopg async pool) alike.

:class:`Queue` is built here from one mixin per thing it owns: enqueue
(``queue/enqueue.py``), claims and fenced writes (``queue/claims.py``), operator actions
(``queue/operators.py``), reads (``queue/reads.py``), the sweeper (``queue/sweep.py``),
batches (``queue/batch.py``), waiting for work (``queue/notify.py``) and waiting for a
request to end (``queue/done.py``).
"""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from onceflow.connector import AsyncConnector, AsyncSide, Connector, SyncSide
from onceflow.connector.placement import close_pools, place, place_async
from onceflow.connector.sharded import UnroutedStatement
from onceflow.payloads import canonical_json
from onceflow.queue.batch import BatchOps
from onceflow.queue.claims import ClaimOps
from onceflow.queue.done import AsyncDoneWaiter, DoneWaiter
from onceflow.queue.enqueue import BATCH_MAX, EnqueueOps, Resolver
from onceflow.queue.notify import AsyncWaiter, Waiter
from onceflow.queue.operators import OperatorOps
from onceflow.queue.reads import LIST_LIMIT_MAX, ReadOps
from onceflow.queue.sweep import Sweeper
from onceflow.settings import Settings, get_settings
from onceflow.shards import ShardMap

log = logging.getLogger("onceflow.queue")


class Queue(
    SyncSide,
    EnqueueOps,
    ClaimOps,
    OperatorOps,
    ReadOps,
    Sweeper,
    BatchOps,
    Waiter,
    DoneWaiter,
):
    """The durable stage queue. Thread-safe; build one per process and share it.

    ``resolver`` (set by the :class:`~onceflow.tasks.Flow` that owns the queue)
    completes every request enqueued through it — including hand-offs — from its
    stage's declaration: worker class, dedupe, priority, attempts, validated input.
    An undeclared stage or an input that does not fit raises before anything is
    written. Without one, unset fields mean worker class ``"default"``, dedupe, priority 0.
    """

    # Same arguments as AsyncQueue's on purpose: public constructors; placing is one function each.
    def __init__(
        self,
        engine: Engine | str | None = None,
        settings: Settings | None = None,
        *,
        resolver: Resolver | None = None,
        shard_map: ShardMap | None = None,
        pool_size: int | None = None,
    ):
        # pool_size: engines of this queue's own with that pool (one per shard) instead of
        # the process's shared ones (get_engine): what the standalone worker sizes.
        self.settings = settings or get_settings()
        self.resolver = resolver
        self._shards: list[Queue] | None = None
        placed = place(engine, self.settings, shard_map, pool_size=pool_size)
        self.connector: Connector = placed.connector
        self.shard_map: ShardMap | None = placed.shard_map
        self._engine = placed.engine
        self._router = placed.router
        self._own_engines = placed.own_engines

    @property
    def engine(self) -> Engine:
        """The engine of this queue's database; a queue over several shards has none (each
        of :meth:`shards` has its own)."""
        if self._engine is None:
            raise UnroutedStatement(
                "this queue spans several databases (ONCEFLOW_DATABASE_URLS): use its "
                "shards(), one queue per database"
            )
        return self._engine

    def shards(self) -> list[Queue]:
        """One queue per database: ``[self]`` on one database; on a database split by
        workspace, a queue on each shard (same settings and resolver), in shard order —
        for work over every workspace that runs per shard (the sweeper, its election)."""
        if self.shard_map is None:
            return [self]
        if self._shards is None:
            assert self._router is not None  # noqa: S101 - made with the shard map
            shards = []
            for shard in self._router.shard_connectors:
                queue = Queue(shard.engine, self.settings, resolver=self.resolver)
                queue.connector = shard  # the router's: checks it is that shard (0009)
                shards.append(queue)
            self._shards = shards
        return self._shards

    # enqueue, enqueue_many, enqueue_many_with, resolve: see queue/enqueue.py.
    # claim, claim_next, heartbeat, complete, hand_off, finish, claim_parent, fail, fenced_retry:
    # queue/claims.py.
    # cancel, requeue, mark_undispatched: queue/operators.py.
    # get, live_claim, list, counts: queue/reads.py.
    # rescue_expired, due_for_dispatch, prune, sweep_once, begin_sweep: see queue/sweep.py.
    # complete_many, fail_many, heartbeat_many, release, depth: see queue/batch.py.
    # wait: see queue/done.py.


class AsyncQueue(
    AsyncSide,
    EnqueueOps,
    ClaimOps,
    OperatorOps,
    ReadOps,
    Sweeper,
    BatchOps,
    AsyncWaiter,
    AsyncDoneWaiter,
):
    """The durable stage queue for asyncio: the same operations as :class:`Queue`, awaited.

    Each operation is the very code :class:`Queue` runs (one body, two drivers), on a
    psycopg async pool per event loop (nothing connects until the first call).
    ``AsyncQueue.from_queue(queue)`` shares a sync queue's database (or shard map),
    settings and resolver (a Flow's stage declarations). Close each loop's pools with
    :meth:`aclose`.

    Without ``url`` or ``connector``, the configured map decides (``ONCEFLOW_DATABASE_URLS``
    / ``ONCEFLOW_SHARD_MAP``, else ``ONCEFLOW_DATABASE_URL``), as for :class:`Queue`: over
    several databases the queue routes each operation to its workspace's shard
    (:class:`~onceflow.connector.sharded.AsyncShardedConnector`; ``shard_map`` is then set).
    """

    # Same arguments as Queue's on purpose: public constructors; placing is one function each.
    def __init__(
        self,
        url: str | None = None,
        settings: Settings | None = None,
        *,
        resolver: Resolver | None = None,
        connector: AsyncConnector | None = None,
        shard_map: ShardMap | None = None,
    ):
        # Queue's arguments the asyncio way (a URL or a connector): the choice is place_async's.
        self.settings = settings or get_settings()
        self.resolver = resolver
        self.aconnector: AsyncConnector
        self.shard_map: ShardMap | None
        self.aconnector, self.shard_map = place_async(url, self.settings, shard_map, connector)

    @classmethod
    def from_queue(cls, queue: Queue) -> AsyncQueue:
        """An async queue on ``queue``'s database (on each of its shards, by the same map),
        with its settings and resolver."""
        if queue.shard_map is not None:
            return cls(settings=queue.settings, resolver=queue.resolver, shard_map=queue.shard_map)
        url = queue.engine.url.render_as_string(hide_password=False)
        return cls(url, queue.settings, resolver=queue.resolver)

    async def aclose(self) -> None:
        """Close this event loop's connection pools (one per shard) and listeners."""
        await self._close_async_listener()  # batches and sweeps: wait_for_work's listener
        await self._close_done_hubs()  # wait's LISTEN connections
        await close_pools(self.aconnector)


__all__ = [
    "BATCH_MAX",
    "LIST_LIMIT_MAX",
    "AsyncQueue",
    "Queue",
    "Resolver",
    "canonical_json",
]
