"""A block with Preferred affinity: its post_dry_run input carries each cluster's affinity score
(what cluster-rank breaks a tie on), and ``blocks explain --inputs``'s replay rebuilds that input
bit for bit (the gateway and the replay build the entries alike). Real servers and workers."""

from __future__ import annotations

from aios_blocks.policies.contract import cluster_id_of
from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import System


async def test_the_post_dry_run_input_carries_the_affinity_score_and_is_rebuilt(system: System) -> None:
    c = system.client
    for cid, gpus in (("c0", 4), ("c1", 2)):  # c0: more free GPUs and the smaller id
        await c.add_cluster(Cluster(id=cid))
        for n in range(2):
            await c.add_node(Node(id=f"{cid}-n{n}", cluster=cid, gpus=[Gpu(id=f"{cid}-n{n}-g{g}") for g in range(gpus)]))
    aff = [{"category": "Topology", "strength": "Preferred", "target": {"type": "NodeId", "value": "c1-n1"}}]
    bid, kind, env = await system.submit_and_wait({"blockId": "aff-in", "blockComponentURI": "aios://test/model",
                                                   "minInstances": 1, "maxInstances": 1, "affinity": aff})
    assert kind == "ready" and env["data"]["cluster_id"] == "c1", env
    decisions = await c.decisions(bid=bid)
    assert [(d["action"], d["input_check"]) for d in decisions if d["input_check"] != "rebuilt"] == []
    (post,) = [d for d in decisions if d["action"] == "post_dry_run"]
    scores = {e["cluster_id"]: e["metrics"]["affinity_score"] for e in post["input"]["clusters"]}
    assert scores == {"c0": 0.0, "c1": 1.0}
    assert cluster_id_of(post["output"]) == "c1"
