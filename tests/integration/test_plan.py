"""`blocks submit --dry-run` (the plan) and `--if-index` (the state index), on real servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aios_blocks.schemas.spec import Cluster, Gpu, Node
from aios_blocks.state.store import Store, index_key
from aios_blocks.workers.embedded import EmbeddedServers


def _p(iid: str, gpu: str = "g0") -> dict[str, Any]:
    return {"iid": iid, "block": "b", "node": "n", "gpus": [gpu], "cpu": 1, "mem": 0, "gpu_mem": 0,
            "exclusive": True, "share": False}


async def test_state_index_moves_with_every_change_placement_depends_on(tmp_path: Path) -> None:
    servers = EmbeddedServers(data_dir=tmp_path)
    servers.start_redis()
    st = Store.open(servers.redis_url)
    try:
        assert await st.state_index() == 0
        await st.put_cluster(Cluster(id="c", labels={"region": "eu"}))
        await st.put_cluster(Cluster(id="d"))
        assert await st.state_indexes() == {"c": 1, "d": 1}
        assert not await st.ensure_cluster(Cluster(id="c"))  # already there: nothing changed
        assert await st.state_index() == 2
        await st.put_node(Node(id="n", cluster="c", cpu=2, gpus=[Gpu(id="g0", memory=10), Gpu(id="g1", memory=10)]))
        assert await st.state_indexes() == {"c": 2, "d": 1}

        assert (await st.reserve_gang("c", [_p("i1")]))[0]  # taken: +1
        assert await st.state_indexes() == {"c": 3, "d": 1}
        assert (await st.reserve_gang("c", [_p("i1")]))[1] == "exists"  # a redelivery takes nothing
        assert not (await st.reserve_gang("c", [_p("i2")]))[0]  # refused: g0 is held
        assert await st.state_indexes() == {"c": 3, "d": 1}

        assert await st.release("c", "n", "i1")
        assert not await st.release("c", "n", "i1")  # nothing left to release
        assert await st.state_indexes() == {"c": 4, "d": 1}

        assert await st.set_node_health_cas("c", "n", False)
        assert not await st.set_node_health_cas("c", "n", False)  # no flip, no bump
        assert await st.state_indexes() == {"c": 5, "d": 1}
        await st.set_node_health("c", "n", True)
        assert await st.state_index() == 7  # the sum: a change in any cluster moves it

        # the keys carry the cluster's hash tag (same Redis Cluster slot as its nodes)
        assert index_key("c") == "aios:meta:{c:c}:index"
        # a recover restarts every index above what it was and above the stream's last sequence
        before = await st.scan_indexes()
        assert before == {"c": 6, "d": 1}
        await st.restart_indexes(["c", "d"], before, floor=3)
        assert await st.state_indexes() == {"c": 7, "d": 4}
    finally:
        await st.close()
        servers.stop()
