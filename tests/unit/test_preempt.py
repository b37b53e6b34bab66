"""``builtin:preempt-min`` (issue 36): the default preemption policy, case by case."""

from __future__ import annotations

import asyncio
from typing import Any

from aios_blocks.handlers.policy_test import summarize
from aios_blocks.policies import contract
from aios_blocks.policies.builtin.preempt import plan
from aios_blocks.policies.runtime import PolicyRuntime
from aios_blocks.schemas.uris import uri_problem


def node(nid: str, gpus: int = 8, free: set[int] | None = None, model: str = "A100") -> tuple[str, dict[str, Any]]:
    free = set(range(gpus)) if free is None else free
    return nid, {"cpu_free": 64, "mem_free": 512 * 1024,
                 "gpus": {f"{nid}-g{g}": {"model": model, "free": 1.0 if g in free else 0.0} for g in range(gpus)}}


def cand(bid: str, priority: int, placed: dict[str, tuple[str, list[int]]], min_instances: int = 1,
         created: float = 0.0, preemptible: bool | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {
        "block_id": bid, "priority": priority, "created": created, "minInstances": min_instances,
        "instances": {iid: {"node_id": n, "gpus": [f"{n}-g{g}" for g in gs], "share": 1.0, "cpu": 0, "memory": 0,
                            "created": created} for iid, (n, gs) in placed.items()},
    }
    if preemptible is not None:
        c["preemptible"] = preemptible
    return c


def inp(gpus: int, priority: int, nodes: list[tuple[str, dict[str, Any]]], cands: list[dict[str, Any]],
        min_instances: int = 1, delta: int = 10) -> dict[str, Any]:
    return {"action": "preempt", "minDelta": delta,
            "block": {"block_id": "p", "priority": priority, "minInstances": min_instances, "resources": {"gpus": gpus}},
            "cluster": {"cluster_id": "c1", "nodes": dict(nodes)}, "candidates": cands}


FULL = [node("n1", free=set()), node("n2", free=set())]


def test_a_block_that_fits_preempts_nothing() -> None:
    out = plan(inp(2, 100, [node("n1")], []))
    assert out["victims"] == {} and out["fits"] == {"n1": 1}


def test_only_blocks_min_delta_lower_are_victims() -> None:
    c = [cand("near", 95, {"near-0": ("n1", list(range(8)))}), cand("far", 50, {"far-0": ("n2", list(range(8)))})]
    out = plan(inp(8, 100, FULL, c))
    assert out["blocks"] == {"far": ["far-0"]}
    # with only the near one (5 points below): nothing
    assert plan(inp(8, 100, FULL, c[:1]))["victims"] == {}
    assert plan(inp(8, 100, FULL, c[:1], delta=5))["blocks"] == {"near": ["near-0"]}


def test_never_a_block_that_is_not_preemptible() -> None:
    c = [cand("keep", 0, {"keep-0": ("n1", list(range(8)))}, preemptible=False),
         cand("go", 0, {"go-0": ("n2", list(range(8)))})]
    assert plan(inp(8, 100, FULL, c))["blocks"] == {"go": ["go-0"]}
    assert plan(inp(8, 100, FULL, c[:1]))["victims"] == {}


def test_lowest_priority_then_fewest_then_youngest() -> None:
    c = [cand("old", 10, {"old-0": ("n1", list(range(8)))}, created=1.0),
         cand("young", 10, {"young-0": ("n2", list(range(8)))}, created=2.0),
         ]
    assert plan(inp(8, 100, FULL, c))["blocks"] == {"young": ["young-0"]}
    # a lower priority wins over youth
    c.append(cand("low", 5, {"low-0": ("n1", [0, 1, 2, 3]), "low-1": ("n1", [4, 5, 6, 7])}, min_instances=2))
    c[0] = cand("old", 10, {"old-0": ("n3", list(range(8)))}, created=1.0)
    nodes = [*FULL, node("n3", free=set())]
    assert plan(inp(8, 100, nodes, c))["blocks"] == {"low": ["low-0", "low-1"]}
    # fewest: one 8-GPU instance rather than eight 1-GPU ones of the same priority
    small = cand("small", 10, {f"s{g}": ("n1", [g]) for g in range(8)}, min_instances=0, created=5.0)
    big = cand("big", 10, {"big-0": ("n2", list(range(8)))}, created=0.0)
    assert plan(inp(8, 100, FULL, [small, big]))["blocks"] == {"big": ["big-0"]}


def test_a_victim_pushed_below_its_min_instances_goes_whole() -> None:
    # a gang of four 1-GPU instances (min 4) on n1 beside a block that stays: the preemptor needs 2
    # GPUs, so the gang goes whole (4 instances), not 2 of them
    keep = cand("keep", 100, {"k0": ("n1", [4, 5, 6, 7]), "k1": ("n2", list(range(8)))})
    placed = {f"g{i}": ("n1", [i]) for i in range(4)}
    out = plan(inp(2, 100, FULL, [keep, cand("gang", 0, placed, min_instances=4)]))
    assert out["blocks"] == {"gang": ["g0", "g1", "g2", "g3"]} and out["gpus_freed"] == 4
    # min 2 of 4: its surplus goes one by one, two instances are enough (the youngest first)
    young = {f"g{i}": ("n1", [i]) for i in range(4)}
    c = cand("gang", 0, young, min_instances=2)
    for i, inst in enumerate(c["instances"].values()):
        inst["created"] = float(i)
    out = plan(inp(2, 100, FULL, [keep, c]))
    assert out["blocks"] == {"gang": ["g2", "g3"]}


def test_gang_aware_the_whole_preemptor_must_fit_after() -> None:
    # the preemptor needs 3 x 8 GPUs; only two nodes' worth is preemptible: nothing is evicted
    c = [cand("a", 0, {"a-0": ("n1", list(range(8)))}), cand("b", 0, {"b-0": ("n2", list(range(8)))})]
    out = plan(inp(8, 100, FULL, c, min_instances=3))
    assert out["victims"] == {} and "does not fit" in out["reason"]
    out = plan(inp(8, 100, FULL, c, min_instances=2))
    assert out["fits"] == {"n1": 1, "n2": 1} and len(out["blocks"]) == 2


def test_a_plan_freeing_more_than_the_need_plus_one_node_is_refused() -> None:
    # the only victim is a 2-node gang of 16 GPUs; the preemptor needs 1 GPU on 4-GPU nodes... 16 > 1 + 8
    nodes = [node("n1", free=set()), node("n2", free=set()), node("n3", free=set())]
    gang = cand("gang", 0, {"g0": ("n1", list(range(8))), "g1": ("n2", list(range(8))), "g2": ("n3", list(range(8)))},
                min_instances=3)
    out = plan(inp(1, 100, nodes, [gang]))
    assert out["victims"] == {} and "frees more" in out["reason"]


def test_gpu_models_and_shares() -> None:
    nodes = [node("n1", free=set(), model="T4"), node("n2", free=set(), model="A100")]
    c = [cand("t4", 0, {"t4-0": ("n1", list(range(8)))}, created=9.0), cand("a100", 0, {"a100-0": ("n2", list(range(8)))})]
    i = inp(1, 100, nodes, c)
    i["block"]["resources"]["gpuModels"] = ["A100"]
    assert plan(i)["blocks"] == {"a100": ["a100-0"]}
    # a shared GPU: a quarter free + a victim holding a half = room for a 0.7 share
    n = {"cpu_free": 64, "mem_free": 1024, "gpus": {"g": {"model": "A100", "free": 0.25}}}
    v = {"block_id": "v", "priority": 0, "minInstances": 0,
         "instances": {"v-0": {"node_id": "n1", "gpus": ["g"], "share": 0.5}}}
    s = {"action": "preempt", "block": {"priority": 50, "minInstances": 1, "resources": {"gpus": 1, "gpuShare": 0.7}},
         "cluster": {"nodes": {"n1": n}}, "candidates": [v]}
    assert plan(s)["victims"] == {"n1": ["v-0"]}


def test_it_is_a_policy_kind_with_a_contract() -> None:
    assert uri_problem("builtin:preempt-min", "preemption") is None
    assert "not a resourceAllocator" in (uri_problem("builtin:preempt-min", "resourceAllocator") or "")
    c = [cand("a", 0, {"a-0": ("n1", list(range(8)))})]
    rule = {"name": "preemption", "policyRuleURI": "builtin:preempt-min"}
    out = asyncio.run(PolicyRuntime().invoke(rule, "t", inp(8, 100, FULL, c), {}))
    assert out["victims"] == {"n1": ["a-0"]}
    contract.check("preempt", {"victims": {}})
    for bad in ({}, {"victims": {"n1": "a-0"}}, {"victims": {"n1": [""]}}):
        try:
            contract.check("preempt", bad)
        except contract.WrongShape:
            continue
        raise AssertionError(bad)
    assert summarize("preempt", out) == "a-0" and summarize("preempt", {"victims": {}}) == "no preemption"


def test_the_input_is_built_from_the_state_views() -> None:
    from aios_blocks.handlers.preemption import gpu_free, preempt_input

    assert gpu_free({"instances": 0}) == 1.0 and gpu_free({"instances": 1, "exclusive": True}) == 0.0
    assert gpu_free({"instances": 2, "exclusive": False, "share_free": 250}) == 0.25
    views = {"n1": {"healthy": True, "cpu_free": 4, "memory_free": 100,
                    "gpus": [{"id": "g0", "model": "A100", "instances": 1, "exclusive": True}]},
             "n2": {"healthy": False, "gpus": []}}
    placed: list[dict[str, Any]] = [{"block_id": "v", "created": 7, "ir": {"priority": 5, "minInstances": 1, "preemptible": False,
                                                    "resources": {"gpus": 1, "cpu": 2}},
               "instances": {"v-0": {"node": "n1", "gpus": ["g0"]}, "v-1": {"node": "elsewhere", "gpus": ["x"]}}},
              {"block_id": "me", "ir": {}, "instances": {"me-0": {"node": "n1", "gpus": []}}}]
    i = preempt_input("me", {"priority": 100, "minInstances": 1, "resources": {"gpus": 1}}, "c1", views, placed, 10)
    assert list(i["cluster"]["nodes"]) == ["n1"] and i["cluster"]["nodes"]["n1"]["gpus"]["g0"]["free"] == 0.0
    (c,) = i["candidates"]
    assert c["block_id"] == "v" and c["preemptible"] is False and list(c["instances"]) == ["v-0"]
    assert c["instances"]["v-0"]["share"] == 1.0 and i["minDelta"] == 10 and i["block"]["priority"] == 100


def test_a_plan_becomes_the_preempted_and_preempting_events() -> None:
    from aios_blocks.handlers.preemption import events
    from aios_blocks.schemas.catalog import E

    gang = cand("gang", 0, {"g0": ("n1", [0, 1, 2, 3]), "g1": ("n1", [4, 5, 6, 7])}, min_instances=2)
    gang["gen"] = 3
    data = inp(8, 100, FULL, [gang])
    data["block"]["block_id"] = "urgent"
    out = plan(data)
    emits = events(data, out, gen=9, request_id="r1")
    assert [e.event for e in emits] == [E.block_preempted, E.block_preempting]
    victim, preemptor = emits
    assert victim.subject() == "aios.block.gang.preempted" and victim.logical_id() == "gang:3:preempted:urgent:9"
    assert victim.payload.reason == "Priority" and victim.payload.instances == {"g0": "n1", "g1": "n1"}
    assert victim.payload.priority == 0 and victim.payload.preemptor_priority == 100
    assert preemptor.subject() == "aios.block.urgent.preempting" and preemptor.logical_id() == "urgent:9:preempting:r1"
    assert preemptor.payload.victims == {"gang": ["g0", "g1"]} and preemptor.payload.gpus_freed == 8
    assert events(data, {"victims": {}}, gen=9, request_id="r2") == []


def test_a_preempted_block_that_waits_never_preempts() -> None:
    """The marker the controller sets on a victim that waits (``block.preemptedBy``): no victims,
    whatever its priority (no cascades, issue 36)."""
    from aios_blocks.handlers.preemption import preempt_input

    views = {"n0": {"healthy": True, "cpu_free": 8, "memory_free": 1 << 20,
                    "gpus": [{"id": "n0-g0", "model": "m", "instances": 1, "exclusive": True}]}}
    placed = [{"block_id": "lo", "gen": 1, "created": 1.0, "ir": {"priority": 0, "minInstances": 1,
                                                                   "resources": {"gpus": 1}},
               "instances": {"lo-0": {"node": "n0", "gpus": ["n0-g0"]}}}]
    ir = {"priority": 1000, "minInstances": 1, "resources": {"gpus": 1}}
    assert plan(preempt_input("hi", ir, "c", views, placed, 10))["victims"] == {"n0": ["lo-0"]}
    out = plan(preempt_input("hi", ir, "c", views, placed, 10, preempted_by="top"))
    assert out["victims"] == {} and "preempted by top" in out["reason"]


def _cpu_node(nid: str, cpu_free: float, mem_free: float, free_gpus: int, gpus: int = 8) -> tuple[str, dict[str, Any]]:
    return nid, {"cpu_free": cpu_free, "mem_free": mem_free,
                 "gpus": {f"{nid}-g{g}": {"model": "G2", "free": 1.0 if g < free_gpus else 0.0} for g in range(gpus)}}


def _holder(bid: str, priority: int, nid: str, gpus: list[int], cpu: float, memory: float,
            created: float = 0.0) -> dict[str, Any]:
    """A block of one instance on ``nid`` holding ``gpus`` (none: a CPU-only block), CPU and memory."""
    return {"block_id": bid, "priority": priority, "created": created, "minInstances": 1,
            "instances": {f"{bid}-0": {"node_id": nid, "gpus": [f"{nid}-g{g}" for g in gpus], "share": 1.0,
                                       "cpu": cpu, "memory": memory, "created": created}}}


def _cpu_inp(gpus: int, cpu: float, memory: float, nodes: list[tuple[str, dict[str, Any]]],
             cands: list[dict[str, Any]], priority: int = 1000) -> dict[str, Any]:
    return {"action": "preempt", "minDelta": 10,
            "block": {"block_id": "p", "priority": priority, "minInstances": 1,
                      "resources": {"gpus": gpus, "cpu": cpu, "memory": memory}},
            "cluster": {"cluster_id": "c1", "nodes": dict(nodes)}, "candidates": cands}


def test_a_cpu_only_victim_frees_the_cpu_a_node_lacks() -> None:
    """The GPUs are free, the CPU is not: the victim is the lower CPU-only block that holds it (0 GPUs
    freed), not a GPU holder elsewhere; memory the same (the trace's 8-GPU LS task: 64 CPUs, 257 GiB
    on a 96-CPU, 384 GiB node). Fails when the planner does not give a victim's CPU or memory back."""
    nodes = [_cpu_node("n1", cpu_free=40, mem_free=300_000, free_gpus=8), _cpu_node("n2", 96, 393_216, free_gpus=0)]
    cands = [_holder("cpu-be", 0, "n1", [], cpu=32, memory=1024), _holder("gpu-be", 0, "n2", list(range(8)), 8, 1024)]
    out = plan(_cpu_inp(8, 64, 263_168, nodes, cands[:1]))
    assert out["blocks"] == {"cpu-be": ["cpu-be-0"]} and out["gpus_freed"] == 0 and out["fits"] == {"n1": 1}
    # n2's GPU holder frees a whole node too: the planner still takes the one that frees no GPU
    # (fewest GPUs freed), here both free enough
    nodes[1] = _cpu_node("n2", 96, 393_216, free_gpus=0)
    assert plan(_cpu_inp(8, 64, 263_168, nodes, cands))["blocks"] == {"cpu-be": ["cpu-be-0"]}
    # memory the binding resource
    mem_nodes = [_cpu_node("n1", cpu_free=96, mem_free=100_000, free_gpus=8)]
    mem = [_holder("mem-be", 0, "n1", [], cpu=8, memory=200_000)]
    assert plan(_cpu_inp(8, 64, 263_168, mem_nodes, mem))["blocks"] == {"mem-be": ["mem-be-0"]}


def test_gpus_from_one_victim_cpu_from_another_on_the_same_node() -> None:
    """n1's GPUs held by a lower GPU block, its CPU by a lower CPU-only block: both go (neither alone
    is enough); a same-priority CPU-only block holding the CPU instead leaves no victim (the delta
    rule), and an idle node elsewhere with the GPUs but not the CPU changes nothing."""
    nodes = [_cpu_node("n1", cpu_free=0, mem_free=393_216, free_gpus=0), _cpu_node("n2", 8, 393_216, free_gpus=8)]
    gpu_lo = _holder("gpu-lo", 0, "n1", list(range(8)), cpu=8, memory=1024, created=1.0)
    cpu_lo = _holder("cpu-lo", 100, "n1", [], cpu=56, memory=1024, created=2.0)
    ls = _holder("cpu-ls", 1000, "n1", [], cpu=32, memory=1024)
    out = plan(_cpu_inp(8, 64, 1024, nodes, [gpu_lo, cpu_lo, ls]))
    assert out["blocks"] == {"cpu-lo": ["cpu-lo-0"], "gpu-lo": ["gpu-lo-0"]} and out["gpus_freed"] == 8
    assert out["fits"] == {"n1": 1}
    same = {**cpu_lo, "priority": 995}
    out = plan(_cpu_inp(8, 64, 1024, nodes, [gpu_lo, same, ls]))
    assert out["victims"] == {} and out["reason"] == "the block does not fit even with every lower-priority block gone"
    keep = {**cpu_lo, "preemptible": False}
    assert plan(_cpu_inp(8, 64, 1024, nodes, [gpu_lo, keep, ls]))["victims"] == {}


def test_a_cpu_only_preemptor_takes_the_lowest_youngest_cpu_holder() -> None:
    """A CPU-only preemptor (636 LS tasks of multigpu50 ask no GPU): the lowest priority, then the
    youngest holder of enough CPU; a GPU holder is taken only when it frees the CPU, within the bound."""
    nodes = [_cpu_node("n1", cpu_free=4, mem_free=393_216, free_gpus=0)]
    old = _holder("old", 0, "n1", [], cpu=16, memory=1024, created=1.0)
    young = _holder("young", 0, "n1", [], cpu=16, memory=1024, created=5.0)
    burst = _holder("burst", 100, "n1", [], cpu=16, memory=1024, created=9.0)
    assert plan(_cpu_inp(0, 12, 1024, nodes, [burst, old, young]))["blocks"] == {"young": ["young-0"]}
    gpu = _holder("gpu", 0, "n1", list(range(8)), cpu=16, memory=1024)
    out = plan(_cpu_inp(0, 12, 1024, nodes, [gpu]))
    assert out["blocks"] == {"gpu": ["gpu-0"]} and out["gpus_freed"] == 8  # 8 <= 0 + one node's 8
