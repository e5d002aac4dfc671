"""Layer 3: apply each write once, by op id, with a gapless commit clock per sub-doc.

``apply_op`` is one transaction: lock the sub-doc row, look up the op id, apply
the op (a pure function of the state), advance the clock by one, record the op,
commit — then broadcast on the workspace's channel. A known op id is never
applied again: the retry gets the original clock and result, also when it
arrives while the first attempt is still in flight (it waits on the row lock
and joins). The same op id with another payload is :class:`OpIdConflict`.

Each operation is written once as steps (:mod:`onceflow.connector`, statements
:mod:`onceflow.oplog.sql`) and served by :class:`OpLog` (sync, pooled
connections) and :class:`AsyncOpLog` (asyncio, a psycopg async pool) alike. Only
the broadcast after a commit differs (a :class:`~onceflow.connector.Call` step of
``apply_op``): the sync Redis client for :class:`OpLog`,
``redis.asyncio`` for :class:`AsyncOpLog` (the event loop is never blocked), made by
:mod:`onceflow.redis_clients` from ``redis_url``: on a Redis Cluster the broadcast is a
sharded ``SPUBLISH`` on the workspace channel's slot.
"""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from onceflow.connector import AsyncConnector, AsyncSide, Connector, SyncSide
from onceflow.connector.placement import close_pools, place, place_async
from onceflow.connector.sharded import UnroutedStatement
from onceflow.keys import workspace_channel
from onceflow.loops import PerLoop, PerProcess, drop_redis_sockets
from onceflow.models.requests import Fence
from onceflow.oplog.ops import Applied, OpLogOps, commit_message
from onceflow.oplog.records import (
    OP_ID_RE,
    ApplyResult,
    OpRecord,
    SubDoc,
    check_op_id,
    new_op_id,
    stage_op_id,
)
from onceflow.queue.claims import fence_steps
from onceflow.redis_clients import (
    REDIS_ERRORS,
    REDIS_OR_OS_ERRORS,
    AsyncRedis,
    SyncRedis,
    async_client,
    is_cluster,
    publish,
    sync_client,
)
from onceflow.settings import Settings, get_settings
from onceflow.shards import ShardMap

log = logging.getLogger("onceflow.oplog")


def _broadcast_failed(workspace_id: str, sub_doc: str, exc: BaseException) -> None:
    # The write is committed; readers catch up with ops_since.
    log.warning("commit broadcast for %s/%s failed: %s", workspace_id, sub_doc, exc)


class OpLog(SyncSide, OpLogOps):
    """The op log of a database. Thread-safe; build one per process and share it."""

    def __init__(
        self,
        engine: Engine | str | None = None,
        settings: Settings | None = None,
        *,
        shard_map: ShardMap | None = None,
    ):
        self.settings = settings or get_settings()
        self._redis: PerProcess[SyncRedis] = PerProcess(
            lambda: sync_client(self.settings.redis_url, timeout=2)
        )
        placed = place(engine, self.settings, shard_map)
        self.connector: Connector = placed.connector
        #: The map of the databases this op log routes over; None on one database.
        self.shard_map: ShardMap | None = placed.shard_map
        self._engine = placed.engine

    @property
    def engine(self) -> Engine:
        """The engine of this op log's database; an op log over several shards has none."""
        if self._engine is None:
            raise UnroutedStatement(
                "this op log spans several databases (ONCEFLOW_DATABASE_URLS): it has no "
                "single engine"
            )
        return self._engine

    def redis(self) -> SyncRedis:
        """This process's Redis client (made after the fork, on first use).

        A cluster client reads the topology when it is made: a redis-py error
        (:data:`~onceflow.redis_clients.REDIS_ERRORS`) may come from this call.
        """
        return self._redis.get()

    def _publish(self, applied: ApplyResult, message: str) -> BaseException | None:
        try:
            client = self.redis()
            publish(client, is_cluster(client), workspace_channel(applied.workspace_id), message)
        except REDIS_ERRORS as exc:
            _broadcast_failed(applied.workspace_id, applied.sub_doc, exc)
            return exc
        return None


class AsyncOpLog(AsyncSide, OpLogOps):
    """The op log for asyncio: the same operations as :class:`OpLog`, awaited.

    Each operation is the very code :class:`OpLog` runs, on a psycopg async pool
    per event loop (nothing connects until the first call); the commit broadcast
    goes through ``redis.asyncio``, one client per event loop. ``from_oplog(oplog)``
    shares a sync op log's database (or shard map) and settings. Close a loop's pools and
    Redis client with :meth:`aclose`.

    Without ``url`` or ``connector``, the configured map decides, as for :class:`OpLog`:
    over several databases each operation runs on its workspace's shard
    (:class:`~onceflow.connector.sharded.AsyncShardedConnector`).
    """

    # The store's constructor arguments (alike by shape with the queue's): each store's own.
    def __init__(
        self,
        url: str | None = None,
        settings: Settings | None = None,
        *,
        connector: AsyncConnector | None = None,
        shard_map: ShardMap | None = None,
    ):
        self.settings = settings or get_settings()
        self.aconnector: AsyncConnector
        self.shard_map: ShardMap | None
        self.aconnector, self.shard_map = place_async(url, self.settings, shard_map, connector)
        # Pruned of closed loops (their clients' sockets shut): a weak table kept them all.
        self._redis: PerLoop[AsyncRedis] = PerLoop(drop_redis_sockets)

    @classmethod
    def from_oplog(cls, oplog: OpLog) -> AsyncOpLog:
        """An async op log on ``oplog``'s database (on each of its shards, by the same
        map), with its settings."""
        if oplog.shard_map is not None:
            return cls(settings=oplog.settings, shard_map=oplog.shard_map)
        return cls(oplog.engine.url.render_as_string(hide_password=False), oplog.settings)

    def redis(self) -> AsyncRedis:
        """The running event loop's ``redis.asyncio`` client (made on first use)."""
        client = self._redis.get()
        if client is None:
            client = self._redis.setdefault(
                lambda: async_client(self.settings.redis_url, timeout=2)
            )
        return client

    async def _publish(self, applied: ApplyResult, message: str) -> BaseException | None:
        try:
            client = self.redis()
            channel = workspace_channel(applied.workspace_id)
            await publish(client, is_cluster(client), channel, message)
        except REDIS_OR_OS_ERRORS as exc:
            _broadcast_failed(applied.workspace_id, applied.sub_doc, exc)
            return exc
        return None

    async def aclose(self) -> None:
        """Close this event loop's connection pools (one per shard) and Redis client."""
        client = self._redis.pop()
        if client is not None:
            await client.aclose()
        await close_pools(self.aconnector)


__all__ = [
    "OP_ID_RE",
    "Applied",
    "ApplyResult",
    "AsyncOpLog",
    "Fence",
    "OpLog",
    "OpLogOps",
    "OpRecord",
    "SubDoc",
    "check_op_id",
    "commit_message",
    "fence_steps",
    "new_op_id",
    "stage_op_id",
]
