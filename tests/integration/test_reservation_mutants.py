"""The reservation scripts' callers in ``state.Store`` against a real Redis, compared whole (the
mutation run, ``make mutate``, found them only partly asserted): what ``put_node`` registers, what
``reserve_gang`` and ``release`` answer and leave, and what the reservations read back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.state.store import Store


@pytest.fixture
async def st(tmp_path: Path) -> AsyncIterator[Store]:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    store = Store.open(servers.redis_url)
    try:
        yield store
    finally:
        await store.close()
        servers.stop()


def _p(iid: str, node: str = "n1", gpus: tuple[str, ...] = ("g0",), gpu_mem: int = 1000, exclusive: bool = False,
       cpu: float = 1.5, mem: int = 2048, gpu_share: int = 0) -> dict[str, Any]:
    return {"iid": iid, "block": "b", "node": node, "gpus": list(gpus), "cpu": cpu, "mem": mem, "gpu_mem": gpu_mem,
            "exclusive": exclusive, "share": not exclusive, "gpu_share": gpu_share}


def _gpu(gid: str, model: str, memory: int, used: int = 0, n: int = 0, x: bool = False, share: int = 0) -> dict[str, Any]:
    return {"id": gid, "model": model, "memory": memory, "memory_used": used, "memory_free": memory - used,
            "instances": n, "exclusive": x, "share_free": 1000 - share}


NODE = Node(id="n1", cluster="c", labels={"rack": "3"}, cpu=8, memory=16384,
            gpus=[Gpu(id="g0", model="H100", memory=80000), Gpu(id="g1", model="A10", memory=24000)])


async def test_put_node_registers_capacity_health_agent_and_the_cluster_indexes(st: Store) -> None:
    before = (await st.state_indexes(["c"]))["c"]
    await st.put_node(NODE, agent="agent-1")
    assert await st.read_nodes("c", ["n1", "nowhere"]) == {"n1": {
        "node_id": "n1", "cluster": "c", "labels": {"rack": "3"}, "healthy": True,
        "cpu": 8.0, "cpu_free": 8.0, "memory": 16384, "memory_free": 16384,
        "gpus": [_gpu("g0", "H100", 80000), _gpu("g1", "A10", 24000)],
    }}
    assert await st.node_cluster("n1") == "c" and await st.node_ids("c") == ["n1"]
    assert (await st.state_indexes(["c"]))["c"] > before  # placement depends on it: a dry run is stale now
    assert (await st.node_meta("n1") or {}).get("agent") == "agent-1"
    # an update keeps the agent unless it names one, and says the node is unhealthy
    await st.put_node(NODE.model_copy(update={"healthy": False}))
    [view] = (await st.read_nodes("c", ["n1"])).values()
    assert view["healthy"] is False and (await st.node_meta("n1") or {}).get("agent") == "agent-1"


async def test_reserve_and_release_answer_and_leave_exactly_what_they_took(st: Store) -> None:
    await st.put_node(NODE)
    await st.put_node(Node(id="n2", cluster="c", cpu=4, memory=4096, gpus=[Gpu(id="g0", memory=100)]))
    idx = (await st.state_indexes(["c"]))["c"]
    assert await st.reserve_gang("c", [_p("i1", gpu_share=250), _p("i2", gpus=("g1",), exclusive=True, gpu_mem=0)]) == (
        True, "ok", "")
    assert (await st.state_indexes(["c"]))["c"] > idx
    assert await st.reserve_gang("c", [_p("i1"), _p("i2", gpus=("g1",), exclusive=True, gpu_mem=0)]) == (True, "exists", "")
    [view] = (await st.read_nodes("c", ["n1"])).values()
    assert view["cpu_free"] == 5.0 and view["memory_free"] == 16384 - 4096
    assert view["gpus"] == [_gpu("g0", "H100", 80000, used=1000, n=1, share=250), _gpu("g1", "A10", 24000, used=24000, n=1, x=True)]
    # a refusal names the reason and the node
    assert await st.reserve_gang("c", [_p("i3", node="n2", gpu_mem=500)]) == (
        False, "gpu g0 on n2: 100 MiB free, 500 asked", "n2")
    # what is reserved reads back: one, several (None where none), all of the cluster's
    one = await st.reservation("c", "i1")
    assert one is not None and one["node"] == "n1" and one["block"] == "b" and one["exclusive"] == "0"
    assert await st.reservation("c", "i3") is None
    got = await st.reservations_of("c", ["i2", "i3", "i1"])
    assert [r and r["node"] for r in got] == ["n1", None, "n1"] and got[0]["exclusive"] == "1"  # type: ignore[index]
    assert sorted(r["iid"] for r in await st.reservations("c")) == ["i1", "i2"]
    assert await st.reservations("other") == []
    # a release answers whether it released, gives back exactly what was taken, bumps the index
    idx = (await st.state_indexes(["c"]))["c"]
    assert await st.release("c", "n1", "i2") is True
    assert await st.release("c", "n1", "i2") is False
    assert (await st.state_indexes(["c"]))["c"] > idx
    assert await st.release("c", "n1", "i1") is True
    [view] = (await st.read_nodes("c", ["n1"])).values()
    assert view["cpu_free"] == 8.0 and view["memory_free"] == 16384
    assert view["gpus"] == [_gpu("g0", "H100", 80000), _gpu("g1", "A10", 24000)]
    assert await st.reservations("c") == []
