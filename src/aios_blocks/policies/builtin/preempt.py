"""``builtin:preempt-min``: the default ``preemption`` policy (issue 36, docs/priority.md). Pure.

Input (``action: "preempt"``)::

    {"action": "preempt", "minDelta": 10,            # AIOS_PREEMPT_MIN_DELTA, passed in
     "block": {"block_id", "priority", "minInstances",
               "resources": {"gpus", "gpuShare", "cpu", "memory", "gpuModels"}},
     "cluster": {"cluster_id", "nodes": {node_id: {"cpu_free", "mem_free",
                                                   "gpus": {gpu_id: {"model", "free", "memory", "memory_free",
                                                                     "instances", "exclusive"}}}}},
     "candidates": [{"block_id", "priority", "created", "preemptible", "minInstances",
                     "instances": {iid: {"node_id", "gpus": [gpu_id], "share", "cpu", "memory",
                                         "created", "gpuMemory", "gpuSharing"}}}]}

``free`` is the free part of a GPU (1: whole, 0.25: a quarter of its compute); an instance's
``share`` is what it holds of each of its GPUs (1: whole). A GPU's ``memory``/``memory_free``
(MiB), ``instances`` and ``exclusive``, an instance's ``gpuMemory`` (MiB it holds of each GPU when
it shares) and ``gpuSharing``, and the block's ``gpuSharing`` (its resourceAllocator's setting)
are optional (issue 38): with them a GPU is usable by ``capacity.gpu_usable``'s rules (one of less
memory than ``gpuMemory`` never; a shared one with ``gpuMemory`` free and its share of compute; an
exclusive instance only an empty one), and an instance gone gives its GPUs back its memory (all of
it when it was the last). Without them: memory never binds, and a block shares iff ``gpuShare`` > 0
(the first shape's reading). Output::

    {"victims": {node_id: [iid, ...]}, "blocks": {block_id: [iid, ...]},
     "gpus_freed": float, "fits": {node_id: instances of the block}, "reason": str}

Empty ``victims``: no preemption (the block waits); ``reason`` says why.

Rules (Kubernetes' PostFilter, Nomad's delta, KEP-5710's gang rule):

* only blocks at least ``minDelta`` priority points lower, never one with ``preemptible: false``;
* **gang-aware**: victims are returned only when a plan shows the whole block (``minInstances``,
  at least 1) fits once they are gone (``fits``); a victim block pushed below its own
  ``minInstances`` is one unit: all its instances go;
* the **lowest** highest victim priority first, then the **fewest** victim instances, then the
  fewest GPUs freed, then the **youngest** victims; candidate plans: lowest priority and youngest
  first, the largest units first, and each node alone, each made minimal (no victim it can spare);
* a plan that frees more GPUs than the block needs plus one node's GPUs is not taken (it waits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

EPS = 1e-9
DEFAULT_MIN_DELTA = 10
#: the reason of a plan that finds no victims because the block fits nowhere even with every block
#: it may evict gone (``node_may_fit`` re-checks that answer one node at a time)
NO_FIT = "the block does not fit even with every lower-priority block gone"


@dataclass(frozen=True)
class Need:
    """One instance of the preemptor."""

    gpus: int
    share: float
    cpu: float
    memory: float
    models: frozenset[str]
    count: int
    #: MiB of each of its GPUs' memory (``gpuMemory``)
    gpu_memory: float = 0.0
    #: whether it shares GPUs (``gpuSharing``; None, not given: iff ``share`` > 0, set so at init)
    sharing: bool | None = None

    def __post_init__(self) -> None:
        if self.sharing is None:
            object.__setattr__(self, "sharing", self.share > 0)


#: a GPU's places in the planner's list (``_gpu``)
MODEL, FREE, MEM_FREE, MEM, INSTANCES, EXCLUSIVE = range(6)


@dataclass
class _Node:
    cpu: float
    mem: float
    gpus: dict[str, list[Any]] = field(default_factory=dict)  # gpu id -> _gpu's list


def _gpu(v: Mapping[str, Any]) -> list[Any]:
    """A GPU as the planner keeps it: [model, free, memory free, memory, instances, exclusive];
    without ``memory`` its memory never binds, without ``instances`` (-1: not said) an empty GPU is
    one with all its compute free, without ``exclusive`` one with none free is taken whole."""
    free = float(v.get("free", 0.0))
    mem = float(v["memory"]) if v.get("memory") is not None else math.inf
    mem_free = float(v["memory_free"]) if v.get("memory_free") is not None else mem
    insts = int(v["instances"]) if v.get("instances") is not None else -1
    exclusive = bool(v["exclusive"]) if v.get("exclusive") is not None else free <= EPS
    return [str(v.get("model", "")), free, mem_free, mem, insts, exclusive]


def gpu_usable(v: list[Any], need: Need) -> bool:
    """Whether one instance of ``need`` may use this GPU (``_gpu``'s list): the placement's own
    rules (``policies.capacity.gpu_usable``): an allowed model, at least ``gpuMemory`` of memory;
    an instance that shares: not held exclusively, ``gpuMemory`` free and its share of compute;
    one that does not: nothing on it."""
    if (need.models and v[MODEL] not in need.models) or v[MEM] < need.gpu_memory:
        return False
    if not need.sharing:
        return v[INSTANCES] == 0 if v[INSTANCES] >= 0 else v[FREE] >= 1 - EPS
    return not v[EXCLUSIVE] and v[MEM_FREE] >= need.gpu_memory and v[FREE] >= need.share - EPS


def usable_count(gpus: Iterable[list[Any]], need: Need) -> int:
    """How many of ``gpus`` are ``gpu_usable`` by ``need``: of a need of any model and no
    ``gpuMemory`` that does not share (the multi-GPU ones of the trace: the hot path), its rule inlined."""
    if need.sharing or need.models or need.gpu_memory > 0:
        return sum(1 for v in gpus if gpu_usable(v, need))
    return sum(1 for v in gpus if (v[INSTANCES] == 0 if v[INSTANCES] >= 0 else v[FREE] >= 1 - EPS))


def release_gpu(v: list[Any], share: float, gpu_memory: float) -> None:
    """One instance that held ``share`` of the GPU's compute and (sharing) ``gpu_memory`` MiB of
    its memory is gone: the last one leaves it whole (all its memory, not exclusive)."""
    v[FREE] = min(1.0, v[FREE] + share)
    if v[INSTANCES] > 0:
        v[INSTANCES] -= 1
    if v[INSTANCES] == 0:
        v[FREE], v[MEM_FREE], v[EXCLUSIVE] = 1.0, v[MEM], False
    else:
        v[MEM_FREE] = min(v[MEM], v[MEM_FREE] + gpu_memory)
        if v[INSTANCES] < 0:
            v[EXCLUSIVE] = v[FREE] <= EPS


def take_gpu(v: list[Any], share: float, gpu_memory: float, sharing: bool) -> None:
    """One instance takes the GPU: its ``share`` of compute and ``gpu_memory`` MiB (sharing), or
    all of it (``capacity.take``)."""
    v[FREE] = max(0.0, v[FREE] - share)
    if v[INSTANCES] >= 0:
        v[INSTANCES] += 1
    if sharing:
        v[MEM_FREE] -= gpu_memory
    else:
        v[FREE], v[MEM_FREE], v[EXCLUSIVE] = 0.0, 0.0, True


@dataclass(frozen=True)
class _Block:
    bid: str
    priority: int
    created: float
    #: eviction levels: levels[k] = the instance ids evicted at level k+1 (the last: all of them)
    levels: tuple[tuple[str, ...], ...]


def share_of(inst: Mapping[str, Any]) -> float:
    """What an instance holds of each of its GPUs' compute (``share``; not given: all of it)."""
    share = inst.get("share")
    return 1.0 if share is None else float(share)


def need_of(block: Mapping[str, Any]) -> Need:
    r = block.get("resources") or {}
    sharing = block.get("gpuSharing")
    return Need(int(r.get("gpus") or 0), float(r.get("gpuShare") or 0.0), float(r.get("cpu") or 0.0),
                float(r.get("memory") or 0.0), frozenset(r.get("gpuModels") or ()), max(1, int(block.get("minInstances") or 0)),
                float(r.get("gpuMemory") or 0.0), None if sharing is None else bool(sharing))


def _nodes(cluster: Mapping[str, Any]) -> dict[str, _Node]:
    out = {}
    for nid, n in sorted((cluster.get("nodes") or {}).items()):
        gpus = {g: _gpu(v) for g, v in sorted((n.get("gpus") or {}).items())}
        out[nid] = _Node(float(n.get("cpu_free") or 0.0), float(n.get("mem_free") or 0.0), gpus)
    return out


def node_fits(n: _Node, need: Need, limit: int) -> int:
    """How many instances of ``need`` the node takes (at most ``limit``): its GPUs by
    ``gpu_usable``; sharing ones best fit (the fullest first), each instance taking its share of
    compute and its ``gpuMemory`` of memory of each GPU it gets."""
    k = limit
    if need.cpu > 0:
        k = min(k, math.floor(n.cpu / need.cpu + EPS))
    if need.memory > 0:
        k = min(k, math.floor(n.mem / need.memory + EPS))
    if need.gpus <= 0 or k <= 0:
        return max(0, k)
    if not need.sharing:
        return min(k, usable_count(n.gpus.values(), need) // need.gpus)
    if need.gpu_memory <= 0:  # compute alone binds (the trace's shares): its free parts, as floats
        return _shares_fit(sorted(v[FREE] for v in n.gpus.values() if gpu_usable(v, need)), need, k)
    pairs = sorted([v[FREE], v[MEM_FREE]] for v in n.gpus.values() if gpu_usable(v, need))
    got = 0
    while got < k:
        took = [f for f in pairs if f[0] >= need.share - EPS and f[1] >= need.gpu_memory][: need.gpus]
        if len(took) < need.gpus:
            break
        for f in took:
            f[0] -= need.share
            f[1] -= need.gpu_memory
        pairs.sort()
        got += 1
    return got


def _shares_fit(frees: list[float], need: Need, k: int) -> int:
    """``node_fits`` of a sharing need whose ``gpuMemory`` is 0 on its usable GPUs' free parts
    (sorted; changed): best fit, the fullest first."""
    got = 0
    while got < k:
        pick = [i for i, f in enumerate(frees) if f >= need.share - EPS][: need.gpus]
        if len(pick) < need.gpus:
            break
        for i in pick:
            frees[i] -= need.share
        frees.sort()
        got += 1
    return got


def placement(nodes: Mapping[str, _Node], need: Need) -> dict[str, int]:
    """Where the whole gang goes (node -> instances), or {} when it does not fit."""
    left, out = need.count, {}
    for nid, n in nodes.items():
        k = node_fits(n, need, left)
        if k:
            out[nid] = k
            left -= k
        if left <= 0:
            return out
    return {}


def _blocks(candidates: Iterable[Mapping[str, Any]], floor: int) -> list[_Block]:
    out = []
    for c in candidates:
        if c.get("preemptible") is False or int(c.get("priority") or 0) > floor:
            continue
        insts = c.get("instances") or {}
        if not insts:
            continue
        order = sorted(insts, key=lambda i: (-float(insts[i].get("created") or 0.0), i))  # youngest first
        surplus = max(0, len(order) - int(c.get("minInstances") or 0))
        levels = [tuple(order[: k + 1]) for k in range(min(surplus, len(order) - 1))] + [tuple(order)]
        out.append(_Block(str(c["block_id"]), int(c.get("priority") or 0), float(c.get("created") or 0.0), tuple(levels)))
    return out


class _Plan:
    """The cluster with some instances evicted: only the nodes they free are copied and fitted
    again (the others' fit is computed once)."""

    def __init__(self, nodes: Mapping[str, _Node], insts: Mapping[str, Mapping[str, Any]], need: Need):
        self.base, self.insts, self.need = nodes, insts, need
        self.base_fit = {nid: node_fits(n, need, need.count) for nid, n in nodes.items()}

    def after(self, evicted: Iterable[str]) -> dict[str, _Node]:
        """The nodes the evicted instances free, as they are once they are gone."""
        nodes: dict[str, _Node] = {}
        for iid in evicted:
            i = self.insts[iid]
            nid = str(i.get("node_id"))
            base = self.base.get(nid)
            if base is None:
                continue
            n = nodes.get(nid)
            if n is None:
                n = nodes[nid] = _Node(base.cpu, base.mem, {g: list(v) for g, v in base.gpus.items()})
            n.cpu += float(i.get("cpu") or 0.0)
            n.mem += float(i.get("memory") or 0.0)
            share, gpu_memory = share_of(i), float(i.get("gpuMemory") or 0.0)
            for g in i.get("gpus") or ():
                if g in n.gpus:
                    release_gpu(n.gpus[g], share, gpu_memory)
        return nodes

    def fits(self, evicted: Iterable[str]) -> dict[str, int]:
        """Where the whole gang goes once ``evicted`` are gone (node -> instances), or {}."""
        changed = self.after(evicted)
        left, out = self.need.count, {}
        for nid in self.base:
            k = node_fits(changed[nid], self.need, left) if nid in changed else min(left, self.base_fit[nid])
            if k:
                out[nid] = k
                left -= k
            if left <= 0:
                return out
        return {}

    def gpus_freed(self, evicted: Iterable[str]) -> float:
        return sum(len(self.insts[i].get("gpus") or ()) * share_of(self.insts[i]) for i in evicted)


def _evicted(levels: Mapping[str, int], by_id: Mapping[str, _Block]) -> list[str]:
    return [iid for bid, k in levels.items() if k for iid in by_id[bid].levels[k - 1]]


def _greedy(order: list[_Block], plan: _Plan, need: Need) -> dict[str, int] | None:
    """Raise blocks' eviction levels in ``order`` until the gang fits, then drop every victim it
    can spare (the highest priority and oldest first). None: it never fits."""
    by_id = {b.bid: b for b in order}
    levels: dict[str, int] = {}
    fits = False
    for b in order:
        for k in range(1, len(b.levels) + 1):
            levels[b.bid] = k
            if plan.fits(_evicted(levels, by_id)):
                fits = True
                break
        if fits:
            break
    if not fits:
        return None
    for b in sorted((by_id[bid] for bid in levels), key=lambda b: (-b.priority, b.created, b.bid)):
        while levels[b.bid] > 0:
            trial = {**levels, b.bid: levels[b.bid] - 1}
            if not plan.fits(_evicted(trial, by_id)):
                break
            levels = trial
    return {bid: k for bid, k in levels.items() if k}


def _ceiling(blocks: list[_Block], p: _Plan) -> int | None:
    """The lowest highest-victim priority with which the gang fits at all (None: never)."""
    for level in sorted({b.priority for b in blocks}):
        if p.fits([iid for b in blocks if b.priority <= level for iid in b.levels[-1]]):
            return level
    return None


def _orders(allowed: list[_Block], nodes: Mapping[str, _Node], insts: Mapping[str, Mapping[str, Any]]) -> list[list[_Block]]:
    """The candidate orders: lowest priority and youngest first, the largest units first, each node alone."""
    orders = [
        sorted(allowed, key=lambda b: (b.priority, -b.created, b.bid)),
        sorted(allowed, key=lambda b: (b.priority, -len(b.levels[-1]), -b.created, b.bid)),
    ]
    on: dict[str, list[_Block]] = {}  # node -> the blocks with an instance there, in orders[0]'s order
    for b in orders[0]:
        for nid in dict.fromkeys(str(insts[i].get("node_id")) for i in b.levels[-1]):
            on.setdefault(nid, []).append(b)
    orders.extend(on[nid] for nid in nodes if nid in on)
    return orders


def _bound(nodes: Mapping[str, _Node], need: Need) -> float:
    """The most GPUs a plan may free: the block's own plus one node's."""
    node_gpus = max((len(n.gpus) for n in nodes.values()), default=0)
    return need.gpus * (need.share or 1.0) * need.count + node_gpus


def _best(orders: list[list[_Block]], p: _Plan, need: Need, by_id: Mapping[str, _Block],
          bound: float) -> tuple[Any, ...] | None:
    """The best plan over ``orders`` as (key, levels, evicted, freed), or None (every plan frees too much)."""
    best: tuple[Any, ...] | None = None
    for order in orders:
        levels = _greedy(order, p, need)
        if levels is None:
            continue
        evicted = _evicted(levels, by_id)
        freed = p.gpus_freed(evicted)
        if freed > bound + EPS:
            continue
        key = (max(by_id[b].priority for b in levels), len(evicted), freed, -sum(by_id[b].created for b in levels),
               sorted(evicted))
        if best is None or key < best[0]:
            best = (key, levels, evicted, freed)
    return best


def _chosen(best: tuple[Any, ...], p: _Plan, insts: Mapping[str, Mapping[str, Any]], by_id: Mapping[str, _Block],
            priority: int) -> dict[str, Any]:
    """The output for the best plan."""
    _, levels, evicted, freed = best
    victims: dict[str, list[str]] = {}
    for iid in sorted(evicted):
        victims.setdefault(str(insts[iid].get("node_id")), []).append(iid)
    return {
        "victims": victims,
        "blocks": {bid: sorted(by_id[bid].levels[k - 1]) for bid, k in sorted(levels.items())},
        "gpus_freed": round(freed, 3),
        "fits": p.fits(evicted),
        "reason": f"priority {priority} preempts {len(evicted)} instance(s) of {len(levels)} block(s) at priority <= {best[0][0]}",
    }


def plan(input_data: Mapping[str, Any], min_delta: int | None = None) -> dict[str, Any]:
    """The victims of one preemption (see the module's docstring)."""
    block = input_data.get("block") or {}
    need = need_of(block)
    delta = int(input_data.get("minDelta", DEFAULT_MIN_DELTA) if min_delta is None else min_delta)
    nodes = _nodes(input_data.get("cluster") or {})
    none: dict[str, Any] = {"victims": {}, "blocks": {}, "gpus_freed": 0.0, "fits": {}}
    now = placement(nodes, need)
    if now:
        return {**none, "fits": now, "reason": "fits without preemption"}
    if block.get("preemptedBy"):  # no cascades: a victim that waits again never preempts in turn
        return {**none, "reason": f"it was preempted by {block['preemptedBy']} and waits: a preempted block never preempts"}
    priority = int(block.get("priority") or 0)
    blocks = _blocks(input_data.get("candidates") or (), priority - delta)
    if not blocks:
        return {**none, "reason": f"no preemptible block {delta} or more priority points below {priority}"}
    insts = {iid: i for c in input_data.get("candidates") or () for iid, i in (c.get("instances") or {}).items()}
    p = _Plan(nodes, insts, need)
    by_id = {b.bid: b for b in blocks}
    ceiling = _ceiling(blocks, p)
    if ceiling is None:
        return {**none, "reason": NO_FIT}
    orders = _orders([b for b in blocks if b.priority <= ceiling], nodes, insts)
    bound = _bound(nodes, need)
    best = _best(orders, p, need, by_id, bound)
    if best is None:
        return {**none, "reason": f"every plan frees more than the block's GPUs plus one node's ({bound:g})"}
    return _chosen(best, p, insts, by_id, priority)


def node_may_fit(block: Mapping[str, Any], node_id: str, node: Mapping[str, Any],
                 candidates: Iterable[Mapping[str, Any]], min_delta: int) -> bool:
    """Whether one instance of ``block`` fits ``node`` (the planner's node shape) once every
    candidate instance on it the planner may take (``min_delta`` lower, preemptible) is gone, in
    the planner's own arithmetic. For a block of one instance (``minInstances`` <= 1) ``plan``'s
    answer ``NO_FIT`` is the conjunction of this being false on every node (a node's fit only grows
    as instances leave it), so a caller that kept a ``NO_FIT`` answer need re-plan only when a
    node whose capacity changed answers True here (``trace/online.py``)."""
    need = need_of(block)
    nodes = _nodes({"nodes": {node_id: node}})
    on = [{**c, "instances": {i: v for i, v in (c.get("instances") or {}).items() if v.get("node_id") == node_id}}
          for c in candidates]
    blocks = _blocks(on, int(block.get("priority") or 0) - min_delta)
    insts = {iid: v for c in on for iid, v in c["instances"].items()}
    return bool(_Plan(nodes, insts, replace(need, count=1)).fits(
        [iid for b in blocks for iid in b.levels[-1]]))


class PreemptMinPolicy:
    """The seed-000 class shape: ``eval(parameters, input, context)``."""

    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}

    def eval(self, parameters: dict[str, Any], input_data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        return plan(input_data)
