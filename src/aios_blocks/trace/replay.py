"""``blocks trace replay --in-process``: a GPU trace's tasks placed one at a time, never deleted,
on an imported inventory, through the live system's decision code: each task is a block IR
planned by ``handlers.controller.plan`` (payload, node sampling, the resourceAllocator called
through ``PolicyRuntime``, the choice checked by ``check_choice``), its placement applied with
``capacity.take`` (the optimistic twin of the reservation script). No NATS, no Redis, no
lifecycle: capacity planning ("what would my cluster do with this workload and this policy").

Figures (docs/trace.md): the GPU allocation rate (GPU compute held / the cluster's, %) at each
1 % of arrived GPU requests, and FGD's fragmentation measure (free GPU compute a task of the
target workload could not use, % of the cluster's) at the same points.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..policies import capacity
from ..policies.builtin.frag import Workload, gpu_left, node_model
from ..schemas.spec import Node
from .workload import UNITS, Task, inflate, typical_shapes

#: short names for ``--policy`` (any ``builtin:``/``registry:`` resourceAllocator URI works too)
POLICY_NAMES: dict[str, str] = {
    "random": "builtin:random", "dot-product": "builtin:dot-product", "gpu-packing": "builtin:gpu-packing",
    "gpu-clustering": "builtin:gpu-clustering", "best-fit": "builtin:best-fit", "fgd": "builtin:fgd",
    "binpack": "builtin:binpack", "spread": "builtin:spread",
}
#: the anchor's (the artifact's) name of each policy
ANCHOR_NAMES: dict[str, str] = {
    "builtin:random": "Random", "builtin:dot-product": "DotProd", "builtin:gpu-packing": "GpuPacking",
    "builtin:gpu-clustering": "GpuClustering", "builtin:best-fit": "BestFit", "builtin:fgd": "FGD",
}


def policy_uri(name: str) -> str:
    return POLICY_NAMES.get(name, name)


def views_of(nodes: list[Node]) -> capacity.Nodes:
    """Idle node views, made by the store's own ``node_view`` from the hash it would hold."""
    from ..state.store import node_view

    out = capacity.Nodes()
    for n in nodes:
        h = {"spec": n.model_dump_json(), "cpu": str(n.cpu), "memory": str(n.memory), "healthy": "1" if n.healthy else "0"}
        h.update({f"g:{g.id}:total": str(g.memory) for g in n.gpus})
        out[n.id] = node_view(h)
    return out


def cluster_frag(views: dict[str, dict[str, Any]], wl: Workload) -> float:
    """FGD's fragmentation of the cluster: the sum over nodes, in thousandths of a GPU."""
    return sum(wl.frag(node_model(v), float(v["cpu_free"]), gpu_left(v)) for v in views.values())


def failure_reason(views: dict[str, dict[str, Any]], needs: dict[str, Any], share: bool) -> str:
    """Why no node took a task, in a few words (counted by reason). The GPU checks read the
    capacity index kept per shape (``capacity.fitting``), not every node."""
    if capacity.fitting(views, needs, share):
        return "placement refused"  # a node fits: the policy said no (its own reason)
    models = needs.get("gpuModels")
    if models and not any(g.get("model") in models for v in views.values() for g in v["gpus"][:1]):
        return "no GPU of the allowed models"
    if needs.get("gpus") and not capacity.fitting(views, {**needs, "cpu": 0, "memory": 0}, share):
        return "gpu: no node has the GPUs free"
    cpu, mem = needs.get("cpu", 0), needs.get("memory", 0)
    if not any(v["healthy"] and v["cpu_free"] + 1e-9 >= cpu and v["memory_free"] >= mem for v in views.values()):
        return "cpu/memory: no node has them free"
    return "gpu and cpu/memory free on different nodes"


