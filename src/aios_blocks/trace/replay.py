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

import gc
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..gcpause import gc_paused
from ..policies import capacity
from ..policies.builtin.frag import Workload, gpu_left, node_model
from ..schemas.records import BlockIR, ClusterRecord, Needs, NodeView
from ..schemas.spec import Node
from .workload import UNITS, Task, inflate, multi_gpu_shapes, typical_shapes

#: short names for ``--policy`` (any ``builtin:`` resourceAllocator URI works too; ``registry:`` ones with ``--live`` only)
POLICY_NAMES: dict[str, str] = {
    "random": "builtin:random", "dot-product": "builtin:dot-product", "gpu-packing": "builtin:gpu-packing",
    "gpu-clustering": "builtin:gpu-clustering", "best-fit": "builtin:best-fit", "fgd": "builtin:fgd",
    "binpack": "builtin:binpack", "spread": "builtin:spread", "fgd-plus": "builtin:fgd-plus",
}
#: the GPU placement policy of ``blocks trace replay`` when none is named: ours, at least FGD's
#: published figure on each of the trace's 17 workloads (docs/trace.md "Our policy")
DEFAULT_POLICY = "builtin:fgd-plus"
#: the anchor's (the artifact's) name of each policy
ANCHOR_NAMES: dict[str, str] = {
    "builtin:random": "Random", "builtin:dot-product": "DotProd", "builtin:gpu-packing": "GpuPacking",
    "builtin:gpu-clustering": "GpuClustering", "builtin:best-fit": "BestFit", "builtin:fgd": "FGD",
}


def policy_uri(name: str) -> str:
    return POLICY_NAMES.get(name, name)


def policy_problems(names: list[str]) -> list[str]:
    """One line per ``--policy`` that names no policy this process can load (a ``registry:`` one or a
    file is the running system's to find): before, each task of the run failed 'placement refused'
    and the replay exited 0 with 0 % allocated."""
    import asyncio

    from ..policies.runtime import PolicyRuntime

    runtime, out = PolicyRuntime(lookup=None), []
    for name in names:
        uri = policy_uri(name)
        if uri.startswith("registry:") or uri.endswith((".py", ".star")):
            continue
        try:
            asyncio.run(runtime.resolve(uri))
        except (ValueError, ImportError, AttributeError) as exc:
            out.append(f"--policy {name}: {exc}; the short names: {', '.join(POLICY_NAMES)}")
    return out


def views_of(nodes: list[Node]) -> capacity.Nodes:
    """Idle node views, made by the store's own ``node_view`` from the hash it would hold."""
    from ..state.store import node_view

    out = capacity.Nodes()
    for n in nodes:
        h = {"spec": n.model_dump_json(), "cpu": str(n.cpu), "memory": str(n.memory), "healthy": "1" if n.healthy else "0"}
        h.update({f"g:{g.id}:total": str(g.memory) for g in n.gpus})
        out[n.id] = node_view(h)
    return out


def node_frag(view: NodeView, wl: Workload) -> float:
    """FGD's fragmentation of one node, in thousandths of a GPU."""
    return wl.frag(node_model(view), float(view["cpu_free"]), gpu_left(view))


def cluster_frag(views: dict[str, NodeView], wl: Workload) -> float:
    """FGD's fragmentation of the cluster: the sum over nodes, in thousandths of a GPU."""
    return sum(node_frag(v, wl) for v in views.values())


