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


def _scripted(ports: list[int]) -> Iterator[int]:
    yield from ports
    raise AssertionError("the script of ports ran out")


def test_every_node_gets_a_port_of_its_own_and_no_bus_port_of_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The OS offers 41001 twice, then 31001 (whose bus port is 41001), then two new ones.
    offered = _scripted([41001, 41001, 31001, 41002, 41003])
    monkeypatch.setattr(redis_cluster, "_os_port", lambda: next(offered))
    cluster = LocalCluster("redis-server")
    try:
        assert cluster.ports == [41001, 41002, 41003]
        assert cluster.used == cluster.ports
    finally:
        cluster.stop()


def test_a_restarted_node_never_takes_a_port_the_cluster_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    offered = _scripted([41011, 41012, 41013])
    monkeypatch.setattr(redis_cluster, "_os_port", lambda: next(offered))
    cluster = LocalCluster("redis-server")
    try:
        # A node that exited frees its port: the OS may offer it, or another node's, again.
        offered = _scripted([41011, 41013, 41014])
        assert redis_cluster._free_port(cluster.used) == 41014
    finally:
        cluster.stop()