@dataclass
class Result:
    policy: str
    seed: int
    workload: str
    nodes: int
    gpus: int
    inflate: float
    sample_nodes: int
    blocks: int = 0
    placed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    alloc_curve: dict[str, float] = field(default_factory=dict)
    frag_curve: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    #: the GPU allocation rate and the fragmentation when all the tasks have arrived
    alloc_end: float = 0.0
    frag_end: float = 0.0
    arrived_end: float = 0.0

    def at(self, curve: dict[str, float], pct: int) -> float:
        """The figure at ``pct`` % arrived; past the last point reached (the inflated list ends
        just under its target), the figure at the end."""
        return curve.get(str(pct), self.frag_end if curve is self.frag_curve else self.alloc_end)

    def as_dict(self) -> dict[str, Any]:
        top = round(self.inflate * 100)
        out = {
            "policy": self.policy, "seed": self.seed, "workload": self.workload, "nodes": self.nodes, "gpus": self.gpus,
            "inflate": self.inflate, "sample_nodes": self.sample_nodes, "blocks": self.blocks, "placed": self.placed,
            "failed": self.blocks - self.placed, "failures": dict(sorted(self.failures.items())),
            "alloc_at_100": round(self.at(self.alloc_curve, 100), 4), f"alloc_at_{top}": round(self.alloc_end, 4),
            "frag_at_100": round(self.at(self.frag_curve, 100), 4), f"frag_at_{top}": round(self.frag_end, 4),
            "arrived_end": round(self.arrived_end, 4),
            "alloc_curve": self.alloc_curve, "frag_curve": self.frag_curve,
            "seconds": round(self.seconds, 3),
            "placements_per_s": round(self.blocks / self.seconds, 1) if self.seconds else 0.0,
        }
        return out


async def replay(
    nodes: list[Node], tasks: list[Task], policy: str = "builtin:fgd", seed: int = 42, ratio: float = 1.3,
    sample_nodes: int = 0, workload: str = "", progress: Callable[[int, int], None] | None = None,
) -> Result:
    """Place the inflated, shuffled task list one task at a time (see the module's docstring)."""
    from ..handlers import controller
    from ..policies.runtime import PolicyRuntime
    from ..schemas.errors import PlacementFailed

    uri = policy_uri(policy)
    views = views_of(nodes)
    cluster_milli = sum(len(n.gpus) for n in nodes) * UNITS
    if not cluster_milli:
        raise ValueError("the inventory has no GPU: nothing to measure")
    pods = inflate(tasks, cluster_milli, ratio, seed)
    shapes = typical_shapes(tasks)
    wl = Workload(shapes)
    runtime = PolicyRuntime(lookup=None)
    cid = nodes[0].cluster
    cluster = {"id": cid, "labels": {}}
    rules = {
        share: {"name": "resourceAllocator", "policyRuleURI": uri,
                "settings": {"gpuSharing": share, "sampleNodes": sample_nodes},
                "parameters": {"seed": seed, "workload": shapes}}
        for share in (False, True)
    }
    res = Result(uri, seed, workload, len(nodes), cluster_milli // UNITS, ratio, sample_nodes)
    failures: Counter[str] = Counter()
    arrived = allocated = 0
    next_pct = 1
    started = time.perf_counter()
    for i, t in enumerate(pods):
        needs = t.resources()
        share = t.sharing
        rule = rules[share]
        ir = {"blockId": t.name, "blockComponentURI": "aios://trace/task", "minInstances": 1, "maxInstances": 1,
              "resources": needs, "policies": {"resourceAllocator": rule}, "labels": {"qos": t.qos} if t.qos else {}}

        async def invoke(inp: dict[str, Any], rule: dict[str, Any] = rule) -> Any:
            return await runtime.invoke(rule, "resourceAllocator", inp)

        try:
            placements = await controller.plan(ir, cluster, views, "allocation", [f"{t.name}-0"], invoke)
        except PlacementFailed:
            failures[failure_reason(views, needs, share)] += 1
        else:
            p = placements[0]
            node = capacity.copy_node(views[p["node"]])
            capacity.take(node, p["gpus"], needs, share)
            views[p["node"]] = node
            allocated += t.milli_total
            res.placed += 1
        arrived += t.milli_total
        while arrived * 100 >= next_pct * cluster_milli:
            res.alloc_curve[str(next_pct)] = round(100 * allocated / cluster_milli, 4)
            res.frag_curve[str(next_pct)] = round(100 * cluster_frag(views, wl) / cluster_milli, 4)
            next_pct += 1
        if progress is not None and (i + 1) % 500 == 0:
            progress(i + 1, len(pods))
    res.seconds = time.perf_counter() - started
    res.blocks = len(pods)
    res.failures = dict(failures)
    res.alloc_end = round(100 * allocated / cluster_milli, 4)
    res.frag_end = round(100 * cluster_frag(views, wl) / cluster_milli, 4)
    res.arrived_end = round(100 * arrived / cluster_milli, 4)
    return res
