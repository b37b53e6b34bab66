"""``builtin:rebalance-min`` (issue 38) when CPU or memory, not GPUs, keeps a pending block out:
the planner looks for the room where moving an instance off frees what blocks it."""

from __future__ import annotations

from typing import Any

from aios_blocks.policies.builtin.rebalance import plan


def node(nid: str, used: set[int], cpu: float, mem: float = 512 * 1024, gpus: int = 8) -> tuple[str, dict[str, Any]]:
    return nid, {"cpu_free": cpu, "mem_free": mem,
                 "gpus": {f"{nid}-g{g}": {"model": "A100", "free": 0.0 if g in used else 1.0} for g in range(gpus)}}


def blk(bid: str, nid: str, gpus: list[int], cpu: float, mem: float = 0.0) -> dict[str, Any]:
    return {"block_id": bid, "priority": 0, "created": 0.0, "minInstances": 1, "moving": 0,
            "instances": {f"{bid}-0": {"node_id": nid, "gpus": [f"{nid}-g{g}" for g in gpus], "share": 1.0,
                                       "cpu": cpu, "memory": mem}}}


def inp(nodes: list[tuple[str, dict[str, Any]]], movable: list[dict[str, Any]], resources: dict[str, Any]) -> dict[str, Any]:
    return {"action": "rebalance", "maxMoves": 2, "trigger": "pending",
            "cluster": {"cluster_id": "c1", "nodes": dict(nodes)}, "movable": movable,
            "pending": [{"block_id": "p", "priority": 100, "minInstances": 1, "resources": resources}]}


def crowded(short: str) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """30 nodes (a00..a29, first by name) with 4 GPUs free and their CPU and memory all held by a
    4-GPU instance that fits nowhere else; m0 with 7 GPUs free, short of ``short`` (CPU or memory)
    by half of what the pending block needs, held by a 1-GPU instance; z9 with room for that one."""
    nodes, movable = [], []
    for k in range(30):
        nid = f"a{k:02d}"
        nodes.append(node(nid, {0, 1, 2, 3}, cpu=0, mem=0))
        movable.append(blk(f"x{k}", nid, [0, 1, 2, 3], cpu=64, mem=512 * 1024))
    cpu, mem = (8.0, 512 * 1024.0) if short == "cpu" else (64.0, 8 * 1024.0)
    nodes.append(node("m0", {0}, cpu=cpu, mem=mem))
    movable.append(blk("s", "m0", [0], cpu=16, mem=16 * 1024))
    nodes.append(node("z9", {0, 1, 2, 3, 4, 5, 6}, cpu=40, mem=256 * 1024))
    movable.append(blk("t", "z9", [0, 1, 2, 3, 4, 5, 6], cpu=8, mem=8 * 1024))
    return nodes, movable


def test_a_block_kept_out_by_cpu_gets_the_move_that_frees_cpu_where_its_gpus_are() -> None:
    # every node has the 4 GPUs free; only m0's CPU can be freed (moving s, 16 CPU, to z9): the
    # planner must look there, not only at the nodes closest by GPUs (all 0 short here) by name
    out = plan(inp(*crowded("cpu"), {"gpus": 4, "cpu": 16}))
    assert [(m["instance_id"], m["from"], m["to"]) for m in out["moves"]] == [("s-0", "m0", "z9")], out
    assert out["for"] == "p" and out["fits"] == {"m0": 1}
    assert "frees 1 GPU(s), 16 CPU, 16384 MiB of memory on m0" in out["moves"][0]["reason"]


def test_a_block_kept_out_by_memory_gets_the_move_that_frees_memory() -> None:
    out = plan(inp(*crowded("mem"), {"gpus": 4, "cpu": 1, "memory": 16 * 1024}))
    assert [(m["instance_id"], m["from"], m["to"]) for m in out["moves"]] == [("s-0", "m0", "z9")], out
    assert "16384 MiB of memory" in out["moves"][0]["reason"]


def test_no_move_when_no_instance_there_holds_enough_cpu() -> None:
    # m0 short of 8 CPU, but s holds only 4: nothing it can free makes room
    nodes, movable = crowded("cpu")
    movable[-2] = blk("s", "m0", [0], cpu=4)
    out = plan(inp(nodes, movable, {"gpus": 4, "cpu": 16}))
    assert out["moves"] == [], out


def test_the_instances_that_free_the_cpu_are_among_the_subsets_tried() -> None:
    # m0 (GPUs free) is short of 20 CPU: 30 young 0.5-CPU instances and the two oldest hold 12
    # each; only that pair frees enough (size 1: 12 < 20), and it is the last of the 435 pairs in
    # the old order (youngest first), beyond the 256 subsets tried per size
    nodes = [node("m0", {0}, cpu=0), node("z9", {0, 1, 2, 3, 4, 5, 6}, cpu=60)]
    movable = [blk("g", "m0", [0], cpu=1)]
    movable += [{**blk(f"c{k:02d}", "m0", [], cpu=0.5), "created": 100.0 + k} for k in range(30)]
    movable += [{**blk(f"h{k}", "m0", [], cpu=12), "created": float(k)} for k in range(2)]
    out = plan(inp(nodes, movable, {"gpus": 4, "cpu": 20}))
    assert sorted(m["instance_id"] for m in out["moves"]) == ["h0-0", "h1-0"], out
    assert out["fits"] == {"m0": 1}
