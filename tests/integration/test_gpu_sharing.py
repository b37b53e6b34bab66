"""GPU sharing end to end over real NATS JetStream and Redis, with the real worker processes: a
component with ``gpuSharing`` and ``gpuMemory: 40000`` on a node with one 80000 MiB GPU. Two
instances land on that one GPU (each reserved 40000 MiB of it, each told its cap); a third finds
the GPU full and its block fails, saying so; sharing without a memory figure is rejected."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from aios_blocks.bus import subjects
from aios_blocks.cli.client import event_kind
from aios_blocks.schemas.spec import Cluster, Gpu, Node

from .conftest import COMPONENT, System

GPU = "GPU-share-n0-0"
SHARED = {
    **COMPONENT,
    "componentURI": "aios://test/shared",
    "resources": {"gpus": 1, "gpuMemory": 40000, "cpu": 1, "memory": 1024},
    "policies": [
        COMPONENT["policies"][0],
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {"gpuSharing": True}},
    ],
}


async def _one_gpu_node(system: System) -> None:
    c = system.client
    await c.add_component(SHARED)
    await c.add_cluster(Cluster(id="share"))
    await c.add_node(Node(id="share-n0", cluster="share", cpu=16, memory=64 * 1024, gpus=[Gpu(id=GPU, model="sim-h100", memory=80000)]))


async def _event(system: System, bid: str, kind: str, timeout: float = 60) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        async for subject, env in system.client.follow(bid):
            if event_kind(subject) == kind:
                return env
    raise AssertionError("unreachable")  # pragma: no cover


async def test_two_instances_share_one_gpu_and_a_third_is_refused(system: System) -> None:
    c = system.client
    await _one_gpu_node(system)
    spec = {"blockComponentURI": "aios://test/shared", "minInstances": 2, "maxInstances": 3}
    bid, kind, env = await system.submit_and_wait({**spec, "blockId": "shared-a"})
    assert kind == "ready", env
    insts = await c.store.instances(bid)
    assert len(insts) == 2
    assert all(i["status"] == "running" and i["node"] == "share-n0" and i["gpus"] == [GPU] for i in insts.values())
    # the reservations: both on the one GPU, each holding 40000 MiB of it, neither exclusive
    res = sorted(await c.store.reservations("share"), key=lambda r: r["iid"])
    assert [r["iid"] for r in res] == sorted(insts)
    assert all(msgspec.json.decode(r["gpus"]) == {GPU: 40000} and r["exclusive"] == "0" for r in res)
    [view] = (await c.store.read_nodes("share", ["share-n0"])).values()
    assert view["gpus"][0]["instances"] == 2 and view["gpus"][0]["memory_free"] == 0
    # each instance was started with its cap
    creates = [msgspec.json.decode(m.data)["data"] for m in await c.scan(subjects.node_command("share-n0", "instance.create"), 1.0)]
    assert sorted(cmd["instance_id"] for cmd in creates) == sorted(insts)
    assert all(cmd["gpus"] == [GPU] and cmd["env"]["AIOS_GPU_MEMORY_LIMIT_MIB"] == "40000" for cmd in creates)

    # a third instance of the same block (scale, maxInstances 3): the GPU is full, the scale fails
    await c.scale(bid)
    failed = await _event(system, bid, "scale.failed")
    assert failed["data"]["reason"] == (
        "policy 'resourceAllocator' (scale) failed: raised RuntimeError: no healthy node can host an instance "
        "needing 1 GPU(s) x 40000 MiB, 1.0 CPU, 1024 MiB (instance 1 of 1)"
    ), failed
    assert len(await c.store.instances(bid)) == 2 and (await c.store.get_block(bid))["status"] == "ready"

    # a third instance as another block of the same component: no cluster has room, it fails
    _, kind3, env3 = await system.submit_and_wait({**spec, "blockId": "shared-b", "minInstances": 1, "maxInstances": 1,
                                                       "queue": False})
    assert kind3 == "failed" and env3["data"]["reason"] == (
        "no cluster passed the filter rule (share: no healthy node with capacity for one instance (1 nodes))"
    ), env3
    assert len(await c.store.reservations("share")) == 2  # nothing more was reserved

    # once one instance is gone, its 40000 MiB are free again and the other block is placed there
    await c.delete(bid)
    await _event(system, bid, "deleted")
    _, kind4, env4 = await system.submit_and_wait({**spec, "blockId": "shared-c", "minInstances": 1, "maxInstances": 1})
    assert kind4 == "ready", env4
    assert [i["gpus"] for i in (await c.store.instances("shared-c")).values()] == [[GPU]]


async def test_sharing_without_a_memory_figure_is_rejected_through_the_bus(system: System) -> None:
    await _one_gpu_node(system)
    spec = {"blockComponentURI": "aios://test/shared", "minInstances": 1, "maxInstances": 1,
            "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024}}
    _, kind, env = await system.submit_and_wait({**spec, "blockId": "shared-zero"})
    assert kind == "rejected", env
    [error] = env["data"]["errors"]
    assert error["path"] == "$.resources" and error["message"].startswith(
        "settings.gpuSharing is true but resources.gpuMemory is 0: a shared GPU is divided by gpuMemory"
    )
    assert await system.client.store.reservations("share") == []
    # and a component that shares without the figure is not registered at all
    zero = {**SHARED, "componentURI": "aios://test/shared-zero", "resources": {"gpus": 1, "gpuMemory": 0}}
    with pytest.raises(ValidationError, match=r"gpuSharing is true but resources\.gpuMemory is 0"):
        await system.client.add_component(zero)
    assert await system.client.store.get_component("aios://test/shared-zero") is None
