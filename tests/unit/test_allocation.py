"""``handlers.allocation``: the pure allocation decision (plan/apply's plan) on in-memory
snapshots, and what starting a reservation records and announces. The adapter that commits these
with compare-and-set is covered on real Redis and NATS (tests/integration/test_reservation*.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from aios_blocks.handlers import allocation as al
from aios_blocks.schemas.catalog import E
from aios_blocks.schemas.errors import PlacementFailed
from aios_blocks.schemas.lifecycle import Step

from .views import busy_gpu, free_gpus, invoker, make_ir, node, nodes_of

CLUSTER = {"id": "c1", "labels": {}}


def fleet() -> dict[str, dict[str, Any]]:
    return nodes_of(node("n0", gpus=free_gpus(2)), node("n1", gpus=free_gpus(2)), node("n2", gpus=[busy_gpu("g0")]))


async def test_a_gang_is_one_reserve_whose_views_take_what_the_script_will() -> None:
    ir = make_ir(min_instances=3, max_instances=3, resources={"gpus": 1, "cpu": 2, "memory": 100})
    nodes = fleet()
    before = copy.deepcopy(nodes)
    effects = await al.plan_allocation(al.Snapshot(CLUSTER, nodes), al.Request(ir, "c1", "allocation", ("b1-0", "b1-1", "b1-2")),
                                       invoker(ir, "resourceAllocator"))
    assert nodes == before  # the snapshot is shared: never written
    (reserve,) = effects
    assert isinstance(reserve, al.Reserve) and reserve.cluster_id == "c1"
    assert [p["iid"] for p in reserve.placements] == ["b1-0", "b1-1", "b1-2"]
    taken = [(p["node"], g) for p in reserve.placements for g in p["gpus"]]
    assert len(taken) == len(set(taken)) == 3  # never one GPU twice
    assert reserve.touched == sorted(reserve.taken) and "n2" not in reserve.touched
    for nid, view in reserve.taken.items():  # the optimistic view: each touched node's GPUs held as planned
        mine = {g for n, g in taken if n == nid}
        assert {g["id"] for g in view["gpus"] if g["exclusive"]} == mine
        assert view["cpu_free"] == before[nid]["cpu_free"] - 2 * len(mine)


@pytest.mark.parametrize("avoid", ["n1", ""])
async def test_a_plan_with_nodes_left_out_fails_with_them_named(avoid: str) -> None:
    ir = make_ir(resources={"gpus": 2, "cpu": 1, "memory": 10})
    nodes = nodes_of(node("n0", gpus=free_gpus(2)), node("n1", gpus=free_gpus(2)), node("n2", gpus=[busy_gpu("g0")]))
    snap = al.Snapshot(CLUSTER, nodes, suspects={"n0": "suspect: probes", **({} if avoid else {"n1": "suspect: x"})})
    with pytest.raises(PlacementFailed) as err:
        await al.plan_allocation(snap, al.Request(ir, "c1", "reassignment", ("b1-r",), avoid=avoid), invoker(ir, "resourceAllocator"))
    assert "left out: n0 (suspect: probes); n1 (" in err.value.reason
    if avoid:
        assert "n1 (the node the replaced instance is moved off)" in err.value.reason


async def test_the_left_out_nodes_reach_the_policy_and_the_rest_place() -> None:
    ir = make_ir(resources={"gpus": 1, "cpu": 1, "memory": 10})
    seen: list[dict[str, Any]] = []
    inner = invoker(ir, "resourceAllocator")

    async def spy(data: dict[str, Any]) -> Any:
        seen.append(data)
        return await inner(data)

    snap = al.Snapshot(CLUSTER, fleet(), suspects={"n0": "suspect: probes"})
    (reserve,) = await al.plan_allocation(snap, al.Request(ir, "c1", "scale", ("b1-x",), extra={"block_metrics": {}}), spy)
    assert [p["node"] for p in reserve.placements] == ["n1"]
    assert seen[0]["payload"]["excluded_nodes"] == {"n0": "suspect: probes"}
    assert "n0" not in seen[0]["payload"]["healthy_nodes"]


def test_a_redelivered_step_reuses_its_reservations_only_when_all_are_held() -> None:
    held = {"node": "n0", "gpus": '{"g0": 1}'}
    assert al.reused(["a", "b"], [held, None]) is None
    assert al.reused(["a"], [held]) == [{"iid": "a", "node": "n0", "gpus": ["g0"]}]


def test_starting_records_the_instances_with_the_step_and_announces_only_the_kept() -> None:
    ir = make_ir(bid="b1", min_instances=2, max_instances=2)
    ir["sidecars"] = [{"name": "log"}]
    placements = [{"iid": "b1-0", "node": "n0", "gpus": ["g0"]}, {"iid": "b1-1", "node": "n1", "gpus": ["g0"]}]
    nodes = nodes_of(node("n0", labels={"rack": "r1"}), node("n1"))
    s = al.start_effects(ir, 7, "c1", "allocation", placements, nodes, 100.0, attempts=2, key="gang",
                         step=(Step.RESERVE, {"cluster": "c1"}))
    assert s.block_id == "b1" and s.step == (7, Step.RESERVE, {"cluster": "c1", "sidecar_node": "n0"})
    assert s.records["b1-0"] == {"node": "n0", "gpus": ["g0"], "cluster": "c1", "status": "starting", "action": "allocation",
                                 "since": 100.0}
    assert [i[2:] for i in s.index] == [("b1-0", "n0", "r1"), ("b1-1", "n1", "")]
    events = al.announce(s, placements[1:])
    assert [e.event for e in events] == [E.block_placement, E.node_instance_create, E.node_sidecar_start]
    made = events[0].payload
    assert [p.instance_id for p in made.placements] == ["b1-1"] and made.attempts == 2 and made.request_id == "gang"
    assert events[1].payload.instance_id == "b1-1" and events[1].payload.env["AIOS_INSTANCE_ID"] == "b1-1"
