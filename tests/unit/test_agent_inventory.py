"""An agent that starts says what it really runs (``node.inventory``, under a boot id new at each
start): the controller marks what the state has running there but is not listed ``lost`` at once,
the mapper confirms what is listed under the new boot, and the executors route no task to an
instance its node's agent has not confirmed since it started (issue 32, item 2)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from aios_blocks.agent.gpus import NoGpus
from aios_blocks.agent.node_agent import AgentConfig, NodeAgent, new_boot
from aios_blocks.agent.runtime_process import ProcessRuntime, process_scope
from aios_blocks.bus.catalog import E
from aios_blocks.executor.engine import InlinePolicy, InstanceState, Limits, Refused, Route
from aios_blocks.handlers import lifecycle as lc
from aios_blocks.handlers import mapper
from aios_blocks.handlers.effects import Publish
from aios_blocks.policies.runtime import BUILTINS
from aios_blocks.schemas.events import InstanceCommand, InstanceEvent, InventoryItem, NodeInventory
from aios_blocks.schemas.spec import Node

OLD, NEW = "18c0000000-aaaa", "18c0000fff-bbbb"  # two boots of one node's agent, NEW the later


def rec(iid: str, status: str, node: str = "n1", bid: str = "b1") -> dict[str, Any]:
    return {"block_id": bid, "gen": 1, "node": node, "cluster": "c1", "status": status, "gpus": []}


# -- the controller's decision ---------------------------------------------------------------------
def test_running_instances_the_inventory_does_not_list_are_removed_as_lost_at_once() -> None:
    on_node = {"b1-0": rec("b1-0", "running"), "b1-1": rec("b1-1", "running"), "b2-0": rec("b2-0", "starting", bid="b2"),
               "b3-0": rec("b3-0", "removing", bid="b3")}
    inv = NodeInventory("n1", NEW, [InventoryItem("b1-1", "b1", 1, "http://127.0.0.1:1")])
    effects = lc.on_inventory(inv, on_node)
    assert len(effects) == 1 and isinstance(effects[0], Publish)
    (emit,) = effects[0].events
    assert emit.event is E.instance_removed
    ev = emit.payload
    # only b1-0: b1-1 runs, b2-0 still waits for its create command, b3-0 is on its way out anyway
    assert (ev.block_id, ev.gen, ev.instance_id, ev.node_id, ev.reason, ev.boot) == ("b1", 1, "b1-0", "n1", "lost", NEW)
    assert emit.subject() == "aios.block.b1.instance.b1-0.removed"
    assert emit.logical_id() == f"b1:1:removed:b1-0:lost:{NEW}"  # a redelivered inventory: the same message
    # the lost fact takes the existing way: a live block's instance is replaced
    view = lc.View({"gen": 1, "status": "ready", "ir": {"minInstances": 1}}, {"b1-0": rec("b1-0", "running")})
    (replace,) = lc.on_removed(ev, view)
    assert type(replace).__name__ == "Replace" and replace.instance_id == "b1-0"


def test_an_inventory_listing_everything_loses_nothing() -> None:
    inv = NodeInventory("n1", NEW, [InventoryItem("b1-0", "b1", 1)])
    assert lc.on_inventory(inv, {"b1-0": rec("b1-0", "running")}) == []
    assert lc.on_inventory(NodeInventory("n1", NEW, []), {}) == []


# -- the mapper's decisions --------------------------------------------------------------------------
def _ready_map() -> dict[str, Any]:
    cur: dict[str, Any] | None = None
    for iid in ("b1-0", "b1-1"):
        cur = mapper.on_added(InstanceEvent("b1", 1, iid, "n1", [], "", f"http://127.0.0.1:{iid[-1]}0", OLD), cur, None, 1.0)
    assert cur is not None
    return cur


def test_added_stamps_the_boot_and_an_inventory_confirms_only_what_it_lists() -> None:
    cur = _ready_map()
    assert cur["boots"] == {"n1": OLD} and {i["boot"] for i in cur["instances"].values()} == {OLD}
    new = mapper.on_inventory(NodeInventory("n1", NEW, [InventoryItem("b1-1", "b1", 1)]), cur, 2.0)
    assert new is not None and new["boots"] == {"n1": NEW}
    assert new["instances"]["b1-1"]["boot"] == NEW and new["instances"]["b1-0"]["boot"] == OLD
    # a redelivered inventory, or one of an older run, changes nothing
    assert mapper.on_inventory(NodeInventory("n1", NEW, [InventoryItem("b1-1", "b1", 1)]), new, 3.0) is None
    assert mapper.on_inventory(NodeInventory("n1", OLD, []), new, 3.0) is None
    # a late `added` of the old run never makes the node's boot older; one of the new run confirms
    late = mapper.on_added(InstanceEvent("b1", 1, "b1-9", "n1", [], "", "http://127.0.0.1:99", OLD), new, None, 4.0)
    assert late is not None and late["boots"] == {"n1": NEW} and late["instances"]["b1-9"]["boot"] == OLD
    again = mapper.on_added(InstanceEvent("b1", 1, "b1-0", "n1", [], "", "http://127.0.0.1:00", NEW), new, None, 5.0)
    assert again is not None and again["instances"]["b1-0"]["boot"] == NEW


def test_boot_ids_order_by_their_start_time() -> None:
    assert mapper.latest_boot(None, OLD) == OLD
    assert mapper.latest_boot(OLD, NEW) == NEW and mapper.latest_boot(NEW, OLD) == NEW
    a = new_boot()
    assert mapper.boot_time(a) > 0 and mapper.boot_time("garbage") == 0


# -- the executor's routing ----------------------------------------------------------------------------
def _route(the_map: dict[str, Any]) -> Route:
    uri = "builtin:least-inflight"
    r = Route("b1", InlinePolicy(BUILTINS[uri]("b1.loadBalancer", {}, {}), uri), Limits(queue_timeout_s=0.05))
    r.apply(the_map["instances"], 1, 1, the_map.get("boots"))
    return r


async def test_an_instance_not_confirmed_since_its_agent_started_gets_no_task() -> None:
    cur = _ready_map()
    assert {v["state"] for v in _route(cur).views.values()} == {InstanceState.READY}
    new = mapper.on_inventory(NodeInventory("n1", NEW, [InventoryItem("b1-1", "b1", 1)]), cur, 2.0)
    assert new is not None
    r = _route(new)
    assert r.views["b1-0"]["state"] == InstanceState.UNCONFIRMED and r.views["b1-1"]["state"] == InstanceState.READY
    assert [(await r.acquire({}))["id"] for _ in range(5)] == ["b1-1"] * 5
    # none confirmed: the task waits (live instances), then is refused with 503, never sent
    none = mapper.on_inventory(NodeInventory("n1", NEW, []), cur, 2.0)
    assert none is not None
    r = _route(none)
    assert r.live() == 2 and r.candidates() == []
    try:
        await r.acquire({})
    except Refused as exc:
        assert exc.status == 503
    else:
        raise AssertionError("a task went to an unconfirmed instance")


def test_a_map_without_boots_routes_as_before() -> None:
    r = _route({"instances": {"i0": {"node": "n1", "endpoint": "http://127.0.0.1:1", "state": "ready"}}})
    assert r.views["i0"]["state"] == InstanceState.READY


# -- the agent ---------------------------------------------------------------------------------------
class FakeBus:
    def __init__(self) -> None:
        self.facts: list[tuple[str, Any]] = []

    async def emit(self, event: Any, payload: Any, **_: Any) -> None:
        self.facts.append((event.name, payload))


LAUNCH = {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "probe": {"type": "running"}, "stopGraceS": 1}


async def test_a_starting_agent_publishes_what_its_runtime_runs_before_anything_else(tmp_path: Path) -> None:
    rt = ProcessRuntime(scope=process_scope(tmp_path))
    node = Node(id="inv-n1", cluster="c1")
    cfg = AgentConfig(node=node, data_dir=tmp_path, register=False, reconcile=False, heartbeat=False, workdirs=False,
                      probes=False, drain_grace_s=0)
    first = NodeAgent(FakeBus(), rt, NoGpus(), cfg)  # type: ignore[arg-type]
    await first.create(InstanceCommand("b1", 1, "c1", "b1-0", "inv-n1", [], "", {}, launch=LAUNCH))
    assert first.bus.facts[-1][1].boot == first.boot  # type: ignore[attr-defined]
    await first.shutdown()  # the process keeps running: the next agent finds it
    bus = FakeBus()
    second = NodeAgent(bus, rt, NoGpus(), cfg)  # type: ignore[arg-type]
    try:
        await second.start()
        assert second.boot != first.boot
        name, inv = bus.facts[0]
        assert name == "node.inventory" and inv.node_id == "inv-n1" and inv.boot == second.boot
        assert [(i.instance_id, i.block_id, i.gen) for i in inv.instances] == [("b1-0", "b1", 1)]
    finally:
        await second.remove("b1", 1, "b1-0", "test end")
        await second.shutdown()
    third_bus = FakeBus()
    third = NodeAgent(third_bus, rt, NoGpus(), cfg)  # type: ignore[arg-type]
    await third.start()
    assert third_bus.facts[0][0] == "node.inventory" and third_bus.facts[0][1].instances == []
    await third.shutdown()
