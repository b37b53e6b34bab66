"""The preemption and rebalance planners count each GPU's memory as the placement does (issue 38):
``gpuMemory`` (MiB an instance needs of each GPU) binds where GPUs that still have compute free
have too little memory free, and a victim or a moved instance gives its GPUs back the memory it
held. The placement's own check (``policies.capacity.node_fits`` on node views kept with
``capacity.take`` and the replay's ``release``) is the reference every answer is checked against.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from aios_blocks.handlers import preemption as pre
from aios_blocks.handlers import rebalance as hr
from aios_blocks.policies import capacity
from aios_blocks.policies.builtin import preempt
from aios_blocks.policies.builtin import rebalance as rb
from aios_blocks.schemas.records import NodeView
from aios_blocks.schemas.spec import Gpu, Node
from aios_blocks.trace.online import release
from aios_blocks.trace.replay import views_of

A100 = 40960  # MiB of an A100-40GB
GIB = 1024


def cluster(nodes: int, gpus: int = 8, models: tuple[str, ...] = ("A100",)) -> dict[str, NodeView]:
    """``nodes`` nodes of ``gpus`` 40 GiB GPUs, node k's of model ``models[k]`` (the last for the rest)."""
    return dict(views_of([Node(id=f"n{k}", cluster="c1", gpus=[Gpu(id=f"n{k}-g{g}", model=models[min(k, len(models) - 1)],
                                                                   memory=A100) for g in range(gpus)])
                          for k in range(nodes)]))


def ir(bid: str, gpus: int, share: float = 0.0, gpu_memory: int = 0, sharing: bool = True, priority: int = 0,
       preemptible: bool = True, models: list[str] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"gpus": gpus, "gpuMemory": gpu_memory, "cpu": 1.0, "memory": 1024}
    if share:
        res["gpuShare"] = share
    if models:
        res["gpuModels"] = models
    return {"blockId": bid, "priority": priority, "minInstances": 1, "resources": res, "preemptible": preemptible,
            "policies": {"resourceAllocator": {"policyRuleURI": "builtin:spread", "settings": {"gpuSharing": sharing}}}}


def put(views: dict[str, NodeView], rows: list[dict[str, Any]], b: dict[str, Any], nid: str, gpus: list[str]) -> None:
    """Place block ``b``'s one instance on ``gpus`` of ``nid`` (the placement's ``take``) and list it."""
    v = views[nid] = capacity.copy_node(views[nid])
    capacity.take(v, gpus, b["resources"], sharing(b))
    rows.append({"block_id": b["blockId"], "ir": b, "created": float(len(rows)), "gen": 1, "status": "ready",
                 "instances": {f"{b['blockId']}-0": {"node": nid, "gpus": gpus, "status": "running"}}})


def sharing(b: dict[str, Any]) -> bool:
    return bool(b["policies"]["resourceAllocator"]["settings"]["gpuSharing"])


def usable(view: NodeView, b: dict[str, Any]) -> list[str]:
    return [g["id"] for g in capacity.node_fits(view, b["resources"], sharing(b)) or []]


def remove(views: dict[str, NodeView], rows: list[dict[str, Any]], iids: set[str]) -> None:
    """The instances ``iids`` gone (the replay's ``release``, the inverse of ``take``)."""
    for r in rows:
        for iid, i in list(r["instances"].items()):
            if iid in iids:
                views[i["node"]] = release(views[i["node"]], i["gpus"], r["ir"]["resources"], sharing(r["ir"]))
                del r["instances"][iid]


