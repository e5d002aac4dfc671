"""Every Redis client onceflow makes, from one URL: one server, or a Redis Cluster.

``redis://`` / ``rediss://`` / ``unix://`` name one server (``redis.Redis``). A Redis Cluster
is named by the scheme ``redis+cluster://`` (``rediss+cluster://`` with TLS) and one or
more startup nodes, the form the ``limits`` library (the API's rate limiter) reads too::

    redis+cluster://[user:password@]host:port[,host:port…][?option=value…]

and is served by redis-py's cluster client (``redis.cluster.RedisCluster``,
``redis.asyncio.cluster.RedisCluster``): each command goes to the node that owns its
key's slot. Every key and channel of a workspace carries the workspace as a hash tag
(:mod:`onceflow.keys`), so a workspace's locks, counters and broadcast channel live on
one node.

Broadcasts on a cluster are *sharded* pub/sub (Redis 7+): ``SPUBLISH`` reaches the
subscribers of the channel's own shard only, never the whole cluster bus, and a
subscriber holds a connection to that shard's primary (:func:`channel_pubsub`;
:func:`shard_node` and :func:`node_client` for asyncio). One server keeps plain
``PUBLISH``/``SUBSCRIBE``. redis-py's ``ClusterPubSub`` is not used: it re-subscribes
behind its caller's back after a node fails, so a subscriber could miss messages
without knowing; onceflow's subscribers want to learn that their connection is gone (a
lock waiter gets ``LockUnavailable``, or runs its protocol again when its slot moved; an
event stream ends and its client resyncs).
Sharded pub/sub on ``redis.asyncio`` (``PubSub.ssubscribe``) needs redis-py 8.0.

redis-py's cluster errors (``RedisClusterException`` and its subclasses, e.g. "no node
reachable") do not derive from ``RedisError``: catch :data:`REDIS_ERRORS`.

Kombu (Celery's broker) has no Redis Cluster transport: :func:`require_one_server` says
so for a broker URL.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, TypeAlias

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from onceflow.errors import InvalidRedisUrl

#: A sync client of either kind.
SyncRedis: TypeAlias = "redis.Redis | redis.cluster.RedisCluster"
#: An asyncio client of either kind.
AsyncRedis: TypeAlias = "redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster"

#: Every error redis-py raises: its cluster errors are not ``RedisError``s.
REDIS_ERRORS: Final = (redis.RedisError, redis.exceptions.RedisClusterException)
#: :data:`REDIS_ERRORS` and the socket errors (``OSError``, ``TimeoutError`` among them).
REDIS_OR_OS_ERRORS: Final = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)

#: A cluster scheme and the scheme of its nodes.
CLUSTER_SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: redis-py's first release with sharded pub/sub on asyncio (``PubSub.ssubscribe``).
CLUSTER_REDIS_PY: Final = (8, 0)

_NODE = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>[^:]*))?$")


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names: one server, or a cluster's startup nodes."""

    #: True for ``redis+cluster://`` / ``rediss+cluster://``.
    cluster: bool
    #: One server: the URL as given. A cluster: a ``redis://``/``rediss://`` URL of the
    #: first startup node, carrying the credentials and options of the cluster URL.
    url: str
    #: A cluster's startup nodes (the first one included); empty for one server.
    nodes: tuple[tuple[str, int], ...] = ()


class Kinds(NamedTuple):
    """The pub/sub message types of a subscription: plain, or sharded (``s…``)."""

    subscribe: str
    message: str
    unsubscribe: str


PLAIN: Final = Kinds("subscribe", "message", "unsubscribe")
SHARDED: Final = Kinds("ssubscribe", "smessage", "sunsubscribe")


