"""onceflow's Redis URLs (:mod:`onceflow.redis_clients`): one server or a Redis Cluster,
and a cluster refused as Celery's broker. No server is needed: nothing here connects."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

from onceflow.errors import InvalidRedisUrl
from onceflow.redis_clients import (
    REDIS_ERRORS,
    async_client,
    is_cluster_url,
    parse_redis_url,
    require_one_server,
    shown,
    sync_client,
)
from onceflow.settings import Settings
from onceflow.tasks.config import broker_url, check_broker

CLUSTER = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,[::1]:7002"


def test_a_cluster_url_names_its_startup_nodes() -> None:
    target = parse_redis_url(CLUSTER)
    assert target.cluster
    assert target.nodes == (("127.0.0.1", 7000), ("127.0.0.1", 7001), ("::1", 7002))
    assert target.url == "redis://127.0.0.1:7000"
    tls = parse_redis_url("rediss+cluster://app:s%40cret@h1:7000,h2/0?protocol=3")
    assert tls.url == "rediss://app:s%40cret@h1:7000?protocol=3"
    assert tls.nodes == (("h1", 7000), ("h2", 6379))
    plain = parse_redis_url("redis://127.0.0.1:6379/2")
    assert (plain.cluster, plain.url, plain.nodes) == (False, "redis://127.0.0.1:6379/2", ())


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+cluster://h:7000/3", "one database, 0"),
        ("redis+cluster://h:7000,h:port", "'port' is not in 1-65535"),
        ("redis+cluster://h:70000", "not in 1-65535"),
        ("redis+cluster://h:1,", "'' is not host:port"),
    ],
)
def test_a_malformed_cluster_url_is_refused(url: str, problem: str) -> None:
    with pytest.raises(InvalidRedisUrl, match=problem):
        parse_redis_url(url)


def test_the_password_is_never_shown() -> None:
    assert shown("redis+cluster://app:hunter2@h1:1,h2:2") == "redis+cluster://app:***@h1:1,h2:2"
    with pytest.raises(InvalidRedisUrl) as caught:
        parse_redis_url("redis+cluster://app:hunter2@h1:1/5")
    assert "hunter2" not in str(caught.value)


def test_the_factory_makes_the_client_the_url_names() -> None:
    assert isinstance(sync_client("redis://127.0.0.1:1/0", timeout=1), redis.Redis)
    assert isinstance(async_client("redis://127.0.0.1:1/0", timeout=1), redis.asyncio.Redis)
    cluster = async_client("redis+cluster://127.0.0.1:1,127.0.0.1:2", timeout=1)
    assert isinstance(cluster, redis.asyncio.cluster.RedisCluster)  # nothing connected yet
    # A sync cluster client reads the topology when made: an unreachable one is a redis-py
    # error onceflow catches (REDIS_ERRORS: the cluster errors are no RedisError).
    with pytest.raises(REDIS_ERRORS):
        sync_client("redis+cluster://127.0.0.1:1", timeout=1)
    assert is_cluster_url("REDIS+CLUSTER://h:1") and not is_cluster_url("redis://h:1")


def test_a_cluster_is_refused_as_the_celery_broker() -> None:
    on_cluster = Settings(redis_url=CLUSTER)
    with pytest.raises(InvalidRedisUrl, match="ONCEFLOW_BROKER_URL is unset") as caught:
        broker_url(on_cluster)
    assert "kombu" in str(caught.value) and "amqp://" in str(caught.value)
    assert broker_url(Settings(redis_url=CLUSTER, broker_url="amqp://guest@h//")) == (
        "amqp://guest@h//"
    )
    with pytest.raises(InvalidRedisUrl, match="ONCEFLOW_BROKER_URL"):
        broker_url(Settings(broker_url=CLUSTER))
    with pytest.raises(InvalidRedisUrl):
        require_one_server(CLUSTER, "x")


def test_a_flow_on_a_cluster_without_a_broker_fails_when_celery_reads_its_config() -> None:
    from celery import Celery

    from onceflow.tasks import Flow

    flow = Flow(settings=Settings(redis_url=CLUSTER))  # nothing read yet: no error at import
    with pytest.raises(InvalidRedisUrl):
        check_broker(flow.app)
    fine = Flow(settings=Settings(redis_url=CLUSTER, broker_url="redis://127.0.0.1:6379/0"))
    check_broker(fine.app)
    yours = Celery("yours", broker=CLUSTER, set_as_current=False)
    with pytest.raises(InvalidRedisUrl, match="broker_url"):
        check_broker(yours)


def test_the_worker_command_refuses_a_cluster_broker_at_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCEFLOW_")}
    env["ONCEFLOW_REDIS_URL"] = "redis+cluster://127.0.0.1:1,127.0.0.1:2"
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "worker", "--worker-class", "default"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode != 0
    assert "InvalidRedisUrl" in done.stderr and "Redis Cluster" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