def test_node_fits_counts_each_gpus_free_memory() -> None:
    # 8 A100-40GB, each shared by a 0.25 / 8 GiB instance: 0.75 of each GPU's compute is free, but
    # only 32 GiB of its memory: a gang that needs 40 GiB of each GPU fits on none of them
    gpu = {"model": "A100", "free": 0.75, "memory": A100, "memory_free": A100 - 8 * GIB, "instances": 1, "exclusive": False}
    (n,) = preempt._nodes({"nodes": {"n1": {"cpu_free": 64, "mem_free": 1 << 20,
                                            "gpus": {f"g{g}": dict(gpu) for g in range(8)}}}}).values()
    gang = preempt.need_of({"minInstances": 1, "gpuSharing": True,
                            "resources": {"gpus": 2, "gpuShare": 0.5, "gpuMemory": A100}})
    assert preempt.node_fits(n, gang, 4) == 0
    assert preempt.node_fits(n, replace(gang, gpu_memory=16 * GIB), 8) == 4  # compute binds: one 0.5 per GPU
    assert preempt.node_fits(n, replace(gang, share=0.25, gpu_memory=16 * GIB), 8) == 8  # memory: 2 x 16 per GPU
    # an exclusive instance: only an empty GPU, and one of at least its gpuMemory
    whole = preempt.need_of({"gpuSharing": False, "resources": {"gpus": 1, "gpuMemory": A100}})
    assert preempt.node_fits(n, whole, 8) == 0
    empty = {"model": "A100", "free": 1.0, "memory": A100, "memory_free": A100, "instances": 0, "exclusive": False}
    (e,) = preempt._nodes({"nodes": {"n2": {"cpu_free": 64, "mem_free": 1 << 20, "gpus": {"g0": empty}}}}).values()
    assert preempt.node_fits(e, whole, 8) == 1
    assert preempt.node_fits(e, replace(whole, gpu_memory=2 * A100), 8) == 0
    # the old shape (no memory, no instances): as before, memory never binds
    (o,) = preempt._nodes({"nodes": {"n3": {"cpu_free": 64, "mem_free": 1 << 20,
                                            "gpus": {"g0": {"model": "A100", "free": 0.75}}}}}).values()
    assert preempt.node_fits(o, preempt.need_of({"resources": {"gpus": 1, "gpuShare": 0.5, "gpuMemory": A100}}), 8) == 1


SHAPES = [(0.25, 4 * GIB), (0.5, 8 * GIB), (0.0, 20 * GIB), (0.125, 0), (0.0, 36 * GIB), (0.5, 0)]


def test_the_planner_agrees_with_the_placement_on_random_states_and_evictions() -> None:
    """On 300 seeded random nodes (GPUs of 16, 40 and 80 GiB; sharing and exclusive instances
    placed by the placement's ``take``), and again once a random part of their instances is gone
    (the planner's release against the replay's), the planner's answer "one instance fits" is the
    placement's, for sharing and exclusive needs of every shape."""
    rnd = random.Random(38)
    needs = [ir("q", g, s, m, sh) for g in (1, 2) for s, m in [*SHAPES, (0.75, A100), (0.25, 2 * A100)] for sh in (True, False)
             if sh or s == 0.0]
    checked = 0
    for k in range(300):
        views = dict(views_of([Node(id="n0", cluster="c1", gpus=[Gpu(id=f"g{g}", model="A100", memory=m)
                                                                 for g, m in enumerate([16 * GIB, A100, A100, 2 * A100])])]))
        rows: list[dict[str, Any]] = []
        for j in range(rnd.randrange(1, 9)):
            share, mem = rnd.choice(SHAPES)
            b = ir(f"b{k}x{j}", 1, share, mem, sharing=rnd.random() < 0.8)
            gpus = usable(views["n0"], b)
            if gpus:
                put(views, rows, b, "n0", [rnd.choice(gpus)])
        gone = {iid for r in rows for iid in r["instances"] if rnd.random() < 0.4}
        data = pre.preempt_input("q", needs[0], "c1", views, rows, 0)
        plan = preempt._Plan(preempt._nodes(data["cluster"]), {iid: i for c in data["candidates"]
                                                              for iid, i in c["instances"].items()}, preempt.need_of(data["block"]))
        after = plan.after(gone).get("n0", plan.base["n0"])
        before = views["n0"]
        remove(views, rows, gone)
        for q in needs:
            need = preempt.need_of(pre.block_input("q", q))
            for node, view in ((plan.base["n0"], before), (after, views["n0"])):
                assert (preempt.node_fits(node, need, 1) == 1) == (len(usable(view, q)) >= q["resources"]["gpus"]), (
                    k, q["resources"], sharing(q), view["gpus"], node.gpus)
                checked += 1
    assert checked == 2 * 300 * len(needs)


def test_the_rebalancer_makes_room_by_freeing_the_memory_of_the_gpus_the_gang_gets() -> None:
    """n0: 8 A100-40GB each shared by a 0.25 / 8 GiB instance (0.75 of compute free, 32 GiB of
    memory); n1: 8 empty GPUs of another model (room for the small sharers, not for the gang, which
    asks for A100s). A gang of 2 GPUs x (0.5, 40 GiB) fits nowhere until two small sharers leave
    two GPUs of n0: the plan must say so, and its moves must make the room the placement sees."""
    views, rows = cluster(2, models=("A100", "L40")), []
    for g in range(8):
        put(views, rows, ir(f"s{g}", 1, 0.25, 8 * GIB), "n0", [f"n0-g{g}"])
    gang = ir("p", 2, 0.5, A100, models=["A100"])
    assert not usable(views["n0"], gang) and not usable(views["n1"], gang)
    out = rb.plan(hr.rebalance_input("c1", views, rows, [{"ir": gang}], 4, hr.Trigger.MANUAL))
    assert out["for"] == "p" and len(out["moves"]) == 2 and out["fits"] == {"n0": 1}, out
    by_iid = {iid: r for r in rows for iid in r["instances"]}
    for m in out["moves"]:  # each move as the placement does it: the target takes it, the source gives it back
        r = by_iid[m["instance_id"]]
        assert m["from"] == "n0" and m["to"] == "n1" and set(m["to_gpus"]) <= set(usable(views["n1"], r["ir"]))
        assert "frees 0.25 GPU(s), 1 CPU, 1024 MiB of memory, 8192 MiB of each GPU's memory on n0" in m["reason"], m
        remove(views, rows, {m["instance_id"]})
        put(views, rows, r["ir"], m["to"], m["to_gpus"])
    assert len(usable(views["n0"], gang)) == 2, views["n0"]["gpus"]


