"""Layer 3: apply each write once, by op id, with a gapless commit clock per sub-doc.

``apply_op`` is one transaction: lock the sub-doc row, look up the op id, apply
the op (a pure function of the state), advance the clock by one, record the op,
commit — then broadcast on the workspace's channel. A known op id is never
applied again: the retry gets the original clock and result, also when it
arrives while the first attempt is still in flight (it waits on the row lock
and joins). The same op id with another payload is :class:`OpIdConflict`.

Each operation is written once as steps (:mod:`onceflow.connector`, statements
:class:`onceflow.oplog.sql.N`) and served by :class:`OpLog` (sync, pooled
connections) and :class:`AsyncOpLog` (asyncio, a psycopg async pool) alike. Only
the broadcast after a commit differs: the sync Redis client for :class:`OpLog`,
``redis.asyncio`` for :class:`AsyncOpLog` (the event loop is never blocked), made by
:mod:`onceflow.redis_clients` from ``redis_url``: on a Redis Cluster the broadcast is a
sharded ``SPUBLISH`` on the workspace channel's slot.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from sqlalchemy import Engine

from onceflow.connector import (
    AsyncConnector,
    AsyncPsycopgConnector,
    AsyncSide,
    Connector,
    PsycopgConnector,
    SyncSide,
)
from onceflow.connector.sharded import (
    AsyncShardedConnector,
    ShardedConnector,
    UnroutedStatement,
)
from onceflow.db import get_engine
from onceflow.keys import workspace_channel
from onceflow.loops import PerLoop, drop_redis_sockets
from onceflow.models.ops import OpModel
from onceflow.models.requests import Fence
from onceflow.oplog.ops import Applied, OpLogOps, ScopeOf, commit_message
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
from onceflow.shards import ShardMap, configured_map

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
        self._redis: tuple[int, SyncRedis] | None = None
        self._engine: Engine | None = None
        if engine is None and shard_map is None:
            shard_map = configured_map(self.settings)  # ONCEFLOW_DATABASE_URLS / _SHARD_MAP
        #: The map of the databases this op log routes over; None on one database.
        self.shard_map: ShardMap | None = None
        if shard_map is not None and len(shard_map) > 1:
            self.shard_map = shard_map
            self.connector: Connector = ShardedConnector.from_map(shard_map)  # by workspace
        else:
            if shard_map is not None:
                engine = shard_map.urls[0]
            if engine is None or isinstance(engine, str):
                engine = get_engine(engine or self.settings.database_url)
            self._engine = engine
            self.connector = PsycopgConnector(engine)
        self._lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        """The engine of this op log's database; an op log over several shards has none."""
        if self._engine is None:
            raise UnroutedStatement(
                "this op log spans several databases (ONCEFLOW_DATABASE_URLS): it has no "
                "single engine"
            )
        return self._engine

    def apply_op(
        self,
        workspace_id: str | None,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None = None,
        *,
        fence: Fence | None = None,
        base_clock: int | None = None,
        sub_docs: ScopeOf | None = None,
    ) -> ApplyResult:
        """Apply ``op`` once; a known ``op_id`` returns the original clock and result.

        ``op_id`` is mandatory for callers that may retry (the SDK mints it);
        server-internal one-shot callers may omit it. ``fence`` (a stage's claim,
        or any object with its ``request_id`` and ``token``) is checked in the same
        transaction: a worker whose lease is gone gets
        :class:`~onceflow.errors.LeaseLost` and changes nothing; with a fence,
        ``workspace_id`` may be None: the fenced request's own. ``base_clock``
        is the sub-doc clock the client had seen when it minted the op: an op id
        the log no longer knows with ``base_clock`` below the sub-doc's pruned
        horizon may be a replay of a pruned op, so it is refused
        (:class:`ReplayTooOld`). Without ``base_clock`` the op is taken as new;
        a fenced write (a live claim) is never a stale replay. ``sub_docs`` (with a
        ``fence``) gives a stage's sub-doc scope by its name: the fenced request's stage
        must allow ``sub_doc``, checked on the fenced row in the same transaction
        (:class:`~onceflow.errors.OutOfScope`, nothing written). Each outcome is
        counted in ``onceflow_ops_total``. A new commit is broadcast on the
        workspace's Redis channel after it commits, never before.
        """
        done = self.apply_quietly(
            workspace_id,
            sub_doc,
            op,
            op_id,
            fence=fence,
            base_clock=base_clock,
            sub_docs=sub_docs,
        )
        message = done.broadcast
        if message is not None:
            self._publish(done.result, message)  # after commit, never before (O4)
        return done.result

    def redis(self) -> SyncRedis:
        """This process's Redis client (made after the fork, on first use).

        A cluster client reads the topology when it is made: a redis-py error
        (:data:`~onceflow.redis_clients.REDIS_ERRORS`) may come from this call.
        """
        pid = os.getpid()
        current = self._redis
        if current is None or current[0] != pid:
            with self._lock:
                current = self._redis
                if current is None or current[0] != pid:
                    client = sync_client(self.settings.redis_url, timeout=2)
                    current = self._redis = (pid, client)
        return current[1]

    def _publish(self, applied: ApplyResult, message: str) -> None:
        try:
            client = self.redis()
            publish(client, is_cluster(client), workspace_channel(applied.workspace_id), message)
        except REDIS_ERRORS as exc:
            _broadcast_failed(applied.workspace_id, applied.sub_doc, exc)


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

    def __init__(
        self,
        url: str | None = None,
        settings: Settings | None = None,
        *,
        connector: AsyncConnector | None = None,
        shard_map: ShardMap | None = None,
    ):
        self.settings = settings or get_settings()
        self.shard_map: ShardMap | None = None
        if connector is not None:
            self.aconnector: AsyncConnector = connector
            if isinstance(connector, AsyncShardedConnector):
                self.shard_map = connector.shard_map
        else:
            if url is None:
                if shard_map is None:
                    shard_map = configured_map(self.settings)  # ONCEFLOW_DATABASE_URLS / ...
                if len(shard_map) > 1:
                    self.shard_map = shard_map
                else:
                    url = shard_map.urls[0]
            if self.shard_map is not None:
                self.aconnector = AsyncShardedConnector.from_map(self.shard_map)
            else:
                self.aconnector = AsyncPsycopgConnector(url)
        # Pruned of closed loops (their clients' sockets shut): a weak table kept them all.
        self._redis: PerLoop[AsyncRedis] = PerLoop(drop_redis_sockets)

    @classmethod
    def from_oplog(cls, oplog: OpLog) -> AsyncOpLog:
        """An async op log on ``oplog``'s database (on each of its shards, by the same
        map), with its settings."""
        if oplog.shard_map is not None:
            return cls(settings=oplog.settings, shard_map=oplog.shard_map)
        return cls(oplog.engine.url.render_as_string(hide_password=False), oplog.settings)

    async def apply_op(
        self,
        workspace_id: str | None,
        sub_doc: str,
        op: OpModel | dict[str, Any],
        op_id: str | None = None,
        *,
        fence: Fence | None = None,
        base_clock: int | None = None,
        sub_docs: ScopeOf | None = None,
    ) -> ApplyResult:
        """:meth:`OpLog.apply_op`, awaited: the same transaction, then the broadcast."""
        done = await self.apply_quietly(
            workspace_id,
            sub_doc,
            op,
            op_id,
            fence=fence,
            base_clock=base_clock,
            sub_docs=sub_docs,
        )
        message = done.broadcast
        if message is not None:
            await self._publish(done.result, message)  # after commit, never before (O4)
        return done.result

    def redis(self) -> AsyncRedis:
        """The running event loop's ``redis.asyncio`` client (made on first use)."""
        client = self._redis.get()
        if client is None:
            client = self._redis.setdefault(
                lambda: async_client(self.settings.redis_url, timeout=2)
            )
        return client

    async def _publish(self, applied: ApplyResult, message: str) -> None:
        try:
            client = self.redis()
            channel = workspace_channel(applied.workspace_id)
            await publish(client, is_cluster(client), channel, message)
        except REDIS_OR_OS_ERRORS as exc:
            _broadcast_failed(applied.workspace_id, applied.sub_doc, exc)

    async def aclose(self) -> None:
        """Close this event loop's connection pools (one per shard) and Redis client."""
        client = self._redis.pop()
        if client is not None:
            await client.aclose()
        connector = self.aconnector
        if isinstance(connector, AsyncPsycopgConnector | AsyncShardedConnector):
            await connector.aclose()


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
