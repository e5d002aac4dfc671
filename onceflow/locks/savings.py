"""Compute-lock savings per workspace, for the dashboard: calls made vs calls asked.

The workspaces come from the set :func:`onceflow.keys.counters_workspaces_key`, which every
counters flush ``SADD``-s in the same pipeline as its ``HINCRBY``-s
(:func:`~onceflow.locks.counters.queue_increments`). A read is bounded: ``SCARD``, ``SSCAN``
pages until :data:`SAVINGS_WORKSPACES` members are collected, then one pipeline of ``HMGET``
(on a Redis Cluster, split by node).
"""

from __future__ import annotations

from typing import Any, Final

from onceflow.errors import InvalidRequest
from onceflow.keys import counters_key, counters_workspaces_key
from onceflow.locks.counters import (
    COMPUTES,
    DOUBLE_CHECK_HITS,
    PREFLIGHT_HITS,
    WAITS_SERVED_BY_BROADCAST,
    WAITS_SERVED_BY_RECHECK,
)
from onceflow.redis_clients import SyncRedis

SAVINGS_WORKSPACES: Final = 200

#: Provider calls made: ``computes`` counts every one, with the lock or without it
#: (``computes_without_lock`` is the part of them made without it, not more calls).
_MADE = (COMPUTES,)
_SAVED = (PREFLIGHT_HITS, DOUBLE_CHECK_HITS, WAITS_SERVED_BY_BROADCAST, WAITS_SERVED_BY_RECHECK)
_FIELDS = (*_MADE, *_SAVED)


def read_savings(client: SyncRedis) -> dict[str, Any]:
    """Calls made vs asked per workspace, from at most :data:`SAVINGS_WORKSPACES` workspaces.

    ``made`` = computes (every provider call, with or without the lock); ``saved`` =
    pre-flight and double-check hits plus waits served; ``asked`` = made + saved. Round
    trips: ``SCARD``, the ``SSCAN`` pages, one pipeline of ``HMGET``.
    """
    key = counters_workspaces_key()
    total = int(client.scard(key))
    names: list[str] = []
    cursor = 0
    while len(names) < SAVINGS_WORKSPACES:
        cursor, batch = client.sscan(key, cursor, count=SAVINGS_WORKSPACES)
        names.extend(b.decode() if isinstance(b, bytes) else str(b) for b in batch)
        if cursor == 0:
            break
    keys: dict[str, str] = {}
    for ws in sorted(set(names)):
        try:
            keys[ws] = counters_key(ws)
        except InvalidRequest:  # not a workspace id (written by something else): skipped
            continue
        if len(keys) == SAVINGS_WORKSPACES:
            break
    names = list(keys)
    pipe = client.pipeline(transaction=False)
    for ws in names:
        pipe.hmget(keys[ws], list(_FIELDS))
    out = []
    for ws, values in zip(names, pipe.execute(), strict=True):
        counts = dict(zip(_FIELDS, (int(v or 0) for v in values), strict=True))
        made = sum(counts[f] for f in _MADE)
        saved = sum(counts[f] for f in _SAVED)
        out.append({"workspace_id": ws, "made": made, "saved": saved, "asked": made + saved})
    return {
        "workspaces": out,
        "workspaces_total": total,
        "truncated": total > len(out),
        "limit": SAVINGS_WORKSPACES,
    }


__all__ = ["SAVINGS_WORKSPACES", "read_savings"]
