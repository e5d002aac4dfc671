"""Where the result cache keeps its entries: Postgres, on the database clock.

Chosen over Redis (``bench/result_cache.py`` measures both; docs/locks.md has the figures):
a Redis read or write is faster, but a cached provider result is worth keeping — it cost
money, and a Redis restart without persistence would lose every entry at once — and the
values are up to the payload limit each (256 KiB by default), unbounded in number: in the
Redis of the compute locks, which must never evict (``noeviction``), a growing cache would
end in refused writes for the locks themselves. Postgres keeps entries across restarts,
is shared by every client that reaches the database, bounds nothing but disk, and expires
entries by its own clock. The few hundred microseconds it costs more per read are nothing
beside the call a hit spares.

Workspace-scope entries live in ``result_cache`` in the workspace's own database (its
shard when the database is split by workspace), beside its ledger; global entries in
``result_cache_global`` in the first database. An entry past ``expires_at`` is never
served; a write over it replaces it; :meth:`ResultCache.purge` deletes the expired ones.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Engine

from onceflow.cache.capture import Paid
from onceflow.cache.key import CacheKey, Scope, check_digest, check_scope
from onceflow.cache.sql import GET, HIT, INVALIDATE, PURGE, PUT
from onceflow.db import execute, fetch_one, get_engine, raw_connection, retry_disconnect
from onceflow.errors import InvalidRequest
from onceflow.ids import check_id
from onceflow.metrics import record as metrics
from onceflow.payloads import encode_json
from onceflow.settings import get_settings
from onceflow.shards import ShardMap, configured_map

log = logging.getLogger("onceflow.cache")

#: The ledger's provider of a cache hit whose entry does not say who computed it.
UNKNOWN_PROVIDER: Final = "unknown"


@dataclass(frozen=True)
class Entry:
    """A live entry: its value (as JSON gives it back) and what computing it cost."""

    value: Any
    provider: str | None = None
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    #: None when unknown (no priced provider call was seen while it was computed).
    cost: Decimal | None = None


class ResultCache:
    """The result cache's entries in Postgres (see the module).

    ``database``: a URL, an engine, a shard map, or None (the settings: the first database
    of ``ONCEFLOW_DATABASE_URLS`` / ``ONCEFLOW_SHARD_MAP`` holds the global entries, each
    workspace's shard its own).
    """

    def __init__(self, database: str | Engine | ShardMap | None = None) -> None:
        self._map: ShardMap | None = None
        if isinstance(database, Engine):
            self._engines: tuple[Engine, ...] = (database,)
        elif isinstance(database, str):
            self._engines = (get_engine(database),)
        else:
            self._map = database if database is not None else configured_map()
            self._engines = tuple(get_engine(url) for url in self._map.urls)

    def engine(self, scope: Scope, workspace_id: str | None) -> Engine:
        """The database of a scope's entries: the first for global ones, the workspace's."""
        if scope == "global" or self._map is None or len(self._engines) == 1:
            return self._engines[0]
        return self._engines[self._map.shard_of(_workspace(workspace_id))]

    def get(self, workspace_id: str, key: CacheKey) -> Entry | None:
        """The live entry of ``key`` as seen from ``workspace_id``, or None."""
        params = _params(workspace_id, key)
        engine = self.engine(key.scope, workspace_id)

        def once() -> Any:
            with raw_connection(engine) as conn:
                return fetch_one(conn, GET[key.scope], params)

        row = retry_disconnect(once)
        if row is None:
            return None
        return Entry(
            row["value"], row["provider"], row["model"], row["input_tokens"],
            row["output_tokens"], row["cost"],
        )  # fmt: skip

    def encode(self, value: Any) -> str:
        """``value`` as the JSON an entry stores; InvalidRequest / PayloadTooLarge /
        PayloadTooDeep when it is not JSON or over the payload limits."""
        settings = get_settings()
        return encode_json(
            value, settings.payload_limit_bytes, what="cached result",
            max_depth=settings.max_payload_depth,
        )  # fmt: skip

    def put(self, workspace_id: str, key: CacheKey, text: str, paid: Paid | None = None) -> None:
        """Write (or replace) ``key``'s entry: ``text`` (from :meth:`encode`) for ``key.ttl``
        seconds from now on the database clock, with what computing it cost."""
        params = _params(workspace_id, key)
        known = paid is not None and paid.calls > 0
        params.update(
            value=text,
            ttl=key.ttl,
            provider=paid.provider if known and paid is not None else None,
            model=paid.model if known and paid is not None else None,
            input_tokens=paid.input_tokens if known and paid is not None else None,
            output_tokens=paid.output_tokens if known and paid is not None else None,
            cost=paid.cost if known and paid is not None else None,
        )
        engine = self.engine(key.scope, workspace_id)

        def once() -> None:
            with raw_connection(engine) as conn:
                execute(conn, PUT[key.scope], params)

        retry_disconnect(once)
        metrics.result_cache("stored")

    # Keyword options alike by shape to grant_for's on purpose: the run a hit's ledger row names.
    def record_hit(
        self,
        workspace_id: str,
        entry: Entry,
        *,
        cell_key: str | None = None,
        stage: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """A ``cache_hit`` row in the workspace's ledger: no tokens, no cost, the entry's
        cost as ``saved_cost``. Best effort: a ledger that cannot be written (Postgres
        down, the spend tables not migrated) is logged, never the caller's failure."""
        params = {
            "ws": workspace_id,
            "permit_id": uuid.uuid4().hex,
            "stage": stage,
            "request_id": request_id,
            "cell_key": cell_key,
            "provider": entry.provider or UNKNOWN_PROVIDER,
            "model": entry.model,
            "saved_cost": entry.cost,
        }
        engine = self.engine("workspace", workspace_id)

        def once() -> None:
            with raw_connection(engine) as conn:
                execute(conn, HIT, params)

        try:
            retry_disconnect(once)
        except Exception as exc:  # the value is served all the same
            log.warning("result cache: the hit's ledger row was not written: %s", exc)

    # Keyword options alike only by shape to other public signatures: a key or a digest, by name.
    def invalidate(
        self,
        scope: object,
        *,
        key: str | None = None,
        digest: str | None = None,
        workspace_id: str | None = None,
    ) -> bool:
        """Delete an entry, named by its ``key`` text or its ``digest``; whether one existed.

        A workspace-scope entry needs its ``workspace_id``; a global one takes none. Bad
        input (another scope, neither or both of key and digest, a digest that is not 64
        hex digits, a missing or extra workspace) raises InvalidRequest, deleting nothing.
        """
        checked = check_scope(scope)
        if (key is None) == (digest is None):
            raise InvalidRequest("name the entry by its key or by its digest (one of them)")
        if key is not None:
            digest = CacheKey(checked, key, 1).digest
        digest = check_digest(digest)
        if checked == "workspace":
            workspace_id = _workspace(workspace_id)
        elif workspace_id is not None:
            raise InvalidRequest("a global entry is shared by every workspace: give no workspace")
        params = {"ws": workspace_id, "digest": digest}
        engine = self.engine(checked, workspace_id)

        def once() -> int:
            with raw_connection(engine) as conn:
                return execute(conn, INVALIDATE[checked], params)

        deleted = retry_disconnect(once) > 0
        if deleted:
            metrics.result_cache("invalidated")
        return deleted

    def purge(self) -> int:
        """Delete every expired entry, of both scopes in every database; how many."""
        total = 0
        for index, engine in enumerate(self._engines):
            scopes: tuple[Scope, ...] = ("workspace", "global") if index == 0 else ("workspace",)
            for scope in scopes:

                def once(engine: Engine = engine, scope: Scope = scope) -> int:
                    with raw_connection(engine) as conn:
                        return execute(conn, PURGE[scope], {})

                total += retry_disconnect(once)
        return total


def _workspace(workspace_id: object) -> str:
    if workspace_id is None:
        raise InvalidRequest("a workspace-scope entry needs its workspace_id")
    return check_id("workspace_id", workspace_id)


def _params(workspace_id: str, key: CacheKey) -> dict[str, Any]:
    if not isinstance(key, CacheKey):
        raise InvalidRequest(f"cache must be a CacheKey, got {type(key).__name__}")
    return {"ws": check_id("workspace_id", workspace_id), "digest": key.digest}


_defaults: dict[tuple[str, int], ResultCache] = {}
_defaults_lock = threading.Lock()


def default_cache() -> ResultCache:
    """This process's cache on the settings' database(s) (made once, again after a fork)."""
    shard_map = configured_map()
    index = (repr(shard_map), os.getpid())
    with _defaults_lock:
        cache = _defaults.get(index)
        if cache is None:
            cache = _defaults[index] = ResultCache(shard_map)
        return cache
