"""The test Redis Cluster's ports: distinct for every node, restarts included.

A CI run failed with ``KeyError`` in ``LocalCluster._up``: two of its nodes had been given
one port (the OS calls a released port free again), so one entry of ``procs`` stood for two
nodes and the restart of one deleted the other's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration import redis_cluster
from tests.integration.redis_cluster import LocalCluster


def _free_pairs(n: int) -> list[int]:
    """``n`` distinct ports that are free now with their bus ports (port + 10000): what the
    script offers must be ports ``_free_port`` takes, and it binds each one's bus port (fixed
    numbers failed when another connection of the run held one as its ephemeral port)."""
    got: list[int] = []
    while len(got) < n:
        got.append(redis_cluster._free_port(got))
    return got


def _scripted(ports: list[int]) -> Iterator[int]:
    yield from ports
    raise AssertionError("the script of ports ran out")


def test_every_node_gets_a_port_of_its_own_and_no_bus_port_of_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The OS offers p twice, then p - 10000 (whose bus port is p), then two new ones.
    p, q, r = _free_pairs(3)
    offered = _scripted([p, p, p - 10_000, q, r])
    monkeypatch.setattr(redis_cluster, "_os_port", lambda: next(offered))
    cluster = LocalCluster("redis-server")
    try:
        assert cluster.ports == [p, q, r]
        assert cluster.used == cluster.ports
    finally:
        cluster.stop()


def test_a_restarted_node_never_takes_a_port_the_cluster_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c, d = _free_pairs(4)
    offered = _scripted([a, b, c])
    monkeypatch.setattr(redis_cluster, "_os_port", lambda: next(offered))
    cluster = LocalCluster("redis-server")
    try:
        # A node that exited frees its port: the OS may offer it, or another node's, again.
        offered = _scripted([a, c, d])
        assert redis_cluster._free_port(cluster.used) == d
    finally:
        cluster.stop()
