"""``builtin:rebalance-min`` (issue 38): the default rebalancer policy, case by case."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aios_blocks.handlers.policy_test import summarize
from aios_blocks.policies import contract
from aios_blocks.policies.builtin.rebalance import plan
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.uris import uri_problem


def node(nid: str, gpus: int = 8, used: set[int] | None = None, model: str = "A100") -> tuple[str, dict[str, Any]]:
    used = used or set()
    return nid, {"cpu_free": 64, "mem_free": 512 * 1024,
                 "gpus": {f"{nid}-g{g}": {"model": model, "free": 0.0 if g in used else 1.0} for g in range(gpus)}}


def blk(bid: str, placed: dict[str, tuple[str, list[int]]], priority: int = 0, min_instances: int = 1,
        preemptible: bool | None = None, max_unavailable: int | None = None, moving: int = 0) -> dict[str, Any]:
    b: dict[str, Any] = {
        "block_id": bid, "priority": priority, "created": 0.0, "minInstances": min_instances, "moving": moving,
        "instances": {iid: {"node_id": n, "gpus": [f"{n}-g{g}" for g in gs], "share": 1.0, "cpu": 0, "memory": 0}
                      for iid, (n, gs) in placed.items()},
    }
    if preemptible is not None:
        b["preemptible"] = preemptible
    if max_unavailable is not None:
        b["maxMoving"] = max_unavailable
    return b


def inp(nodes: list[tuple[str, dict[str, Any]]], movable: list[dict[str, Any]], pending: list[dict[str, Any]] | None = None,
        k: int = 2, trigger: str = "pending") -> dict[str, Any]:
    return {"action": "rebalance", "maxMoves": k, "trigger": trigger,
            "cluster": {"cluster_id": "c1", "nodes": dict(nodes)}, "pending": pending or [], "movable": movable}


def want(gpus: int, priority: int = 100, n: int = 1, bid: str = "p") -> dict[str, Any]:
    return {"block_id": bid, "priority": priority, "minInstances": n, "resources": {"gpus": gpus}}


#: two 8-GPU nodes, 5 GPUs used on each (3 free each: a 4-GPU block fits on neither)
SPLIT = [node("n1", used={0, 1, 2, 3, 4}), node("n2", used={0, 1, 2, 3, 4})]
SPLIT_BLOCKS = [blk("a", {"a-0": ("n1", [0, 1, 2, 3])}), blk("b", {"b-0": ("n1", [4])}),
                blk("c", {"c-0": ("n2", [0, 1, 2, 3])}), blk("d", {"d-0": ("n2", [4])})]


def test_a_pending_4_gpu_block_that_fits_after_one_move_gets_exactly_that_move() -> None:
    out = plan(inp(SPLIT, SPLIT_BLOCKS, [want(4)]))
    assert len(out["moves"]) == 1, out
    m = out["moves"][0]
    # the 1-GPU instance moves (the smallest), off one node onto the other, which it fills
    assert m["instance_id"] in ("b-0", "d-0") and m["from"] != m["to"] and m["gpus_freed"] == 1.0
    assert out["for"] == "p" and out["fits"] == {m["from"]: 1}
    assert "makes room for pending p" in m["reason"] and "3 -> 4 whole GPUs free" in m["reason"]
    contract.check("rebalance", out)


def test_a_block_that_fits_now_gets_no_move() -> None:
    out = plan(inp([node("n1")], [], [want(4)]))
    assert out["moves"] == [] and "fits without moves" in out["reason"]


def test_max_moves_is_respected() -> None:
    # each node holds four 1-GPU instances and 1 GPU free... a 8-GPU block needs 4+ moves off one node
    nodes = [node("n1", used={0, 1, 2, 3}), node("n2", used={0, 1, 2, 3}), node("n3", used={0, 1, 2, 3, 4, 5, 6})]
    blocks = [blk(f"x{i}", {f"x{i}-0": ("n1", [i])}) for i in range(4)] + \
             [blk(f"y{i}", {f"y{i}-0": ("n2", [i])}) for i in range(4)] + \
             [blk("z", {"z-0": ("n3", [0, 1, 2, 3, 4, 5, 6])})]
    for k in (1, 2, 3):
        out = plan(inp(nodes, blocks, [want(8)], k=k))
        assert out["moves"] == [], (k, out)
        assert f"after {k} move(s)" in out["reason"]
    out = plan(inp(nodes, blocks, [want(8)], k=4))
    assert len(out["moves"]) == 4 and len({m["from"] for m in out["moves"]}) == 1
    out = plan(inp(nodes, blocks, [], k=1, trigger="fragmentation"))
    assert len(out["moves"]) <= 1


def test_no_move_worsens_fragmentation() -> None:
    out = plan(inp(SPLIT, SPLIT_BLOCKS, [want(4)]))
    assert out["fragmentation"]["after"] <= out["fragmentation"]["before"]
    # a move that would only shuffle equal holes is never made: an idle spare node is no target
    out = plan(inp([node("n1", used={0}), node("n2")], [blk("a", {"a-0": ("n1", [0])})], trigger="fragmentation"))
    assert out["moves"] == [] and "no move lowers" in out["reason"]


def test_fragmentation_trigger_consolidates_scattered_instances() -> None:
    # four 1-GPU instances, one on each of four 4-GPU nodes: no node can take a 4-GPU task
    nodes = [node(f"n{i}", gpus=4, used={0}) for i in range(4)]
    blocks = [blk(f"s{i}", {f"s{i}-0": (f"n{i}", [0])}) for i in range(4)]
    wl = [{"gpus": 4, "weight": 0.5}, {"gpus": 1, "weight": 0.5}]
    out = plan({**inp(nodes, blocks, k=3, trigger="fragmentation"), "workload": wl})
    assert len(out["moves"]) == 3
    assert out["fragmentation"]["after"] < out["fragmentation"]["before"]
    targets = {m["to"] for m in out["moves"]}
    assert len(targets) == 1 and not targets & {m["from"] for m in out["moves"]}
    for m in out["moves"]:
        assert m["frag_delta"] < 0 and "fragmentation" in m["reason"]


def test_priority_a_block_is_never_moved_for_a_lower_one() -> None:
    blocks = [blk("a", {"a-0": ("n1", [0, 1, 2, 3])}), blk("b", {"b-0": ("n1", [4])}, priority=1000),
              blk("c", {"c-0": ("n2", [0, 1, 2, 3])}), blk("d", {"d-0": ("n2", [4])}, priority=1000)]
    assert plan(inp(SPLIT, blocks, [want(4, priority=100)]))["moves"] == []
    out = plan(inp(SPLIT, blocks, [want(4, priority=1000)]))
    assert len(out["moves"]) == 1


def test_not_preemptible_blocks_never_move() -> None:
    blocks = [blk("a", {"a-0": ("n1", [0, 1, 2, 3])}), blk("b", {"b-0": ("n1", [4])}, preemptible=False),
              blk("c", {"c-0": ("n2", [0, 1, 2, 3])}), blk("d", {"d-0": ("n2", [4])}, preemptible=False)]
    assert plan(inp(SPLIT, blocks, [want(4)]))["moves"] == []
    only_d = [*blocks[:3], blk("d", {"d-0": ("n2", [4])})]
    out = plan(inp(SPLIT, only_d, [want(4)]))
    assert [m["instance_id"] for m in out["moves"]] == ["d-0"]


def test_disruption_budget_limits_moves_per_block() -> None:
    # one block holds both small instances: with a budget of 1 (the default) only one of them moves
    nodes = [node("n1", gpus=4, used={0, 1}), node("n2", gpus=4, used={0, 1})]
    both = [blk("s", {"s-0": ("n1", [0]), "s-1": ("n1", [1])}), blk("t", {"t-0": ("n2", [0, 1])}, preemptible=False)]
    out = plan(inp(nodes, both, [want(4)]))
    assert out["moves"] == [], out
    both[0]["maxMoving"] = 2
    out = plan(inp(nodes, both, [want(4)]))
    assert len(out["moves"]) == 2 and {m["instance_id"] for m in out["moves"]} == {"s-0", "s-1"}
    both[0]["moving"] = 2  # its budget is taken by moves under way
    assert plan(inp(nodes, both, [want(4)]))["moves"] == []


def test_a_gang_gets_room_for_every_instance() -> None:
    nodes = [*SPLIT, node("n3", used={0, 1, 2, 3, 4})]
    blocks = [*SPLIT_BLOCKS, blk("e", {"e-0": ("n3", [0, 1, 2, 3])}), blk("f", {"f-0": ("n3", [4])})]
    out = plan(inp(nodes, blocks, [want(4, n=2)]))
    assert len(out["moves"]) == 2 and sum(out["fits"].values()) == 2
    assert plan(inp(nodes, blocks, [want(4, n=2)], k=1))["moves"] == []  # two rooms need two moves


def test_contract_refuses_a_wrong_shape() -> None:
    for bad in (None, {}, {"moves": {}}, {"moves": [{"instance_id": "a"}]},
                {"moves": [{"instance_id": "a", "from": "n1", "to": "n1"}]}):
        with pytest.raises(contract.WrongShape):
            contract.check("rebalance", bad)
    contract.check("rebalance", {"moves": []})


def test_uri_slot_and_policy_test_summary() -> None:
    assert uri_problem("builtin:rebalance-min", "rebalancer") is None
    assert "not a resourceAllocator" in (uri_problem("builtin:rebalance-min", "resourceAllocator") or "")
    out = plan(inp(SPLIT, SPLIT_BLOCKS, [want(4)]))
    m = out["moves"][0]
    assert summarize("rebalance", out) == f"{m['instance_id']}:{m['from']}->{m['to']}"
    assert summarize("rebalance", {"moves": []}) == "no move"


def test_runs_through_the_policy_runtime() -> None:
    rt = PolicyRuntime()
    rule = {"name": "rebalancer", "policyRuleURI": "builtin:rebalance-min"}
    out = asyncio.run(rt.invoke(rule, "t", inp(SPLIT, SPLIT_BLOCKS, [want(4)]), {}))
    assert len(out["moves"]) == 1


def test_no_room_is_made_by_spoiling_a_better_hole() -> None:
    # the only target for the 1-GPU instance is an idle node of another model, kept whole for the
    # workload's 8-GPU tasks: the move would free a 4-GPU room at a higher cost, so none is made
    nodes = [node("n1", used={0, 1, 2, 3, 4}), node("n2", model="B"), node("n3", gpus=4, used={0, 1, 2, 3})]
    blocks = [blk("a", {"a-0": ("n1", [0, 1, 2, 3])}, preemptible=False), blk("b", {"b-0": ("n1", [4])}),
              blk("c", {"c-0": ("n3", [0, 1, 2, 3])}, preemptible=False)]
    pending = [{"block_id": "p", "priority": 100, "minInstances": 1, "resources": {"gpus": 4, "gpuModels": ["A100"]}}]
    wl = [{"gpus": 8, "gpuModels": ["B"], "weight": 0.9}, {"gpus": 4, "gpuModels": ["A100"], "weight": 0.1}]
    out = plan({**inp(nodes, blocks, pending), "workload": wl})
    assert out["moves"] == [], out
    # with a workload that does not need the idle node whole, the same move is made
    out = plan({**inp(nodes, blocks, pending), "workload": [{"gpus": 4, "gpuModels": ["A100"], "weight": 1}]})
    assert [m["instance_id"] for m in out["moves"]] == ["b-0"]
