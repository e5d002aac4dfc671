"""Provider limits on a real Redis Cluster of three primaries: every script names keys of
the provider's one slot, so permits, settles, cooling and the async API work there as on
one server, and two providers may live on different nodes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from onceflow.errors import PermitTimeout
from onceflow.spend import Provider, Usage
from onceflow.spend.limits import ProviderKeys
from tests.integration.redis_cluster import SLOT_RANGES, LocalCluster, server_binary

BINARY = server_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no redis-server or valkey-server binary (nor the embedded extra's) to run a cluster",
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    assert BINARY is not None
    local = LocalCluster(BINARY).start()
    yield local
    local.stop()


def _node_of(name: str) -> int:
    slot = key_slot(ProviderKeys(name).log.encode())
    return next(i for i, (low, high) in enumerate(SLOT_RANGES) if low <= slot <= high)


def _names_on_two_nodes() -> tuple[str, str]:
    names = [f"p-{uuid.uuid4().hex[:8]}" for _ in range(40)]
    first = names[0]
    second = next(n for n in names if _node_of(n) != _node_of(first))
    return first, second


@pytest.mark.slow
def test_limits_work_on_a_cluster(cluster: LocalCluster) -> None:
    a_name, b_name = _names_on_two_nodes()
    a = Provider(a_name, rpm=2, tpm=100, concurrency=1, window_seconds=30,
                 cold_start="empty", redis_url=cluster.url)  # fmt: skip
    b = Provider(b_name, rpm=5, cold_start="empty", redis_url=cluster.url)
    with a.permit("ws", tokens=40) as permit:
        with pytest.raises(PermitTimeout, match="concurrency"), a.permit("ws", timeout=0.2):
            pass
        permit.settle(Usage(5, 5))
    with a.permit("other-ws") as permit:
        permit.rate_limited(0.2)
    stats = a.stats()
    assert (stats["window_requests"], stats["window_tokens"], stats["cooled"]) == (2, 10, 1)
    with pytest.raises(PermitTimeout, match=r"rpm|cooling"), a.permit("ws", timeout=0.5):
        pass

    async def main() -> None:
        async with b.apermit("ws", tokens=3) as permit:
            await permit.settle(Usage(1, 1))

    asyncio.run(main())
    assert b.stats()["settled_ok"] == 1 and b.stats()["window_tokens"] == 2
