"""Typed affinity (seed 002) at cluster and node level, over real NATS and Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import System


async def _cluster(system: System, cid: str, nodes: int, gpus: int, trusted: tuple[int, ...] = ()) -> None:
    c = system.client
    await c.add_cluster(Cluster(id=cid))
    for n in range(nodes):
        labels = {"rack": str(n % 4)}
        if n in trusted:
            labels["trust-domain"] = "attested"
        await c.add_node(
            Node(id=f"{cid}-n{n}", cluster=cid, labels=labels, gpus=[Gpu(id=f"{cid}-n{n}-g{g}") for g in range(gpus)])
        )


def _spec(bid: str, affinity: list[dict[str, Any]] | None = None, mn: int = 1, mx: int = 1, policy: str = "builtin:binpack", **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "blockId": bid, "blockComponentURI": "aios://test/model", "minInstances": mn, "maxInstances": mx,
        "policyRulesSpec": [{"values": {"name": "resourceAllocator", "policyRuleURI": policy}}], **kw,
    }
    if affinity is not None:
        spec["affinity"] = affinity
    return spec


async def test_required_toward_gpu_lands_on_that_gpu(system: System) -> None:
    await _cluster(system, "c0", nodes=4, gpus=2)
    aff = [{"category": "Resource", "strength": "Required", "target": {"type": "ResourceId", "value": "c0-n2-g1"}}]
    bid, kind, env = await system.submit_and_wait(_spec("gpu-x", aff))
    assert kind == "ready", env
    [inst] = (await system.client.store.instances(bid)).values()
    assert inst["node"] == "c0-n2" and inst["gpus"] == ["c0-n2-g1"]


async def test_required_anti_affinity_from_own_block_spreads_over_racks(system: System) -> None:
    c = system.client
    await _cluster(system, "c0", nodes=8, gpus=8)  # racks 0..3, two nodes each
    aff = [{"category": "Topology", "strength": "Required", "anti": True, "target": {"type": "ServiceId", "value": "spread-4"}}]
    bid, kind, env = await system.submit_and_wait(_spec("spread-4", aff, mn=4, mx=5))
    assert kind == "ready", env
    insts = await c.store.instances(bid)
    racks = {int(i["node"].split("-n")[1]) % 4 for i in insts.values()}
    assert len(insts) == 4 and racks == {0, 1, 2, 3}

    await c.scale(bid)  # a 5th replica has no rack left
    async with asyncio.timeout(30):
        while True:
            hist = await c.history(bid, idle=0.2)
            failed = [e for s, e, _ in hist if s.endswith(".scale.failed")]
            if failed:
                break
            await asyncio.sleep(0.1)
    reason = failed[0]["data"]["reason"]
    assert "RequiredAffinityUnsatisfiable" in reason and "eliminated 8 of 8 nodes" in reason, reason
    assert len(await c.store.instances(bid)) == 4

    # five at once: the gang cannot be placed; the dry_run already counted 4 (one per rack), so the
    # block fails at post_dry_run with the count, without an allocation round
    aff5 = [{**aff[0], "target": {"type": "ServiceId", "value": "spread-5"}}]
    _, kind, env = await system.submit_and_wait(_spec("spread-5", aff5, mn=5, mx=5))
    assert kind == "failed" and env["data"]["reason"] == "no cluster can hold minInstances (5) at once: c0 fits 4", env


async def test_trust_required_keeps_block_off_unattested_nodes(system: System) -> None:
    await _cluster(system, "c0", nodes=6, gpus=4, trusted=(1, 4))
    aff = [{"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "attested"}}]
    bid, kind, env = await system.submit_and_wait(_spec("trusted", aff, mn=4, mx=4, policy="builtin:spread"))
    assert kind == "ready", env
    nodes = {i["node"] for i in (await system.client.store.instances(bid)).values()}
    assert nodes == {"c0-n1", "c0-n4"}
    # the block's story says, per node, why affinity rejected it
    [result] = [e["data"] for s, e, _ in await system.client.history(bid) if s.endswith(".dry_run.result")]
    assert set(result["rejected_nodes"]) == {"c0-n0", "c0-n2", "c0-n3", "c0-n5"}
    assert result["rejected_nodes"]["c0-n0"] == "rejected by entry 0: Required toward trust domain attested"

    # a cluster with no attested node is filtered out at the gateway with the reason
    await _cluster(system, "c9", nodes=2, gpus=4)
    aff_other = [{"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "nobody"}}]
    _, kind, env = await system.submit_and_wait(_spec("untrusted", aff_other))
    assert kind == "failed"
    assert "RequiredAffinityUnsatisfiable" in env["data"]["reason"] and "trust domain nobody" in env["data"]["reason"]


async def test_preferred_moves_placement_and_never_fails(system: System) -> None:
    await _cluster(system, "c0", nodes=4, gpus=2)
    # without affinity bin-pack takes the first node; a preference moves it
    _, kind, _ = await system.submit_and_wait(_spec("plain"))
    assert kind == "ready"
    plain_node = next(iter((await system.client.store.instances("plain")).values()))["node"]
    assert plain_node == "c0-n0"
    bid, kind, _ = await system.submit_and_wait(_spec("pref", affinityWith="c0-n3"))
    assert kind == "ready"
    assert next(iter((await system.client.store.instances(bid)).values()))["node"] == "c0-n3"
    # impossible preference: placed anyway
    bid, kind, _ = await system.submit_and_wait(_spec("pref-none", affinityWith="no-such-node"))
    assert kind == "ready"
    # preferred away from the node bin-pack would choose
    bid, kind, _ = await system.submit_and_wait(_spec("pref-away", antiAffinityWith="c0-n0"))
    assert kind == "ready"
    assert next(iter((await system.client.store.instances(bid)).values()))["node"] != "c0-n0"


async def test_invalid_affinity_is_rejected_at_parse_time(system: System) -> None:
    aff = [
        {"category": "Facility", "strength": "Required", "target": {"type": "NodeId", "value": "x"}},
        {"category": "Trust", "strength": "Required", "target": {"type": "NodeId", "value": "x"}},
        {"category": "Resource", "strength": "Adaptive", "target": {"type": "NodeId", "value": "x"}},
    ]
    _, kind, env = await system.submit_and_wait(_spec("bad-aff", aff))
    assert kind == "rejected"
    paths = {e["path"] for e in env["data"]["errors"]}
    assert any(p.startswith("$.affinity[0]") for p in paths)
    assert any(p.startswith("$.affinity[1]") for p in paths)
    assert any(p.startswith("$.affinity[2]") for p in paths)


async def test_preferred_affinity_chooses_the_cluster_too(system: System) -> None:
    # two identical clusters; cluster-rank alone would take c0 (tie -> smallest id)
    await _cluster(system, "c0", nodes=2, gpus=2)
    await _cluster(system, "c1", nodes=2, gpus=2)
    _, kind, env = await system.submit_and_wait(_spec("no-pref"))
    assert kind == "ready" and env["data"]["cluster_id"] == "c0"
    aff = [{"category": "Topology", "strength": "Preferred", "target": {"type": "NodeId", "value": "c1-n1"}}]
    bid, kind, env = await system.submit_and_wait(_spec("pref-c1", aff))
    assert kind == "ready" and env["data"]["cluster_id"] == "c1"
    assert next(iter((await system.client.store.instances(bid)).values()))["node"] == "c1-n1"
