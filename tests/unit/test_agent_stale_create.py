"""A create command delivered after the remove of the same instance (a redelivery: commands are
at-least-once, e.g. a create whose ack was not out yet when the agent was stopped, then
redelivered after the controller had evicted the instance and queued its remove) starts nothing:
before, the returning agent stopped the old copy and then started it again. Real processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from aios_blocks.agent.gpus import detect
from aios_blocks.agent.node_agent import AgentConfig, NodeAgent, Placed
from aios_blocks.agent.provisioners import NodeGpu
from aios_blocks.agent.runtime_process import ProcessRuntime, process_scope
from aios_blocks.schemas.events import InstanceCommand
from aios_blocks.schemas.spec import Gpu, Node

LAUNCH = {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "probe": {"type": "running"}, "stopGraceS": 1}


class FakeBus:
    """Records the facts the agent publishes (no server needed for this decision)."""

    def __init__(self) -> None:
        self.facts: list[tuple[str, Any]] = []

    async def emit(self, event: Any, payload: Any, **_: Any) -> None:
        self.facts.append((event.name, payload))


def cmd(gen: int = 1) -> InstanceCommand:
    return InstanceCommand("b1", gen, "c1", "b1-0", "stale-n1", [], "", {}, launch=LAUNCH)


async def test_a_create_delivered_after_its_remove_starts_nothing(tmp_path: Path) -> None:
    rt = ProcessRuntime(scope=process_scope(tmp_path))
    source = detect(2, "stale-n1")
    node = Node(id="stale-n1", cluster="c1", gpus=[Gpu(id=g.id, model=g.model, memory=g.memory) for g in source.gpus()])
    cfg = AgentConfig(node=node, data_dir=tmp_path, register=False, reconcile=False, heartbeat=False, workdirs=False,
                      probes=False, drain_grace_s=0)
    bus = FakeBus()
    agent = NodeAgent(bus, rt, source, cfg)  # type: ignore[arg-type]
    try:
        await agent.create(cmd())
        assert [i.instance_id for i in await rt.list("stale-n1") if i.running] == ["b1-0"]
        assert set(agent.meta["b1-0"]) == set(Placed.__annotations__)  # what it keeps names every field
        assert agent._gpu_prov is not None
        assert all(set(g) == set(NodeGpu.__annotations__) for g in agent._gpu_prov.node_gpus.values())
        await agent.remove("b1", 1, "b1-0", "evicted: node stale-n1 unhealthy")
        assert not [i for i in await rt.list("stale-n1") if i.running]
        await agent.create(cmd())  # the stale redelivery
        assert not [i for i in await rt.list("stale-n1") if i.running] and "b1-0" not in agent.runners
        assert [name for name, _ in bus.facts] == ["block.instance.added", "block.instance.removed"]
        # a newer generation of the same instance id (the block redeployed) is a new instance
        await agent.create(cmd(gen=2))
        assert [i.gen for i in await rt.list("stale-n1") if i.running] == [2]
    finally:
        for iid in list(agent.runners):
            await agent.remove("b1", 2, iid, "test end")
    assert await rt.list("stale-n1") == []
