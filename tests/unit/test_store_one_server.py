"""``Store.one_server``: whether the state is on one Redis server, the store's to say (the workers
no longer test the client's type): true for the auto-pipelined client and any one-server client,
false for a Redis Cluster client, whose scripts may not take keys of two slots."""

from __future__ import annotations

from typing import Any, cast

import fakeredis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from aios_blocks.state.autopipeline import AutoPipelineRedis
from aios_blocks.state.store import Store
from aios_blocks.workers import effects


async def test_one_server_is_the_stores_to_say() -> None:
    one = Store(AutoPipelineRedis.from_url("redis://127.0.0.1:1", decode_responses=True))
    plain = Store(Redis.from_url("redis://127.0.0.1:1", decode_responses=True))
    fake = Store(fakeredis.FakeAsyncRedis(decode_responses=True))
    cluster = Store(cast(Any, RedisCluster(host="127.0.0.1", port=1, decode_responses=True)))  # not connected: no command
    assert (one.one_server, plain.one_server, fake.one_server, cluster.one_server) == (True, True, True, False)
    for s in (one, plain, fake):
        await s.close()


def test_the_workers_ask_the_store_not_the_client_type() -> None:
    assert not hasattr(effects, "AutoPipelineRedis")
