"""Scale-to-zero end to end (issue 16), with the real worker processes over real NATS JetStream and
Redis: a block of minInstances 0 has no instance; its first task is held by the executor, which
asks for one (block.scale.target, source activator); the controller scales it up from 0, the
simulated fleet starts it, the mapper marks it ready, and the held task is answered by it. Scaled
back to 0, the next task wakes it again."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from aios_blocks.bus.instance_map import InstanceMaps

from .conftest import System


async def _map(system: System, bid: str, timeout: float = 30) -> dict[str, Any]:
    maps = InstanceMaps(system.client.bus)
    async with asyncio.timeout(timeout):
        while True:
            m, _ = await maps.get(bid)
            if m is not None:
                return m
            await asyncio.sleep(0.05)


async def _targets(system: System, bid: str) -> list[dict[str, Any]]:
    return [e["data"] for s, e, _ in await system.client.history(bid, idle=0.2) if s.endswith(".scale.target")]


async def test_the_first_task_of_a_block_at_zero_wakes_it_and_is_answered(system: System) -> None:
    c = system.client
    await c.add_sim_cluster("act-z", nodes=2, gpus=2)
    bid, kind, env = await system.submit_and_wait({"blockId": "act-zero", "blockComponentURI": "aios://test/model",
                                                   "minInstances": 0, "maxInstances": 2})
    assert kind == "ready", env
    assert await c.store.instances(bid) == {}
    m = await _map(system, bid)  # made at block.ready: the executors know the block, with no instance
    assert m["minInstances"] == 0 and m["instances"] == {}

    answers = await asyncio.gather(*(c.task(bid, b'{"n": %d}' % n, timeout=60) for n in range(3)))
    assert [s for s, _, _ in answers] == [200, 200, 200], answers
    assert [msgspec.json.decode(b)["output"] for _, b, _ in answers] == [{"n": 0}, {"n": 1}, {"n": 2}]
    [target] = [t for t in await _targets(system, bid) if t["source"] == "activator"]  # one request for the three
    assert target["target"] == 1
    assert len(await c.store.instances(bid)) == 1

    # back to zero (the autoscaler would do it when idle): the next task wakes it again
    ok, why = await c.wait_scaled(await c.scale_to(bid, 0), 60)
    assert ok, why
    async with asyncio.timeout(30):
        while (await _map(system, bid))["instances"]:
            await asyncio.sleep(0.05)
    s, body, h = await c.task(bid, b'{"again": true}', timeout=60)
    assert s == 200 and msgspec.json.decode(body)["output"] == {"again": True}, (s, h)
    assert len([t for t in await _targets(system, bid) if t["source"] == "activator"]) == 2


async def test_a_block_at_zero_keeps_its_cluster_and_virtual_cluster_from_being_removed(system: System) -> None:
    """A block scaled to zero runs no instance but lives on its cluster: removing the cluster (or
    the virtual cluster it was placed in) left it "ready" nowhere, its tasks held until they timed
    out, and `blocks check` saw nothing wrong."""
    from aios_blocks.cli import nodes as ncli

    from .test_vcluster import create, remove

    c = system.client
    await c.add_sim_cluster("zc", nodes=1, gpus=2)
    assert (await create(c, "zvc", "zc", {"sim-h100": 1}))[0]
    bid, kind, env = await system.submit_and_wait({"blockId": "zero-in-vc", "blockComponentURI": "aios://test/model",
                                                   "minInstances": 0, "maxInstances": 1, "virtualClusterId": "zvc"})
    assert kind == "ready" and await c.store.instances(bid) == {}, env
    ok, data = await remove(c, "zvc")
    assert not ok and f"zvc still holds blocks scaled to zero (delete them first): {bid}" in str(data.get("reason")), data

    async def delete(bid: str) -> None:
        await c.delete(bid)
        async with asyncio.timeout(60):
            while (await c.store.get_block(bid) or {}).get("status") != "deleted":
                await asyncio.sleep(0.1)

    await delete(bid)
    assert (await remove(c, "zvc"))[0]
    bid, kind, env = await system.submit_and_wait({"blockId": "zero-on-zc", "blockComponentURI": "aios://test/model",
                                                   "minInstances": 0, "maxInstances": 1})
    assert kind == "ready" and (await c.store.get_block(bid) or {}).get("cluster") == "zc", env
    try:
        await ncli.remove_cluster(c, "zc")
        raise AssertionError("the cluster was removed under a block")
    except LookupError as exc:
        assert f"blocks scaled to zero are placed on it (delete them first): {bid}" in str(exc), exc
    await delete(bid)
    assert await ncli.remove_cluster(c, "zc") == ["zc-n0"]
