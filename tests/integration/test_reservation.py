"""The atomic reservation scripts against a real Redis: sharing rules and zero-amount releases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.state.store import Store


def _p(iid: str, gpu_mem: int, exclusive: bool, mem: int = 0) -> dict[str, Any]:
    return {"iid": iid, "block": "b", "node": "n", "gpus": ["g"], "cpu": 0, "mem": mem, "gpu_mem": gpu_mem,
            "exclusive": exclusive, "share": not exclusive}


async def test_sharing_rules_and_release_of_zero_amounts(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    st = Store.open(servers.redis_url)
    try:
        await st.put_node(Node(id="n", cluster="c", gpus=[Gpu(id="g", memory=100)]))
        assert (await st.reserve_gang("c", [_p("s1", 40, False)]))[0]
        assert (await st.reserve_gang("c", [_p("s2", 40, False)]))[0]
        ok, reason, node = await st.reserve_gang("c", [_p("s3", 40, False)])
        assert not ok and reason == "gpu g on n: 20 MiB free, 40 asked" and node == "n"
        ok, reason, _ = await st.reserve_gang("c", [_p("x1", 0, True)])
        assert not ok and "sharing is not allowed" in reason
        assert await st.release("c", "n", "s1") and await st.release("c", "n", "s2")
        assert not await st.release("c", "n", "s2")  # idempotent
        assert (await st.reserve_gang("c", [_p("x2", 0, True)]))[0]
        ok, reason, _ = await st.reserve_gang("c", [_p("s4", 10, False)])
        assert not ok and "held exclusively" in reason
        assert await st.release("c", "n", "x2")
        ok, _, _ = await st.reserve_gang("c", [_p("a", 0, True), _p("b", 0, True)])  # one gang, one exclusive GPU
        assert not ok
        # zero CPU, memory and GPU memory (the defaults of a component) must release cleanly
        assert (await st.reserve_gang("c", [_p("z", 0, False, mem=0)]))[0]
        assert await st.release("c", "n", "z")
        [view] = (await st.read_nodes("c", ["n"])).values()
        assert view["memory_free"] == view["memory"] and view["gpus"][0]["memory_used"] == 0
        assert view["gpus"][0]["instances"] == 0 and not view["gpus"][0]["exclusive"]
    finally:
        await st.close()
        servers.stop()


async def test_more_concurrent_calls_than_pooled_connections_wait_instead_of_failing(tmp_path: Path) -> None:
    """A burst bigger than the pool (workers run 64 handlers per consumer) queues for a
    connection; redis-py's default pool would raise MaxConnectionsError instead."""
    import asyncio

    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    st = Store.open(servers.redis_url, max_connections=4)
    try:
        await st.put_node(Node(id="n", cluster="c", gpus=[Gpu(id="g", memory=100)]))
        got = await asyncio.gather(*(st.r.hget("aios:{c:c}:node:n", "cpu") for _ in range(300)))
        assert len(got) == 300 and len(set(got)) == 1 and got[0] is not None
        pool = st.r.connection_pool
        assert pool.max_connections == 4
        assert len(pool._available_connections) + len(pool._in_use_connections) <= 4  # type: ignore[attr-defined]
    finally:
        await st.close()
        servers.stop()
