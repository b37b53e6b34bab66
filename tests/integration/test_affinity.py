"""Typed affinity (seed 002) at cluster and node level, over real NATS and Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aios_blocks.cli.client import Client
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import DEFAULT_LAYOUT, Supervisor
from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import COMPONENT, System


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
    _, kind, env = await system.submit_and_wait({**_spec("spread-5", aff5, mn=5, mx=5), "queue": False})  # (--no-queue)
    assert kind == "failed" and env["data"]["reason"] == "no cluster can hold minInstances (5) at once: c0 fits 4", env


async def test_trust_required_keeps_block_off_unattested_nodes(system: System) -> None:
    await _cluster(system, "c0", nodes=6, gpus=4, trusted=(1, 4))
    aff = [{"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "attested"}}]
    bid, kind, env = await system.submit_and_wait(_spec("trusted", aff, mn=4, mx=4, policy="builtin:spread"))
    assert kind == "ready", env
    nodes = {i["node"] for i in (await system.client.store.instances(bid)).values()}
    assert nodes == {"c0-n1", "c0-n4"}
    # the block's story says, per node, why affinity rejected it
    [result] = [a for s, e, _ in await system.client.history(bid) if s.endswith(".post_dry_run") for a in e["data"]["answers"]]
    assert set(result["rejected_nodes"]) == {"c0-n0", "c0-n2", "c0-n3", "c0-n5"}
    assert result["rejected_nodes"]["c0-n0"] == "rejected by entry 0: Required toward trust domain attested"

    # a cluster with no attested node is filtered out at the gateway with the reason
    await _cluster(system, "c9", nodes=2, gpus=4)
    aff_other = [{"category": "Trust", "strength": "Required", "target": {"type": "TrustDomain", "value": "nobody"}}]
    _, kind, env = await system.submit_and_wait({**_spec("untrusted", aff_other), "queue": False})  # (--no-queue)
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
        {"category": "Resource", "strength": "Sometimes", "target": {"type": "NodeId", "value": "x"}},
    ]
    _, kind, env = await system.submit_and_wait(_spec("bad-aff", aff))
    assert kind == "rejected"
    paths = {e["path"] for e in env["data"]["errors"]}
    assert any(p.startswith("$.affinity[0]") for p in paths)
    assert any(p.startswith("$.affinity[1]") for p in paths)
    assert any(p.startswith("$.affinity[2]") for p in paths)


async def test_preferred_affinity_chooses_the_cluster_too(system: System) -> None:
    # c0 has more free GPUs than c1 and the smaller id: every rank but affinity favours c0
    await _cluster(system, "c0", nodes=2, gpus=4)
    await _cluster(system, "c1", nodes=2, gpus=2)
    _, kind, env = await system.submit_and_wait(_spec("no-pref"))
    assert kind == "ready" and env["data"]["cluster_id"] == "c0"
    # c0 still has 7 free GPUs, c1 4: only the preference toward c1-n1 can move the block to c1
    aff = [{"category": "Topology", "strength": "Preferred", "target": {"type": "NodeId", "value": "c1-n1"}}]
    bid, kind, env = await system.submit_and_wait(_spec("pref-c1", aff))
    assert kind == "ready" and env["data"]["cluster_id"] == "c1"
    assert next(iter((await system.client.store.instances(bid)).values()))["node"] == "c1-n1"


@pytest.fixture
async def quiet_system(tmp_path: Path) -> AsyncIterator[System]:
    """The system without the metrics collector: the test writes the instance samples itself,
    as the collector would, and nothing overwrites them."""
    data = tmp_path / "data"
    servers = EmbeddedServers(data_dir=data).start()
    layout = {k: n for k, n in DEFAULT_LAYOUT.items() if k != "metrics"}
    sup = Supervisor(servers.nats_url, servers.redis_url, layout=layout, log_dir=str(data / "logs"),
                     role_env=servers.worker_env).start()
    client = await Client.open(servers.nats_url, servers.redis_url)
    await client.add_component(COMPONENT)
    try:
        yield System(servers, sup, client, data)
    finally:
        await client.close()
        sup.stop()
        servers.stop()


async def _new_instance(system: System, bid: str, before: set[str], timeout: float = 30) -> tuple[str, str]:
    async with asyncio.timeout(timeout):
        while True:
            insts = await system.client.store.instances(bid)
            new = [iid for iid in insts if iid not in before]
            if new:
                return new[0], insts[new[0]]["node"]
            await asyncio.sleep(0.05)


async def test_adaptive_affinity_moves_a_placement_toward_the_node_whose_instances_answer_fastest(quiet_system: System) -> None:
    """Adaptive toward rack 1 (both nodes): with no metrics it weighs as Preferred on both and
    spread decides; with the block's instances on adp-n0 answering in 10 ms and on adp-n1 in 40 ms
    the adapt stage weighs adp-n0 up (x1) and adp-n1 down (x0.5), so the next instance goes to
    adp-n0 although spread alone (adp-n1 has more free GPUs) would take adp-n1. `blocks explain`
    shows the base weight, the adapted weight and why."""
    system = quiet_system
    c = system.client
    await c.add_cluster(Cluster(id="adp"))
    for n in range(2):
        await c.add_node(Node(id=f"adp-n{n}", cluster="adp", labels={"rack": "1"},
                              gpus=[Gpu(id=f"adp-n{n}-g{g}") for g in range(4)]))
    aff = [{"category": "Topology", "strength": "Adaptive", "target": {"type": "RackId", "value": 1}}]
    bid, kind, env = await system.submit_and_wait(_spec("adapt-1", aff, mn=2, mx=5, policy="builtin:spread"))
    assert kind == "ready", env
    insts = await c.store.instances(bid)
    assert sorted(i["node"] for i in insts.values()) == ["adp-n0", "adp-n1"]  # spread: one each

    # no metrics: the base weight on both; the tie goes to spread's order (adp-n0 first)
    await c.scale(bid)
    first, node = await _new_instance(system, bid, set(insts))
    assert node == "adp-n0"
    insts = await c.store.instances(bid)  # adp-n0: 2 instances (2 GPUs free), adp-n1: 1 (3 free)

    # the collector's latest samples: adp-n0's instances answer in 10 ms, adp-n1's in 40 ms
    now = time.time()
    samples = {iid: {"t": now, "state": "ready", "node": i["node"], "up": True, "inflight": 0.0, "rate": 5.0,
                     "error_rate": 0.0, "latency_p50_ms": 10.0 if i["node"] == "adp-n0" else 40.0,
                     "latency_p99_ms": 50.0, "dispatch_p50_ms": None} for iid, i in insts.items()}
    block_sample = {"t": now, "cluster": "adp", "instances": len(insts), "ready": len(insts)}
    await c.store.metrics.write({bid: (block_sample, samples)}, keep=60, ttl_s=60)
    await c.scale(bid)
    second, node = await _new_instance(system, bid, set(insts))
    assert node == "adp-n0"  # spread alone would take adp-n1 (more free GPUs)

    from aios_blocks.projections.explain import explain

    x = explain([(s, e) for s, e, _ in await c.history(bid, idle=0.2)])
    assert x["adapt"]["figure"] == "latency_p50_ms" and x["adapt"]["block_median_ms"] == 10.0
    assert x["adapt"]["nodes"]["adp-n0"]["multiplier"] == 1.0 and x["adapt"]["nodes"]["adp-n1"]["multiplier"] == 0.5
    [rec] = x["instances"][second]["adaptive"]
    assert (rec["base"], rec["weight"]) == (1.0, 1.0) and "latency_p50_ms 10 ms here" in rec["why"]
    [rec] = x["instances"][first]["adaptive"]
    assert (rec["base"], rec["weight"]) == (1.0, 1.0) and "no live metrics" in rec["why"]
