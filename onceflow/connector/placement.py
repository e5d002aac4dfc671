"""Which connector a store runs on, from the arguments it was built with.

A store (:class:`~onceflow.Queue`, :class:`~onceflow.OpLog` and their asyncio twins) runs
on one database, or on several split by workspace (a shard map): this is where the choice
is made, once for every store. Without a database or a map, the configured map decides
(``ONCEFLOW_DATABASE_URLS`` / ``ONCEFLOW_SHARD_MAP``, else ``ONCEFLOW_DATABASE_URL``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from onceflow.connector.aio import AsyncPsycopgConnector
from onceflow.connector.sharded import AsyncShardedConnector, ShardedConnector
from onceflow.connector.steps import AsyncConnector, Connector
from onceflow.connector.sync import PsycopgConnector
from onceflow.db import get_engine, make_engine
from onceflow.settings import Settings
from onceflow.shards import ShardMap, configured_map


@dataclass(frozen=True)
class Placement:
    """A sync store's connector; ``engine`` on one database, ``shard_map`` and ``router``
    (the connector itself) over several. ``own_engines``: engines made for this store alone
    (a ``pool_size`` of its own), one per shard."""

    connector: Connector
    engine: Engine | None = None
    shard_map: ShardMap | None = None
    router: ShardedConnector | None = None
    own_engines: list[Engine] = field(default_factory=list)


def place(
    engine: Engine | str | None,
    settings: Settings,
    shard_map: ShardMap | None = None,
    *,
    pool_size: int | None = None,
) -> Placement:
    """The pooled connector of a sync store given ``engine`` (or a URL) or ``shard_map``.

    ``pool_size``: engines of the store's own with that pool (one per shard) instead of
    the process's shared ones (:func:`~onceflow.db.get_engine`).
    """
    if engine is None and shard_map is None:
        shard_map = configured_map(settings)

    def engine_for(url: str) -> Engine:
        return get_engine(url) if pool_size is None else make_engine(url, pool_size=pool_size)

    if shard_map is not None and len(shard_map) > 1:
        own = [engine_for(url) for url in shard_map.urls] if pool_size is not None else []
        router = ShardedConnector.from_map(shard_map, own or None)
        return Placement(router, shard_map=shard_map, router=router, own_engines=own)
    if shard_map is not None:
        engine = shard_map.urls[0]
    if engine is None or isinstance(engine, str):
        engine = engine_for(engine or settings.database_url)
    return Placement(PsycopgConnector(engine), engine=engine)


def place_async(
    url: str | None,
    settings: Settings,
    shard_map: ShardMap | None = None,
    connector: AsyncConnector | None = None,
) -> tuple[AsyncConnector, ShardMap | None]:
    """The connector of an asyncio store, and its shard map (None on one database):
    ``connector`` as given, else a psycopg async pool on ``url``, else by ``shard_map``
    (a router over its shards when it has several)."""
    if connector is not None:
        routed = connector.shard_map if isinstance(connector, AsyncShardedConnector) else None
        return connector, routed
    if url is None:
        if shard_map is None:
            shard_map = configured_map(settings)
        if len(shard_map) > 1:
            return AsyncShardedConnector.from_map(shard_map), shard_map
        url = shard_map.urls[0]
    return AsyncPsycopgConnector(url), None


async def close_pools(connector: AsyncConnector) -> None:
    """Close the running event loop's connection pools of an asyncio store's ``connector``
    (one per shard; a connector the caller gave, of another kind, is the caller's to close)."""
    if isinstance(connector, AsyncPsycopgConnector | AsyncShardedConnector):
        await connector.aclose()