def test_no_plan_claims_a_gang_fits_where_no_gpu_has_its_memory_free() -> None:
    # every GPU keeps 0.75 of its compute but 32 GiB of memory, and nothing may move: no moves,
    # and no "fits" (before: "p fits without moves", the block then waiting for good)
    views, rows = cluster(2), []
    for k in range(2):
        for g in range(8):
            put(views, rows, ir(f"s{k}{g}", 1, 0.25, 8 * GIB, preemptible=False), f"n{k}", [f"n{k}-g{g}"])
    out = rb.plan(hr.rebalance_input("c1", views, rows, [{"ir": ir("p", 2, 0.5, A100)}], 4, hr.Trigger.MANUAL))
    assert out["moves"] == [] and out["fits"] == {} and "p fits without moves" not in out["reason"], out


def test_preemption_evicts_what_frees_the_memory_not_only_the_compute() -> None:
    """Each of n0's 2 GPUs holds x (0.25 / 4 GiB) and y (0.5 / 32 GiB), both of priority 0: 0.25
    of compute and 4 GiB of memory free. A 0.5 / 40 GiB instance at priority 100: evicting x alone
    frees 0.5 of compute but only 8 GiB (the old plan, which then did not fit); both must go."""
    views, rows = cluster(1, gpus=2), []
    for g in range(2):
        put(views, rows, ir(f"x{g}", 1, 0.25, 4 * GIB), "n0", [f"n0-g{g}"])
        put(views, rows, ir(f"y{g}", 1, 0.5, 32 * GIB), "n0", [f"n0-g{g}"])
    p = ir("p", 1, 0.5, A100, priority=100)
    out = preempt.plan(pre.preempt_input("p", p, "c1", views, rows, 10))
    victims = set(out["victims"].get("n0", []))
    assert out["fits"] == {"n0": 1} and len(victims) == 2, out
    remove(views, rows, victims)
    assert usable(views["n0"], p), views["n0"]["gpus"]


def test_a_memory_only_sharer_keeps_its_gpu_from_an_exclusive_instance() -> None:
    # a sharer with gpuMemory and no gpuShare leaves its GPU's compute all free ("free": 1), but
    # the placement gives an exclusive instance only an empty GPU: the planner must evict it
    views, rows = cluster(1, gpus=1), []
    put(views, rows, ir("m", 1, 0.0, 8 * GIB), "n0", ["n0-g0"])
    p = ir("p", 1, sharing=False, priority=100)
    data = pre.preempt_input("p", p, "c1", views, rows, 10)
    assert data["cluster"]["nodes"]["n0"]["gpus"]["n0-g0"]["free"] == 1.0
    out = preempt.plan(data)
    assert out["victims"] == {"n0": ["m-0"]} and out["gpus_freed"] == 0.0, out


def test_blocks_preempt_says_the_gpu_memory_its_victims_free() -> None:
    """``blocks preempt --dry-run`` printed only "GPUs freed" (compute): 0.5 here, though what made
    the room was the 36 GiB of memory the two victims held on n0-g0 (found in a stranger's pass)."""
    from aios_blocks.cli.priority import gpu_memory_freed

    views, rows = cluster(1, gpus=1), []
    put(views, rows, ir("x", 1, 0.25, 4 * GIB), "n0", ["n0-g0"])
    put(views, rows, ir("y", 1, 0.5, 32 * GIB), "n0", ["n0-g0"])
    data = pre.preempt_input("p", ir("p", 1, 0.5, A100, priority=100), "c1", views, rows, 10)
    out = preempt.plan(data)
    by_block = {c["block_id"]: c for c in data["candidates"]}
    assert sorted(out["blocks"]) == ["x", "y"] and gpu_memory_freed(out, by_block) == 36 * GIB, out
