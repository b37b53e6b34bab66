"""Redis clients from ``AIOS_REDIS_URL``: one server, or a Redis Cluster.

* ``redis://[user:pass@]host:port/0`` (``rediss://`` with TLS): one server, through a blocking
  pool of ``AIOS_REDIS_MAX_CONNECTIONS`` connections (a burst of handlers waits for a free one up
  to ``AIOS_REDIS_POOL_WAIT_S``).
* ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster://`` with TLS): a Redis
  Cluster. Any node is enough to start (the client reads the slot map from it and follows MOVED /
  ASK and failovers); listing several lets it start while one is down. The same bound holds:
  at most ``AIOS_REDIS_MAX_CONNECTIONS`` commands or pipelines of a process are in flight at once
  (each holds at most one connection per node), the rest wait up to ``AIOS_REDIS_POOL_WAIT_S``.

On a cluster every multi-key command, script and transaction must keep its keys in one hash slot:
the key grammar (``state.keys``) puts what one script touches under one hash tag, and the store
uses transactions only over one tag.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster

from ..settings import Settings
from .autopipeline import AutoPipelineRedis

#: how long a command line tool waits, at its first PING, for a Redis Cluster that has a node down
#: but others up (a primary's failover: its slots answer again once a replica is promoted, after
#: ``cluster-node-timeout`` (15 s by default) and the election)
FAILOVER_WAIT_S = 30.0

#: URL schemes of a Redis Cluster (the scheme without ``+cluster`` is the connection's)
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_client(r: Any) -> bool:
    """Whether ``r`` talks to a Redis Cluster (its pipelines refuse scripts). The two client
    classes are told apart by type first: ``isinstance`` against redis-py's classes goes through
    ``typing.Protocol``'s slow check (~2 % of a worker's CPU when asked per pipeline)."""
    cls = type(r)
    if cls is AutoPipelineRedis:
        return False
    return isinstance(r, RedisCluster)


async def ping(r: Any, failover_wait_s: float = FAILOVER_WAIT_S) -> None:
    """PING (every node of a cluster). On a Redis Cluster a connection error to one node while
    another answers is a failover in progress (the killed primary still owns its slots until its
    replica is promoted): try again every 0.5 s for up to ``failover_wait_s`` (redis-py's own
    retries refresh the slot map with no pause, so they are spent within the window). No node
    answering at all, or a single server, fails at once."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisClusterException
    from redis.exceptions import TimeoutError as RedisTimeoutError

    deadline = asyncio.get_running_loop().time() + failover_wait_s
    while True:
        try:
            await r.ping()
            return
        except RedisClusterException as exc:
            # "Redis Cluster cannot be connected": no startup node answered CLUSTER SLOTS, none is up
            if "cannot be connected" in str(exc) or asyncio.get_running_loop().time() >= deadline:
                raise RedisConnectionError(str(exc)) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError):
            if not is_cluster_client(r) or asyncio.get_running_loop().time() >= deadline:
                raise
        await asyncio.sleep(0.5)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis+cluster://u:p@h1:1,h2:2/0?x=1`` -> (``redis://u:p@h1:1/0?x=1``, [(h2, 2)]): the
    first node's URL (carrying the credentials and options every node gets) and the others."""
    scheme, rest = url.split("://", 1)
    base = CLUSTER_SCHEMES[scheme.lower()]
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    userinfo, _, hosts = netloc.rpartition("@")
    addrs = [h.strip() for h in hosts.split(",") if h.strip()]
    if not addrs:
        raise ValueError(f"{scheme}:// URL names no node")
    others = []
    for addr in addrs[1:]:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{scheme}:// node {addr!r} is not host:port")
        others.append((host, int(port)))
    return f"{base}://{userinfo + '@' if userinfo else ''}{addrs[0]}{tail}", others


class _Pipeline(ClusterPipeline):
    """A cluster pipeline that takes a place under the client's bound while it runs."""

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client: BoundedRedisCluster = self.cluster_client  # type: ignore[assignment]
        async with client.slot():
            return await super().execute(raise_on_error, allow_redirections)


class BoundedRedisCluster(RedisCluster):
    """``RedisCluster`` whose callers wait for a place (as the single-server blocking pool makes
    them wait for a connection) instead of failing with ``MaxConnectionsError`` when a node's
    connections are all in use."""

    def __init__(self, *args: Any, bound: int = 64, wait_s: float = 30.0, **kwargs: Any) -> None:
        kwargs["max_connections"] = bound  # per node: one in-flight call holds at most one per node
        super().__init__(*args, **kwargs)
        self._gate = asyncio.Semaphore(bound)
        self._wait_s = wait_s

    def slot(self) -> _Slot:
        return _Slot(self._gate, self._wait_s)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.slot():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py, as documented
        return _Pipeline(self, transaction)  # type: ignore[abstract]  # as redis-py makes its own


#: set while a task holds a place: a pipeline that resends a redirected command one by one
#: (``execute_command`` inside ``execute``) does not wait for a second place
_holding: contextvars.ContextVar[bool] = contextvars.ContextVar("aios_redis_slot", default=False)


class _Slot:
    def __init__(self, gate: asyncio.Semaphore, wait_s: float) -> None:
        self.gate, self.wait_s = gate, wait_s
        self.token: contextvars.Token[bool] | None = None

    async def __aenter__(self) -> None:
        if _holding.get():
            return
        try:
            async with asyncio.timeout(self.wait_s):
                await self.gate.acquire()
        except TimeoutError:
            raise aioredis.ConnectionError(f"no free Redis connection within {self.wait_s}s") from None
        self.token = _holding.set(True)

    async def __aexit__(self, *exc: object) -> None:
        if self.token is not None:
            _holding.reset(self.token)
            self.gate.release()


def open_redis(url: str, settings: Settings, max_connections: int | None = None) -> Any:
    """A client for ``url`` (``decode_responses=True``; the caller owns it: ``aclose()``)."""
    bound = max_connections or settings.redis_max_connections
    if is_cluster_url(url):
        first, others = cluster_nodes(url)
        return BoundedRedisCluster.from_url(
            first, startup_nodes=[ClusterNode(h, p) for h, p in others], decode_responses=True,
            health_check_interval=10, bound=bound, wait_s=settings.redis_pool_wait_s, driver_info=None,
        )
    # A blocking pool: a burst of concurrent handlers (64 per consumer, several consumers per
    # process) waits for a free connection instead of failing with MaxConnectionsError.
    # driver_info=None: no CLIENT SETINFO on connect (a round trip per new connection, and a burst
    # opens tens of them)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, decode_responses=True, health_check_interval=10, max_connections=bound, timeout=settings.redis_pool_wait_s,
        driver_info=None,
    )
    # the client owns the pool: aclose() closes it
    if settings.redis_autopipeline:
        return AutoPipelineRedis.from_pool(pool)
    return aioredis.Redis.from_pool(pool)
