"""Node drain / remove and cluster remove on real servers: a drained node's instances move away
(reassignment, reason evacuation), nothing new lands on it, removal waits for it to be empty,
a cluster is removed only when nothing runs in it; the stream rebuilds the same state."""

from __future__ import annotations

import asyncio

from aios_blocks.cli import nodes as ncli
from aios_blocks.recovery.invariants import check
from aios_blocks.recovery.rebuild import drop_project_keys, recover, state_digest

from .conftest import System
from .test_cli import blocks
from .test_vcluster import create, remove, until


async def test_drain_moves_instances_then_remove_node_then_cluster(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("c1", nodes=3, gpus=2)
    bid, kind, _ = await system.submit_and_wait({"blockComponentURI": "aios://test/model", "blockId": "b",
                                                 "minInstances": 2, "maxInstances": 3})
    assert kind == "ready"
    node = sorted(i["node"] for i in (await c.store.instances(bid)).values())[0]
    r = blocks(system, "node", "remove", node)
    assert r.returncode == 1 and f"node {node} is not drained" in r.stderr, r.stderr

    ev = await ncli.drain(c, node)
    assert ev.evacuating and ev.cluster_id == "c1"
    assert await ncli.wait_empty(c, node, 60) == 0

    async def moved() -> bool:
        insts = await c.store.instances(bid)
        return len(insts) == 2 and all(i["status"] == "running" and i["node"] != node for i in insts.values())

    await until(moved, 60)
    # nothing new lands on a draining node
    await c.scale(bid)

    async def scaled() -> bool:  # at rest: the digest check below compares a still state only
        insts = await c.store.instances(bid)
        return len(insts) == 3 and all(i["status"] == "running" for i in insts.values())

    await until(scaled, 60)
    assert node not in {i["node"] for i in (await c.store.instances(bid)).values()}
    assert (await c.store.read_nodes("c1", [node]))[node]["draining"] is True
    rep = await check(c.bus, c.store, expected={bid})  # the drain flag is rebuilt from the stream too
    assert rep.ok and rep.redis_digest == rep.stream_digest, rep.violations + rep.diff

    r = blocks(system, "node", "remove", node)
    assert r.returncode == 0 and f"node {node} removed from c1" in r.stdout, r.stdout + r.stderr
    assert node not in await c.store.node_ids("c1") and await c.store.node_cluster(node) is None

    r = blocks(system, "cluster", "remove", "c1")
    assert r.returncode == 1 and "instances still run on" in r.stderr, r.stderr
    await c.delete(bid)

    async def deleted() -> bool:
        b = await c.store.get_block(bid)
        return b is not None and b["status"] == "deleted"

    await until(deleted, 60)
    rep = await check(c.bus, c.store, expected={bid})
    assert rep.ok, rep.violations + rep.diff
    assert (await create(c, "v", "c1", {"sim-h100": 1}))[0]
    r = blocks(system, "cluster", "remove", "c1")
    assert r.returncode == 1 and "virtual cluster(s): remove them first" in r.stderr
    assert (await remove(c, "v"))[0]
    r = blocks(system, "cluster", "remove", "c1")
    assert r.returncode == 0 and "removed with 2 node(s)" in r.stdout, r.stdout + r.stderr
    assert "c1" not in await c.store.clusters() and await c.store.node_ids("c1") == []

    # the stream rebuilds the same state (drain flag, removed node and cluster)
    await asyncio.sleep(0.5)
    rep = await check(c.bus, c.store, expected={bid})
    assert rep.ok, rep.violations + rep.diff
    before = await state_digest(c.store)
    await drop_project_keys(c.store.r)
    report = await recover(c.bus, c.store)
    assert report.digest == before and report.anomalies == []