def shown(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***`` (for messages)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url[:200]
    authority, tail = _split(rest)
    userinfo, at, hosts = authority.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return f"{scheme}://{userinfo}{at}{hosts}{tail}"[:300]


def _split(rest: str) -> tuple[str, str]:
    """A URL after its ``scheme://``: (authority, the rest: path, query, fragment)."""
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    return rest[:cut], rest[cut:]


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def parse_redis_url(url: str) -> RedisTarget:
    """What ``url`` names; :class:`InvalidRedisUrl` for a cluster URL that cannot be used.

    A one-server URL is left to redis-py (which reports its own errors when it connects).
    """
    scheme, sep, rest = url.partition("://")
    base = CLUSTER_SCHEMES.get(scheme.lower()) if sep else None
    if base is None:
        return RedisTarget(cluster=False, url=url)
    authority, tail = _split(rest)
    userinfo, at, hosts = authority.rpartition("@")
    path, _, query = tail.partition("?")
    if path not in ("", "/", "/0"):
        raise InvalidRedisUrl(shown(url), "a Redis Cluster has one database, 0 (no /<db> path)")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        node = _NODE.match(item.strip())
        if node is None:
            raise InvalidRedisUrl(shown(url), f"{item.strip()[:80]!r} is not host:port")
        host = node["v6"] or node["host"]
        port_text = node["port"] or "6379"
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise InvalidRedisUrl(shown(url), f"port {port_text[:10]!r} is not in 1-65535")
        nodes.append((host, int(port_text)))
    first_host, first_port = nodes[0]
    netloc = f"[{first_host}]" if ":" in first_host else first_host
    query_part = f"?{query}" if query else ""
    first = f"{base}://{userinfo}{at}{netloc}:{first_port}{query_part}"
    return RedisTarget(cluster=True, url=first, nodes=tuple(nodes))


def require_one_server(url: str, what: str) -> str:
    """``url`` if it names one server; :class:`InvalidRedisUrl` for a Redis Cluster.

    ``what`` names the setting for the message (e.g. the Celery broker).
    """
    if is_cluster_url(url):
        raise InvalidRedisUrl(
            shown(url),
            f"{what} cannot be a Redis Cluster (Celery's broker library, kombu, has no "
            "Redis Cluster transport); set ONCEFLOW_BROKER_URL to one Redis server "
            "(redis://host:6379/0) or to RabbitMQ (amqp://…), and keep "
            "ONCEFLOW_REDIS_URL on the cluster for locks and broadcasts",
        )
    return url


def _check_redis_py(url: str) -> None:
    version = tuple(int(p) for p in re.findall(r"\d+", redis.__version__)[:2])
    if version < CLUSTER_REDIS_PY:
        raise InvalidRedisUrl(
            shown(url),
            f"a Redis Cluster needs redis-py {'.'.join(map(str, CLUSTER_REDIS_PY))} or later "
            f"(installed: {redis.__version__}): pip install 'onceflow[redis-cluster]'",
        )


def _options(
    timeout: float | None, connect_timeout: float | None, client_name: str | None
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if timeout is not None:
        options["socket_timeout"] = timeout
        options["socket_connect_timeout"] = timeout
    if connect_timeout is not None:
        options["socket_connect_timeout"] = connect_timeout
    if client_name is not None:
        options["client_name"] = client_name
    return options


# Same signature as async_client on purpose: redis-py has a class per kind; options are shared.
def sync_client(
    url: str,
    *,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    retries: int | None = None,
    client_name: str | None = None,
) -> SyncRedis:
    """A sync client for ``url``: ``redis.Redis``, or ``RedisCluster`` for a cluster URL.

    ``timeout`` bounds every socket call (and the connect, unless ``connect_timeout``);
    ``retries`` immediate retries of a failed command (None: redis-py's default).
    A cluster client reads the topology from its startup nodes when it is made: make it
    where a redis-py error is handled (:data:`REDIS_ERRORS`), never at import.
    """
    target = parse_redis_url(url)
    options = _options(timeout, connect_timeout, client_name)
    if retries is not None:
        options["retry"] = Retry(NoBackoff(), retries)
    if not target.cluster:
        return redis.Redis.from_url(url, **options)
    _check_redis_py(url)
    node: Any = redis.cluster.ClusterNode  # unannotated in redis-py
    others = [node(host, port) for host, port in target.nodes[1:]]
    return redis.cluster.RedisCluster.from_url(target.url, startup_nodes=others, **options)


def async_client(
    url: str,
    *,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    retries: int | None = None,
    client_name: str | None = None,
) -> AsyncRedis:
    """:func:`sync_client` for asyncio: ``redis.asyncio.Redis`` or its ``RedisCluster``.

    Nothing connects until the first command. A client belongs to the event loop it first
    connects on.
    """
    target = parse_redis_url(url)
    options = _options(timeout, connect_timeout, client_name)
    if retries is not None:
        options["retry"] = AsyncRetry(NoBackoff(), retries)
    if not target.cluster:
        return redis.asyncio.Redis.from_url(url, **options)
    _check_redis_py(url)
    others = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.nodes[1:]]
    return redis.asyncio.cluster.RedisCluster.from_url(target.url, startup_nodes=others, **options)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (sync or asyncio) is a Redis Cluster client."""
    return isinstance(client, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


def publish(target: Any, sharded: bool, channel: str, message: str) -> Any:
    """Queue or send a broadcast on ``target`` (a client or a pipeline of either API).

    ``SPUBLISH`` on a cluster (the channel's shard only), ``PUBLISH`` on one server.
    Returns what the call returns (a coroutine for an asyncio client).
    """
    if sharded:
        return target.spublish(channel, message)
    return target.publish(channel, message)


def node_namer(client: Any) -> Callable[[str], str]:
    """``name(key)``: the name of the node that holds ``key`` (its slot's primary); always
    ``""`` for one server. The topology must be known: a sync cluster client reads it when
    it is made, an asyncio one at its first command (``await client.initialize()``)."""
    if not is_cluster(client):
        return lambda key: ""

    def name(key: str) -> str:
        node = client.get_node_from_key(key)
        if node is None:
            raise redis.exceptions.SlotNotCoveredError(f"no node serves key {key!r}")
        return str(node.name)

    return name


def channel_pubsub(client: SyncRedis, channel: str) -> tuple[Any, Kinds]:
    """A pub/sub object for ``channel`` (not subscribed yet) and its message types.

    On a cluster it is a connection to the primary of the channel's slot (subscribe with
    ``ssubscribe``); on one server, ``client.pubsub()``.
    """
    if isinstance(client, redis.cluster.RedisCluster):
        node_of: Any = client.get_node_from_key  # unannotated in redis-py
        node = node_of(channel)
        if node is None or node.redis_connection is None:
            raise redis.exceptions.SlotNotCoveredError(f"no node serves channel {channel!r}")
        make: Any = node.redis_connection.pubsub
        return make(), SHARDED
    make_plain: Any = client.pubsub  # annotated only from redis-py 8.2
    return make_plain(), PLAIN


async def shard_node(client: AsyncRedis, channel: str) -> Any | None:
    """The cluster node (primary) whose slot carries ``channel``; None on one server.

    Reads the cluster's topology on first use (redis-py errors: :data:`REDIS_ERRORS`).
    """
    if not isinstance(client, redis.asyncio.cluster.RedisCluster):
        return None
    await client.initialize()  # the first call reads the topology; later ones return at once
    node = client.get_node_from_key(channel)
    if node is None:
        raise redis.exceptions.SlotNotCoveredError(f"no node serves channel {channel!r}")
    return node


def node_client(node: Any, *, client_name: str | None = None) -> redis.asyncio.Redis:
    """A new one-server ``redis.asyncio`` client of a cluster ``node`` (:func:`shard_node`),
    with the cluster's connection options; the caller closes it.

    It never reconnects silently: a subscriber must learn that its connection (and any
    message published meanwhile) was lost.
    """
    options = dict(node.connection_kwargs)
    options["retry"] = AsyncRetry(NoBackoff(), 0)
    if client_name is not None:
        options["client_name"] = client_name
    pool = redis.asyncio.ConnectionPool(connection_class=node.connection_class, **options)
    return redis.asyncio.Redis(connection_pool=pool)


__all__ = [
    "CLUSTER_SCHEMES",
    "PLAIN",
    "REDIS_ERRORS",
    "REDIS_OR_OS_ERRORS",
    "SHARDED",
    "AsyncRedis",
    "Kinds",
    "RedisTarget",
    "SyncRedis",
    "async_client",
    "channel_pubsub",
    "is_cluster",
    "is_cluster_url",
    "node_client",
    "node_namer",
    "parse_redis_url",
    "publish",
    "require_one_server",
    "shard_node",
    "shown",
    "sync_client",
]