def failure_reason(views: dict[str, NodeView], needs: Needs, share: bool) -> str:
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
    #: ``in-process`` or ``live``
    mode: str = "in-process"
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
    #: per block decided: seconds from its submission to its outcome (in-process: its plan)
    latencies: list[float] = field(default_factory=list)
    #: block id -> (node, GPUs) of each placed block (not in the JSON: the per-block check of the modes)
    placements: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    #: the blocks decided within ``seconds`` (live: all but the first, whose time holds the workers' start)
    timed_blocks: int = 0

    def at(self, curve: dict[str, float], pct: int) -> float:
        """The figure at ``pct`` % arrived; past the last point reached (the inflated list ends
        just under its target), the figure at the end."""
        return curve.get(str(pct), self.frag_end if curve is self.frag_curve else self.alloc_end)

    def as_dict(self) -> dict[str, Any]:
        top = round(self.inflate * 100)
        lat = sorted(self.latencies)
        out = {
            "policy": self.policy, "seed": self.seed, "workload": self.workload, "mode": self.mode, "nodes": self.nodes,
            "gpus": self.gpus, "inflate": self.inflate, "sample_nodes": self.sample_nodes, "blocks": self.blocks,
            "placed": self.placed, "failed": self.blocks - self.placed, "failures": dict(sorted(self.failures.items())),
            "alloc_at_100": round(self.at(self.alloc_curve, 100), 4), f"alloc_at_{top}": round(self.alloc_end, 4),
            "frag_at_100": round(self.at(self.frag_curve, 100), 4), f"frag_at_{top}": round(self.frag_end, 4),
            "arrived_end": round(self.arrived_end, 4),
            "alloc_curve": self.alloc_curve, "frag_curve": self.frag_curve,
            "seconds": round(self.seconds, 3),
            "placements_per_s": round((self.timed_blocks or self.blocks) / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": round(1000 * lat[len(lat) // 2], 3) if lat else 0.0,
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else 0.0,
        }
        return out


@dataclass
class Setup:
    """What both modes share for one run: the inflated, shuffled pods, the target workload, and
    each pod's block IR parts (resources, the resourceAllocator rule, labels)."""

    uri: str
    seed: int
    sample_nodes: int
    pods: list[Task]
    shapes: list[dict[str, Any]]
    cluster_milli: int
    #: the multi-GPU shapes ``shapes`` (FGD's 95 % cut) leaves out (``workload.multi_gpu_shapes``):
    #: ``parameters.multiGpu``, read by ``builtin:fgd-plus`` alone (the baselines keep FGD's workload)
    multi: list[dict[str, Any]] = field(default_factory=list)

    def rule(self, share: bool) -> dict[str, Any]:
        params: dict[str, Any] = {"seed": self.seed, "workload": self.shapes}
        if self.multi:
            params["multiGpu"] = self.multi
        return {"name": "resourceAllocator", "policyRuleURI": self.uri,
                "settings": {"gpuSharing": share, "sampleNodes": self.sample_nodes}, "parameters": params}


def block_id(t: Task) -> str:
    """The block id of a task: its name (the trace's are valid ids; the modes must agree on it,
    as policies break some ties by it)."""
    return t.name


def labels(t: Task) -> dict[str, str]:
    """The trace's QoS class as the block's ``qos`` label (``LS``, ``BE``...)."""
    return {"qos": t.qos} if t.qos else {}


def setup(nodes: list[Node], tasks: list[Task], policy: str, seed: int, ratio: float, sample_nodes: int) -> Setup:
    cluster_milli = sum(len(n.gpus) for n in nodes) * UNITS
    if not cluster_milli:
        raise ValueError("the inventory has no GPU: nothing to measure")
    return setup_of(policy, seed, sample_nodes, inflate(tasks, cluster_milli, ratio, seed), tasks, cluster_milli)


def setup_of(policy: str, seed: int, sample_nodes: int, pods: list[Task], tasks: list[Task], cluster_milli: int) -> Setup:
    """The setup of a run submitting ``pods``, its policy's parameters drawn from ``tasks``: FGD's
    target workload (``typical_shapes``) and the multi-GPU shapes it leaves out (``multi_gpu_shapes``,
    fgd-plus 7.). The replay's (pods: the inflated tasks) and the online replays' (the timed tasks)."""
    typical = typical_shapes(tasks)
    return Setup(policy_uri(policy), seed, sample_nodes, pods, typical, cluster_milli, multi_gpu_shapes(tasks, typical))


class Ledger:
    """The figures of a replay, fed one decided task at a time (in the replay's order): the
    views the placements are applied to, the allocation and fragmentation curves, failures by
    reason. Both modes feed it: in-process with its own decisions, live with the placements read
    back from the system's state."""

    def __init__(self, nodes: list[Node], st: Setup, res: Result):
        self.views = views_of(nodes)
        self.st, self.res = st, res
        self.wl = Workload(st.shapes)
        #: each node's fragmentation, in the views' order, kept as placements change them: the
        #: cluster's figure at each 1 % is their sum (``cluster_frag``), without measuring every node
        self.node_frag = {nid: node_frag(v, self.wl) for nid, v in self.views.items()}
        self.failures: Counter[str] = Counter()
        self.arrived = self.allocated = 0
        self.next_pct = 1

    def add(self, t: Task, placed: tuple[str, list[str]] | None) -> None:
        needs, share = t.resources(), t.sharing
        if placed is None:
            self.failures[failure_reason(self.views, needs, share)] += 1
        else:
            nid, gpus = placed
            node = capacity.copy_node(self.views[nid])
            capacity.take(node, gpus, needs, share)
            self.views[nid] = node
            self.node_frag[nid] = node_frag(node, self.wl)
            self.allocated += t.milli_total
            self.res.placed += 1
            self.res.placements[block_id(t)] = (nid, tuple(gpus))
        self.arrived += t.milli_total
        cm = self.st.cluster_milli
        while self.arrived * 100 >= self.next_pct * cm:
            self.res.alloc_curve[str(self.next_pct)] = round(100 * self.allocated / cm, 4)
            self.res.frag_curve[str(self.next_pct)] = round(100 * sum(self.node_frag.values()) / cm, 4)
            self.next_pct += 1

    def close(self) -> Result:
        cm, res = self.st.cluster_milli, self.res
        res.blocks = len(self.st.pods)
        res.failures = dict(self.failures)
        res.alloc_end = round(100 * self.allocated / cm, 4)
        res.frag_end = round(100 * sum(self.node_frag.values()) / cm, 4)
        res.arrived_end = round(100 * self.arrived / cm, 4)
        return res


def held_milli(views: dict[str, NodeView]) -> int:
    """GPU compute held on the views, in thousandths: a GPU held whole counts 1000, a shared one
    what its instances' shares took."""
    return sum(UNITS if g["exclusive"] else UNITS - int(g.get("share_free", UNITS)) for v in views.values() for g in v["gpus"])


#: blocks between two collections of the young generations while a replay holds the collector off
GC_EVERY = 2000


def collect_young(i: int) -> None:
    """Every ``GC_EVERY`` blocks, a collection of the young generations (cycles made since)."""
    if i % GC_EVERY == GC_EVERY - 1:
        gc.collect(1)


async def replay(
    nodes: list[Node], tasks: list[Task], policy: str = DEFAULT_POLICY, seed: int = 42, ratio: float = 1.3,
    sample_nodes: int = 0, workload: str = "", progress: Callable[[int, int], None] | None = None,
) -> Result:
    """Place the inflated, shuffled task list one task at a time (see the module's docstring)."""
    from ..handlers import controller
    from ..policies.runtime import PolicyRuntime
    from ..schemas.errors import PlacementFailed

    st = setup(nodes, tasks, policy, seed, ratio, sample_nodes)
    runtime = PolicyRuntime(lookup=None)
    cluster: ClusterRecord = {"id": nodes[0].cluster, "labels": {}}
    rules = {share: st.rule(share) for share in (False, True)}
    res = Result(st.uri, seed, workload, len(nodes), st.cluster_milli // UNITS, ratio, sample_nodes)
    ledger = Ledger(nodes, st, res)
    started = time.perf_counter()
    with gc_paused():  # full passes held off; collect_young every GC_EVERY blocks (gcpause)
        for i, t in enumerate(st.pods):
            rule, bid = rules[t.sharing], block_id(t)
            ir: BlockIR = {"blockId": bid, "blockComponentURI": "aios://trace/task", "minInstances": 1, "maxInstances": 1,
                  "resources": t.resources(), "policies": {"resourceAllocator": rule}, "labels": labels(t)}

            async def invoke(inp: dict[str, Any], rule: dict[str, Any] = rule) -> Any:
                return await runtime.invoke(rule, "resourceAllocator", inp)

            t0 = time.perf_counter()
            try:
                placements = await controller.plan(ir, cluster, ledger.views, "allocation", [controller.instance_id(bid, 0)], invoke)
            except PlacementFailed:
                placed = None
            else:
                placed = (placements[0]["node"], list(placements[0]["gpus"]))
            res.latencies.append(time.perf_counter() - t0)
            ledger.add(t, placed)
            if progress is not None and (i + 1) % 500 == 0:
                progress(i + 1, len(st.pods))
            collect_young(i)
    res.seconds = time.perf_counter() - started
    return ledger.close()
