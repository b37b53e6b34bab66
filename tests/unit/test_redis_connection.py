"""``AIOS_REDIS_URL`` -> a client: one server or a Redis Cluster (``state.connection``). No server
is needed: the clients connect lazily. The cluster itself is exercised by
tests/integration/test_cluster.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from aios_blocks.settings import Settings
from aios_blocks.state import keys
from aios_blocks.state.connection import BoundedRedisCluster, _Slot, cluster_nodes, is_cluster_url, open_redis


def test_cluster_urls_are_told_apart() -> None:
    assert is_cluster_url("redis+cluster://h:7000")
    assert is_cluster_url("rediss+cluster://h:7000")
    assert not is_cluster_url("redis://h:6379/0")
    assert not is_cluster_url("rediss://h:6379/0")


def test_cluster_url_gives_the_first_node_with_credentials_and_the_others() -> None:
    first, others = cluster_nodes("redis+cluster://u:p%40ss@a:7000,b:7001, c:7002/0?socket_timeout=2")
    assert first == "redis://u:p%40ss@a:7000/0?socket_timeout=2"
    assert others == [("b", 7001), ("c", 7002)]
    assert cluster_nodes("rediss+cluster://a:7000") == ("rediss://a:7000", [])


@pytest.mark.parametrize("url", ["redis+cluster://", "redis+cluster://a:7000,b", "redis+cluster://a:1,:2"])
def test_a_bad_cluster_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        cluster_nodes(url)


async def test_open_redis_picks_the_client_by_scheme() -> None:
    s = Settings(redis_max_connections=7)
    one = open_redis("redis://127.0.0.1:1/0", s)
    many = open_redis("redis+cluster://u:pw@127.0.0.1:1,127.0.0.1:2", s)
    try:
        assert isinstance(one, aioredis.Redis) and one.connection_pool.max_connections == 7
        assert isinstance(many, BoundedRedisCluster)
        ports = sorted(n.port for n in many.startup_nodes)
        assert ports == [1, 2]
        assert all(n.connection_kwargs.get("password") == "pw" for n in many.startup_nodes)  # every node gets them
        assert all(n.max_connections == 7 for n in many.startup_nodes)
    finally:
        await one.aclose()
        await many.aclose()


async def test_a_full_cluster_client_makes_callers_wait_then_fail_clearly() -> None:
    gate = asyncio.Semaphore(1)
    order: list[str] = []

    async def hold(name: str, s: float) -> None:
        async with _Slot(gate, 5.0):
            order.append(f"{name}+")
            await asyncio.sleep(s)
            async with _Slot(gate, 0.01):  # the same task again (a pipeline resending one command): no wait
                pass
            order.append(f"{name}-")

    await asyncio.gather(hold("a", 0.05), hold("b", 0))
    assert order == ["a+", "a-", "b+", "b-"]  # b waited for a's place
    await gate.acquire()
    with pytest.raises(aioredis.ConnectionError, match="no free Redis connection"):
        async with _Slot(gate, 0.01):
            pass


def test_what_one_script_touches_shares_a_slot() -> None:
    """The capacity scripts' keys (node, reservation, state index of one cluster) carry one hash
    tag; the global keys are each their own."""
    from redis.crc import key_slot

    slots = {key_slot(k.encode()) for k in (keys.node_key("c1", "n1"), keys.res_key("c1", "i1"), keys.index_key("c1"),
                                              keys.cluster_nodes_key("c1"), keys.node_key("c1", "n2"))}
    assert len(slots) == 1


async def test_a_store_pipeline_on_a_cluster_sends_scripts_alone_and_keeps_the_order() -> None:
    """redis-py's cluster pipelines refuse EVALSHA: the store's pipelines run there as commands in
    order, each script alone, the commands between scripts pipelined, results in queue order."""
    from aios_blocks.state.store import _Recorder

    sent: list[str] = []

    class Pipe:
        def __init__(self) -> None:
            self.cmds: list[str] = []

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **kw: self.cmds.append(f"{name}:{a[0]}")

        async def execute(self) -> list[str]:
            sent.append("pipe[" + ",".join(self.cmds) + "]")
            return [f"r-{c}" for c in self.cmds]

    class Client:
        def pipeline(self, transaction: bool = False) -> Pipe:
            assert transaction is False
            return Pipe()

        async def evalsha(self, sha: str, n: int, *rest: Any) -> str:
            sent.append(f"evalsha:{sha}")
            return f"r-evalsha:{sha}"

    rec = _Recorder()
    rec.hset("a", "f", "v")
    rec.evalsha("s1", 1, "k")
    rec.hsetnx("b", "f", "v")
    rec.hset("c", "f", "v")
    rec.evalsha("s2", 1, "k")
    out = await rec.run(Client())
    assert sent == ["pipe[hset:a]", "evalsha:s1", "pipe[hsetnx:b,hset:c]", "evalsha:s2"]
    assert out == ["r-hset:a", "r-evalsha:s1", "r-hsetnx:b", "r-hset:c", "r-evalsha:s2"]
