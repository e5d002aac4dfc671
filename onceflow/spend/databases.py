"""Which database holds a workspace's spend: the one given, or its shard."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy import Engine

from onceflow.db import get_engine
from onceflow.errors import InvalidRequest, OnceflowError
from onceflow.shards import ShardMap, configured_map

T = TypeVar("T")

#: What the spend API is pointed at: a database URL, an engine, a shard map, or None (the
#: settings: ``ONCEFLOW_DATABASE_URL``, or the shards of ``ONCEFLOW_DATABASE_URLS`` /
#: ``ONCEFLOW_SHARD_MAP``).
Database = str | Engine | ShardMap | None


class Databases:
    """The engines of the spend tables and the one of each workspace.

    Spend rows live with the workspace's requests: on a database split by workspace, in
    the workspace's shard, so a ledger row is written in the same database (and
    transaction) as the fence of the claim it was paid under.
    """

    def __init__(
        self, database: Database = None, *, engines: Sequence[Engine] | None = None
    ) -> None:
        self._map: ShardMap | None = None
        if engines is not None:
            # A queue's own engines, one per shard of ``database`` (its map) or one alone.
            if isinstance(database, ShardMap) and len(engines) != len(database):
                raise InvalidRequest(
                    f"{len(engines)} engines for a shard map of {len(database)} shards"
                )
            if not engines or (len(engines) > 1 and not isinstance(database, ShardMap)):
                raise InvalidRequest("engines need a shard map naming one shard per engine")
            self._map = database if isinstance(database, ShardMap) else None
            self._engines: tuple[Engine, ...] = tuple(engines)
        elif isinstance(database, Engine):
            self._engines = (database,)
        elif isinstance(database, str):
            self._engines = (get_engine(database),)
        else:
            self._map = database if database is not None else configured_map()
            self._engines = tuple(get_engine(url) for url in self._map.urls)

    @property
    def engines(self) -> tuple[Engine, ...]:
        return self._engines

    def of(self, workspace_id: str) -> Engine:
        """The engine of ``workspace_id``'s database."""
        if self._map is None or len(self._engines) == 1:
            return self._engines[0]
        return self._engines[self._map.shard_of(workspace_id)]

    def each(self, read: Callable[[Engine], T]) -> tuple[list[T], list[int]]:
        """``read(engine)`` on every database: the answers, and the shards that did not
        answer (logged and skipped while another answers; raised when none did)."""
        answers: list[T] = []
        down: list[int] = []
        failed: OnceflowError | None = None
        for index, engine in enumerate(self._engines):
            try:
                answers.append(read(engine))
            except OnceflowError as exc:
                if len(self._engines) == 1:
                    raise
                failed = exc
                down.append(index)
        if not answers and failed is not None:
            raise failed
        return answers, down


def as_databases(database: Database | Databases) -> Databases:
    return database if isinstance(database, Databases) else Databases(database)


__all__ = ["Database", "Databases", "as_databases"]
