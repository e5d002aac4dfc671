"""The dashboard's search and series over a database split by workspace (2 and 4 shards
cloned from a migrated template, test_shards' fixtures): each shard's sweep writes its own
rollup (the Redis savings on the first shard only), the series adds the shards', and a
search merges their pages in order, every row once."""

from __future__ import annotations

import os
import secrets

from pydantic import BaseModel

from onceflow.db import fetch_all, fetch_one, get_engine, raw_connection
from onceflow.queue import search, series
from onceflow.queue.search import Filters
from onceflow.settings import get_settings
from onceflow.shards import ShardMap
from tests.integration import test_shards
from tests.integration.test_shards import spread_workspaces

template = test_shards.template
shards = test_shards.shards


class Empty(BaseModel):
    pass


def test_search_and_series_merge_the_shards(shards: list[str], redis_url: str) -> None:
    from onceflow.tasks import Flow

    shard_map = ShardMap.from_urls(shards)
    os.environ["ONCEFLOW_DATABASE_URLS"] = ",".join(shards)
    get_settings.cache_clear()
    try:
        flow = Flow(name=f"dash-shards-{secrets.token_hex(2)}")
        flow.stage("s", input=Empty, worker_class="sh-dash")(lambda ctx, data: {})
        spaces = spread_workspaces(shard_map, 2)
        rids = [
            flow.enqueue("s", ws, f"j{i}", str(k), {}).request_id
            for k in range(3)
            for i, ws in enumerate(spaces)
        ]
        flow.sweep_once()
        engines = [get_engine(url) for url in shards]
        for k, engine in enumerate(engines):
            with raw_connection(engine) as raw:
                held = fetch_one(raw, "SELECT sum(enqueued) AS n FROM onceflow_series", {})["n"]
                saved = fetch_all(raw, "SELECT bucket FROM onceflow_series_savings", {})
            assert held == 3 * sum(shard_map.shard_of(ws) == k for ws in spaces)
            assert (len(saved) == 1) == (k == 0)  # Redis is shared: read on one shard only

        out = series.read_series(engines, "hour")
        assert sum(b["enqueued"] for b in out["buckets"]) == len(rids)
        assert max(b["queued_max"] or 0 for b in out["buckets"]) == len(rids)

        got, cursor = [], None
        while True:
            page = search.search(engines, Filters(worker_class="sh-dash"), limit=4, cursor=cursor)
            got += page["items"]
            cursor = page["next"]
            if cursor is None:
                break
        assert sorted(r["request_id"] for r in got) == sorted(rids)  # every row once
        keys = [(r["created_at"], r["workspace_id"], r["request_id"]) for r in got]
        assert keys == sorted(keys, reverse=True)  # newest first across the shards
        [found] = search.search(engines, Filters(q=rids[5]))["items"]
        assert found["request_id"] == rids[5]
    finally:
        os.environ.pop("ONCEFLOW_DATABASE_URLS", None)
        get_settings.cache_clear()
