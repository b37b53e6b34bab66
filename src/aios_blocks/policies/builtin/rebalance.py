"""``builtin:rebalance-min``: the default ``rebalancer`` policy (issue 38, docs/rebalance.md). Pure.

Input (``action: "rebalance"``)::

    {"action": "rebalance", "maxMoves": 2,              # AIOS_REBALANCE_MAX_MOVES (or --max-moves)
     "trigger": "pending" | "fragmentation" | "manual",
     "cluster": {"cluster_id", "nodes": {node_id: {"cpu_free", "mem_free",
                                                   "gpus": {gpu_id: {"model", "free"}}}}},
     "fragmentation": {"total": float, "ratio": float, "nodes": {node_id: float}},   # FGD, informative
     "workload": [{"gpus", "gpuShare", "cpu", "gpuModels", "weight"}],   # the shapes FGD measures against
     "pending": [{"block_id", "priority", "minInstances", "resources": {...},
                  "targets": [node_id],       # optional: the only nodes it may use; oldest/highest first
                  "prefer": {node_id: score}}],   # optional: its Preferred/Adaptive affinity score per node
     "movable": [{"block_id", "priority", "created", "preemptible", "minInstances",
                  "maxMoving", "moving", "gpuModels",
                  "targets": [node_id],                # optional: the only nodes it may move to
                  "prefer": {node_id: score},          # optional: its Preferred/Adaptive affinity score per node
                  "instances": {iid: {"node_id", "gpus", "share", "cpu", "memory", "created",
                                      "tier",          # optional: its GPU set's link tier now
                                      "gpuMemory", "gpuSharing"}}}],   # optional, as preempt-min's
     "topology": {node_id: {"gpus": [gpu_id], "topology": {...}}}}   # optional: nodes' GPU topology

The cluster's shape is ``builtin:preempt-min``'s (``free``: the free part of a GPU's compute; a
GPU's memory, instances and exclusive flag, and a block's or instance's ``gpuSharing``, optional:
with them a GPU is usable by the placement's rules, ``preempt.gpu_usable``, and a moved instance
gives its source GPUs back the memory it held and takes its own on its target's).
Output::

    {"moves": [{"block_id", "instance_id", "from", "to", "to_gpus", "reason", "gpus_freed",
                "frag_delta"}],
     "for": block_id or "",                   # the pending block the moves make room for
     "fits": {node_id: instances of it},      # where it fits once the moves are done
     "fragmentation": {"before", "after"},    # the cluster's FGD fragmentation (thousandths of a GPU)
     "reason": str}

Empty ``moves``: nothing to do (``reason`` says why).

Rules:

* **What moves**: an instance of a block that is not ``preemptible: false`` (the operator said
  "do not disturb": a move restarts the instance elsewhere, even if make-before-break keeps the
  block serving), with room in its disruption budget (its spec's ``maxMoving``, default 1, less the
  instances of it already ``moving``); for a pending block, only blocks of its priority or lower
  (a block is never moved for a lower one).
* **A pending block first**: the fewest moves (at most ``maxMoves``) after which its whole gang
  (``minInstances``) fits; each step frees one more instance's room with the fewest instances,
  on the node it ``prefer``s most, the smallest (GPUs moved) and the lowest priority first, each
  sent to the node where it fragments least. The sources are the nodes closest to holding one
  instance of it: the fewest GPUs short, then the least CPU and memory short (a node with the
  GPUs free whose CPU or memory is taken gets room by moving a CPU- or memory-heavy instance off).
* **Fragmentation otherwise**: greedy moves, each the one that lowers the cluster's FGD
  fragmentation (``policies.builtin.frag.Workload``, on ``workload``) the most per GPU moved,
  while one lowers it at all (at most ``maxMoves``).
* **Never worse**: a move's target never gains more fragmentation than its source loses (the
  moves that free one room are counted together: the first may not help alone); a plan whose
  moves would raise the cluster's fragmentation is not taken.
* **Where a placement may go**: a block's ``targets`` (the nodes its placement's filters admit:
  its virtual cluster, its Required affinity; ``handlers.rebalance`` computes them with the
  placement's own code) are the only nodes its instances move to; on a node with a ``topology``,
  a whole-GPU instance gets the set ``policies.topology.choose`` picks (the placement's pick: the
  best connected, keeping the best sets free), and an instance with a ``tier`` is never moved to
  a set of a worse tier; an instance whose block ``prefer``s nodes is never moved to a node it
  scores lower than its own (of equal fragmentation, the higher score first).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ...schemas.topology import TIER_RANK, LinkTier
from .. import topology as topo_mod
from .frag import UNITS, Workload
from .preempt import (
    EPS,
    Need,
    _Node,
    _nodes,
    gpu_usable,
    need_of,
    node_fits,
    release_gpu,
    share_of,
    take_gpu,
    usable_count,
)
from .preempt import placement as _placement
from .rebalance_dests import DestCache, _count, _Counts, _Dests, _entry, _left, _model, _on

__all__ = [
    "UNITS",
    "Cluster",
    "DestCache",
    "Inst",
    "Move",
    "_Counts",
    "_count",
    "_entry",
    "_on",
    "plan",
    "plan_fragmentation",
    "plan_pending",
]

DEFAULT_MAX_MOVES = 8
#: source nodes looked at per room to free (the fewest GPUs short first)
SOURCES = 24
#: subsets of one node's instances tried per size
SUBSETS = 256


@dataclass(frozen=True)
class Inst:
    """One movable instance."""

    iid: str
    bid: str
    node: str
    gpus: tuple[str, ...]
    share: float
    cpu: float
    memory: float
    priority: int
    created: float
    models: frozenset[str]
    #: the only nodes it may move to (None: any)
    targets: frozenset[str] | None = None
    #: its GPU set's link tier rank now (``TIER_RANK``; None: not said / one GPU)
    tier: int | None = None
    #: its block's affinity score per node it may go to (Preferred/Adaptive; None: all the same)
    prefer: Mapping[str, float] | None = field(default=None, compare=False)
    #: MiB of each GPU's memory it needs (and holds, sharing), and whether it shares (None, not
    #: given: iff its share < 1, set so at init)
    gpu_memory: float = 0.0
    sharing: bool | None = None

    def __post_init__(self) -> None:
        if self.sharing is None:
            object.__setattr__(self, "sharing", self.share < 1 - EPS)

    def score(self, nid: str) -> float:
        """Its block's affinity score on node ``nid`` (0 without ``prefer``)."""
        return 0.0 if self.prefer is None else float(self.prefer.get(nid, 0.0))

    @property
    def gpu_amount(self) -> float:
        return len(self.gpus) * self.share

    def need(self) -> Need:
        return self._need

    @functools.cached_property
    def _need(self) -> Need:  # asked per node tried as a destination: made once
        return Need(len(self.gpus), self.share if self.sharing else 0.0, self.cpu, self.memory, self.models, 1,
                    self.gpu_memory, self.sharing)

    @functools.cached_property
    def dest_key(self) -> tuple[Any, ...]:
        """What decides where the instance may go and what it costs there (``_entry``): two
        instances with the same key have the same destinations (``_Dests`` ranks them once)."""
        prefer = None if self.prefer is None else (frozenset(self.prefer.items()), self.node)
        return (len(self.gpus), self.share, self.cpu, self.memory, self.models, self.targets, self.tier, prefer,
                self.gpu_memory, self.sharing)


@dataclass(frozen=True)
class Move:
    inst: Inst
    to: str
    to_gpus: tuple[str, ...]
    frag_delta: float
    reason: str = ""

    def as_dict(self, freed: float) -> dict[str, Any]:
        return {"block_id": self.inst.bid, "instance_id": self.inst.iid, "from": self.inst.node, "to": self.to,
                "to_gpus": list(self.to_gpus), "reason": self.reason, "gpus_freed": round(freed, 3),
                "frag_delta": round(self.frag_delta, 3)}


def _copy(n: _Node) -> _Node:
    return _Node(n.cpu, n.mem, {g: list(v) for g, v in n.gpus.items()})


class Prepared(Protocol):
    """What a caller that keeps the planner's input incrementally (``trace/online_rebalance.py``
    ``MoveIndex``) hands ``plan`` instead of having it parse the input again: it must be what
    ``plan`` would parse from the same input (the same nodes, instances, workload)."""

    #: ``_nodes(input["cluster"])``: never changed by the planner (it copies what it changes)
    nodes: dict[str, _Node]
    #: ``workload_of(input["workload"], ...)``
    wl: Workload
    #: node id -> (the ``_Node`` of ``nodes``, its fragmentation on ``wl``): a cache ``frag`` reads
    frags: dict[str, tuple[_Node, float]]

    def movable(self, ceiling: int | None) -> tuple[list[Inst], dict[str, int]]:
        """``movable(input, ceiling)``."""
        ...

    # optional: ``dest_cache``, a ``DestCache`` the plans on it share (its nodes replaced, not
    # changed in place, when their state changes: the cache keys on the state object)


#: a node without a topology: the worst tier (``_reaches``: a node that reports none cannot say it can)
_NO_TIER = max(TIER_RANK.values())


def _worse_tier(i: Inst, count: int, rank: int) -> bool:
    """Whether a set of ``count`` GPUs of tier ``rank`` is worse than the one the instance has
    (one GPU, or an instance that said no tier: never)."""
    return i.tier is not None and count > 1 and rank > i.tier


def _whole_free_at(ids: list[str], n: _Node, i: Inst) -> list[int]:
    """The positions in ``ids`` of the GPUs of ``n`` the whole-GPU instance may take
    (``gpu_usable``: free, of an allowed model and enough memory)."""
    need = i.need()
    return [k for k, g in enumerate(ids) if gpu_usable(n.gpus[g], need)]


class Cluster:
    """Node states, the FGD workload, and the instances where they are now (moves applied)."""

    def __init__(self, nodes: dict[str, _Node], wl: Workload, frags: Mapping[str, tuple[_Node, float]] | None = None,
                 topology: Mapping[str, Mapping[str, Any]] | None = None):
        self.nodes, self.wl = nodes, wl
        #: fragmentation known per node state (the very ``_Node`` object: a copy is measured again)
        self.frags: Mapping[str, tuple[_Node, float]] = frags or {}
        #: node -> {"gpus": its GPU ids in the topology's order, "topology": ...}
        self.topology: Mapping[str, Mapping[str, Any]] = topology or {}
        #: the nodes the pending block planned for may use (its ``targets``; None: any)
        self.room: frozenset[str] | None = None
        #: its affinity score per node (its ``prefer``: room is made on the best first; None: all equal)
        self.prefer: Mapping[str, float] = {}

    def room_score(self, nid: str) -> float:
        """The pending block's affinity score on node ``nid`` (``prefer``; 0 when not said)."""
        return float(self.prefer.get(nid, 0.0))

    def pick_on(self, nid: str, n: _Node, i: Inst) -> tuple[str, ...] | None:
        """``pick`` on node ``nid``, by its topology when it has one (a whole-GPU instance: the set
        ``policies.topology.choose`` picks), None when the instance may not go there (not one of
        its targets, or a set of a worse tier than it has)."""
        if i.targets is not None and nid not in i.targets:
            return None
        if i.score(nid) < i.score(i.node) - EPS:  # its Preferred/Adaptive affinity never worse
            return None
        gpus = Cluster.pick(n, i)
        if gpus is None or len(gpus) < 1 or i.share < 1 - EPS:
            return gpus
        known = self._topology_of(nid, n)
        if known is None:
            return None if _worse_tier(i, len(gpus), _NO_TIER) else gpus
        t, ids = known
        choice = topo_mod.choose(t["topology"], _whole_free_at(ids, n, i), len(gpus))
        if _worse_tier(i, len(gpus), TIER_RANK[choice.tier]):
            return None
        return tuple(ids[k] for k in choice.gpus)

    def _topology_of(self, nid: str, n: _Node) -> tuple[Mapping[str, Any], list[str]] | None:
        """Node ``nid``'s topology entry and its GPU ids in the topology's order, or None when it
        has none that describes every GPU of ``n`` (then no set can be picked by it)."""
        t = self.topology.get(nid)
        ids = list((t or {}).get("gpus") or ())
        if not t or len(ids) != len(n.gpus) or int((t.get("topology") or {}).get("gpus", 0)) != len(ids):
            return None
        return t, ids

    def frag(self, nid: str, node: _Node | None = None) -> float:
        n = node if node is not None else self.nodes[nid]
        known = self.frags.get(nid)
        if known is not None and known[0] is n:
            return known[1]
        return self.wl.frag(_model(n), n.cpu, _left(n)) if n.gpus else 0.0

    def total(self) -> float:
        return sum(self.frag(nid) for nid in self.nodes)

    @staticmethod
    def release(n: _Node, i: Inst) -> None:
        n.cpu += i.cpu
        n.mem += i.memory
        for g in i.gpus:
            if g in n.gpus:
                release_gpu(n.gpus[g], i.share, i.gpu_memory)

    @staticmethod
    def pick(n: _Node, i: Inst) -> tuple[str, ...] | None:
        """The GPUs the instance would take on ``n`` (whole: free ones; a share: the fullest that
        fits), or None when it does not fit."""
        if node_fits(n, i.need(), 1) < 1:
            return None
        if not i.gpus:
            return ()
        need = i.need()
        ok = [(v[1], g) for g, v in n.gpus.items() if gpu_usable(v, need)]
        ok.sort()
        return tuple(g for _, g in ok[: len(i.gpus)])

    @staticmethod
    def take(n: _Node, i: Inst, gpus: Iterable[str]) -> None:
        n.cpu -= i.cpu
        n.mem -= i.memory
        for g in gpus:
            take_gpu(n.gpus[g], i.share, i.gpu_memory, bool(i.sharing))


def workload_of(spec: Iterable[Mapping[str, Any]] | None, pending: Iterable[Need], insts: Iterable[Inst]) -> Workload:
    """The input's ``workload`` when given, else the shapes of the pending blocks and the movable
    instances (each counted once per instance), normalised to weights that sum to 1."""
    shapes = [dict(s) for s in spec or () if isinstance(s, Mapping)]
    if not shapes:
        counts: dict[tuple[Any, ...], float] = {}
        for n in pending:
            key = (n.gpus, n.share, n.cpu, tuple(sorted(n.models)))
            counts[key] = counts.get(key, 0.0) + max(1, n.count)
        for i in insts:
            key = (len(i.gpus), 0.0 if i.share >= 1 - EPS else i.share, i.cpu, tuple(sorted(i.models)))
            counts[key] = counts.get(key, 0.0) + 1
        total = sum(counts.values()) or 1.0
        shapes = [{"gpus": g, "gpuShare": s, "cpu": c, "gpuModels": list(m), "weight": w / total}
                  for (g, s, c, m), w in sorted(counts.items())]
    return Workload(shapes)


def movable(input_data: Mapping[str, Any], ceiling: int | None) -> tuple[list[Inst], dict[str, int]]:
    """The instances that may move (see the rules) and each block's budget of moves."""
    out: list[Inst] = []
    budget: dict[str, int] = {}
    for c in input_data.get("movable") or ():
        if not _may_move(c, ceiling):
            continue
        bid = str(c["block_id"])
        left = max(1, int(c.get("maxMoving") or 1)) - int(c.get("moving") or 0)
        if left <= 0:  # its disruption budget is spent
            continue
        budget[bid] = left
        out.extend(_instances(c, bid))
    return out, budget


def _may_move(c: Mapping[str, Any], ceiling: int | None) -> bool:
    """Whether the block's instances may move at all: not ``preemptible: false``, and of priority
    ``ceiling`` or lower (a block is never moved for a lower one)."""
    if c.get("preemptible") is False:
        return False
    return ceiling is None or int(c.get("priority") or 0) <= ceiling


def _tier_of(i: Mapping[str, Any]) -> int | None:
    """The instance's GPU set's tier rank (None: not said, or not a tier)."""
    return TIER_RANK.get(LinkTier(i["tier"])) if i.get("tier") in LinkTier.__members__.values() else None


def _instances(c: Mapping[str, Any], bid: str) -> list[Inst]:
    """The block's instances (by instance id), as ``Inst``."""
    prio = int(c.get("priority") or 0)
    models = frozenset(c.get("gpuModels") or ())
    targets = None if c.get("targets") is None else frozenset(str(t) for t in c["targets"])
    prefer = _prefer_of(c)
    return [Inst(str(iid), bid, str(i.get("node_id")), tuple(i.get("gpus") or ()), share_of(i),
                 float(i.get("cpu") or 0.0), float(i.get("memory") or 0.0), prio,
                 float(i.get("created") or c.get("created") or 0.0), models, targets, _tier_of(i), prefer,
                 float(i.get("gpuMemory") or 0.0), None if i.get("gpuSharing") is None else bool(i["gpuSharing"]))
            for iid, i in sorted((c.get("instances") or {}).items())]


def _prefer_of(c: Mapping[str, Any]) -> dict[str, float] | None:
    """A block's ``prefer`` (node -> its affinity score), or None when not given."""
    got = c.get("prefer")
    return {str(k): float(v) for k, v in got.items()} if isinstance(got, Mapping) and got else None


def _free_room(c: Cluster, need: Need, src: str, insts: list[Inst], budget: Mapping[str, int], size: int, before: int,
               search: _Search | None = None, bound: tuple[Any, ...] | None = None,
               ) -> tuple[tuple[Any, ...], list[Move], dict[str, _Node]] | None:
    """The best ``size`` instances of node ``src`` whose moves make room for one more instance of
    ``need`` in the cluster (it takes ``before`` now), each sent where it fragments least: (rank,
    moves, the nodes after), or None. ``search``: the step's destinations and counts (made here
    when not given); ``bound``: the best plan's rank found so far (``plan_pending``'s, the
    source's room score first): a subset whose rank cannot be lower is not tried."""
    s = search or _Search(c, need, DestCache())
    o = s.source(c, need, src, insts)
    if size > len(o.order) or o.too_short(size):
        return None
    score = -c.room_score(src)
    best: tuple[tuple[Any, ...], list[Move], dict[str, _Node]] | None = None
    for subset in itertools.islice(itertools.combinations(o.order, size), SUBSETS):
        if o.never_fits(subset):
            continue  # freeing these alone makes no room on the source (below), known without a copy
        if not _within_budget(subset, budget):
            continue
        amount, prio = sum(i.gpu_amount for i in subset), max(i.priority for i in subset)
        if _loses((score, size, amount, prio), bound, best and best[0]):
            continue
        got = _try_subset(c, s, need, src, subset, before, (size, amount, prio))
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    return best


def _try_subset(c: Cluster, s: _Search, need: Need, src: str, subset: tuple[Inst, ...], before: int,
                head: tuple[int, float, int]) -> tuple[tuple[Any, ...], list[Move], dict[str, _Node]] | None:
    """``_free_room``'s one subset, on a copy of the source: (rank, moves, the nodes after) when
    moving it makes room for one more instance of ``need`` (the cluster takes ``before`` now) and
    the targets gain less fragmentation than the source loses, else None. ``head``: the rank's
    (size, GPU amount, priority)."""
    nodes = dict(c.nodes)
    src_node = nodes[src] = _copy(c.nodes[src])
    for i in subset:
        Cluster.release(src_node, i)
    if node_fits(src_node, need, 1) < 1 and s.counts.count(nodes, (src,)) <= before:
        return None  # freeing these alone makes no room: the source never takes one more
    src_saved = c.frag(src) - c.frag(src, src_node)
    placed = _send_away(s.dests, nodes, subset, src)
    if placed is None or s.counts.count(nodes, (src, *(m.to for m in placed[0]))) <= before:
        return None
    moves, cost = placed
    if cost > src_saved + EPS:  # the targets would gain more fragmentation than the source loses
        return None
    return (*head, cost - src_saved, tuple(sorted(i.iid for i in subset))), moves, nodes


class _Source:
    """A source of one planning step, as ``_free_room`` reads it at every size: its instances in
    the order their subsets are tried, whether ``size`` of them are too few (``_too_short``), and
    whether freeing a subset can make room on it at all."""

    def __init__(self, n: _Node, need: Need, insts: list[Inst]):
        _, cpu, mem = _short_of(n, need)

        def frees(i: Inst) -> float:  # of the CPU and memory the source is short of, what the instance frees
            return (min(1.0, i.cpu / cpu) if cpu > 0 else 0.0) + (min(1.0, i.memory / mem) if mem > 0 else 0.0)

        # smallest, then (where CPU or memory is short) the most of it first, lowest, youngest: the
        # subsets tried (at most SUBSETS per size) are the ones that free what blocks the pending block
        self.order = sorted(insts, key=lambda i: (i.gpu_amount, -frees(i), i.priority, -i.created, i.iid))
        self.n, self.need, self.cpu_short, self.mem_short = n, need, cpu, mem
        self.gpus_short = _shortfall(n, need)
        # the most ``size`` instances free (``_too_short``'s sums, in its order: the same floats)
        self.most = [list(itertools.accumulate(sorted(xs, reverse=True)))
                     for xs in ([len(i.gpus) for i in self.order], [i.cpu for i in self.order],
                                [i.memory for i in self.order])]
        # a whole-GPU need: the GPUs of its models free on the source; released ones add at most theirs
        self.whole = need.gpus > 0 and not need.sharing
        self.free = need.gpus - self.gpus_short if self.whole and self.gpus_short != float("inf") else 0

    def too_short(self, size: int) -> bool:
        """``_too_short(n, need, order, size)``."""
        g, c, m = (most[size - 1] for most in self.most)
        return g < self.gpus_short or c < self.cpu_short - EPS or m < self.mem_short - EPS

    def never_fits(self, subset: tuple[Inst, ...]) -> bool:
        """Whether the source, these released, surely takes no instance of the need: fewer whole
        GPUs free than it asks (each instance frees at most its own), or clearly too little CPU
        or memory (a margin over the float sums ``Cluster.release`` makes)."""
        if self.whole and self.free + sum(len(i.gpus) for i in subset) < self.need.gpus:
            return True
        n, need = self.n, self.need
        return (need.cpu > 0 and n.cpu + sum(i.cpu for i in subset) < need.cpu * (1 - EPS) - 1e-6) or \
            (need.memory > 0 and n.mem + sum(i.memory for i in subset) < need.memory * (1 - EPS) - 1e-6)


class _Search:
    """What one planning step of ``plan_pending`` shares over its sources and subsets: the
    destinations (``_Dests``), the pending block's count (``_Counts``) on the step's nodes, and
    each source's order (``_Source``, made once for all sizes)."""

    def __init__(self, c: Cluster, need: Need, entries: DestCache):
        self.dests = _Dests(c, c.nodes, entries)
        self.counts = _Counts(c.nodes, c.room, need)
        self.sources: dict[str, _Source] = {}

    def source(self, c: Cluster, need: Need, src: str, insts: list[Inst]) -> _Source:
        got = self.sources.get(src)
        if got is None or got.n is not c.nodes[src]:
            got = self.sources[src] = _Source(c.nodes[src], need, insts)
        return got


def _loses(head: tuple[Any, ...], bound: tuple[Any, ...] | None, own: tuple[Any, ...] | None) -> bool:
    """Whether a subset whose rank begins ``head`` (room score, size, GPUs moved, priority: known
    before any destination) loses to the best plan so far (``bound``, with the room score) or to
    its source's best (``own``, without): then it cannot win on the rest of the rank."""
    return (bound is not None and head > bound[:4]) or (own is not None and head[1:] > own[:3])


def _too_short(n: _Node, need: Need, order: list[Inst], size: int) -> bool:
    """Whether source ``n`` is further short of one instance of ``need`` than its ``size``
    largest instances can free, in GPUs (an instance turns at most its own GPUs into free ones),
    CPU or memory (at most its own): then no subset of that size is any use."""
    def most(xs: Iterable[float]) -> float:
        return sum(sorted(xs, reverse=True)[:size])

    _, cpu, mem = _short_of(n, need)
    return (most(len(i.gpus) for i in order) < _shortfall(n, need) or most(i.cpu for i in order) < cpu - EPS
            or most(i.memory for i in order) < mem - EPS)


def _within_budget(subset: Iterable[Inst], budget: Mapping[str, int]) -> bool:
    """Whether moving all of ``subset`` keeps each block within its budget of moves."""
    per_block: dict[str, int] = {}
    for i in subset:
        per_block[i.bid] = per_block.get(i.bid, 0) + 1
    return not any(k > budget.get(b, 0) for b, k in per_block.items())


def _send_away(dests: _Dests, nodes: dict[str, _Node], subset: tuple[Inst, ...], src: str,
               ) -> tuple[list[Move], float] | None:
    """Send each instance of ``subset`` in turn where it fragments least (never back to ``src``),
    taking its room in ``nodes`` (``dests.base`` with ``src`` changed; copied node by node, in
    place of the dict's entries): (the moves, their total fragmentation cost), or None when one
    fits nowhere."""
    moves: list[Move] = []
    cost = 0.0
    for i in subset:
        dest = dests.find(nodes, i, {src}, (m.to for m in moves))
        if dest is None:
            return None
        nid, gpus, d = dest
        n = nodes[nid] = _copy(nodes[nid])
        Cluster.take(n, i, gpus)
        moves.append(Move(i, nid, gpus, d))
        cost += d
    return moves, cost


def _short_of(n: _Node, need: Need) -> tuple[float, float, float]:
    """What the node is short of one instance of ``need``: (GPUs (``_shortfall``), CPU, memory)."""
    return _shortfall(n, need), max(0.0, need.cpu - n.cpu), max(0.0, need.memory - n.mem)


def _source_key(n: _Node, need: Need) -> tuple[float, float]:
    """How far a source is from holding one instance of ``need``, for ordering them (the closest
    first): the GPUs it is short of, then its CPU and memory shortfalls as fractions of the need
    (a node with the GPUs free but its CPU or memory taken is a source too: moving a CPU-heavy
    instance off it frees what blocks the pending one)."""
    gpus, cpu, mem = _short_of(n, need)
    return gpus, (cpu / need.cpu if need.cpu > 0 else 0.0) + (mem / need.memory if need.memory > 0 else 0.0)


def _shortfall(n: _Node, need: Need) -> float:
    """How many GPUs the node is short of one instance of ``need`` (its GPUs ``gpu_usable`` now
    against what it needs; infinite when too few are of an allowed model and memory), for
    ordering the sources: the closest first."""
    usable = [v for v in n.gpus.values() if (not need.models or v[0] in need.models) and v[3] >= need.gpu_memory]
    if len(usable) < need.gpus:
        return float("inf")
    return max(0, need.gpus - usable_count(usable, need))


def _sources(c: Cluster, need: Need, on: Mapping[str, list[Inst]]) -> list[str]:
    """The source nodes a step searches, the most preferred then the closest to holding one
    instance of ``need`` first (``SOURCES`` of them, less those that never can)."""
    sources = sorted((nid for nid in on if nid in c.nodes and (c.room is None or nid in c.room)),
                     key=lambda nid: (-c.room_score(nid), *_source_key(c.nodes[nid], need), nid))
    return [nid for nid in sources[:SOURCES] if _shortfall(c.nodes[nid], need) != float("inf")]


_Step = tuple[tuple[Any, ...], list[Move], dict[str, _Node]]


def _best_step(c: Cluster, need: Need, on: Mapping[str, list[Inst]], budget: Mapping[str, int], left: int,
               search: _Search) -> _Step | None:
    """The best room for one more instance of ``need``: of the fewest moves (at most ``left``),
    on its most preferred node, then ``_free_room``'s rank: (rank, moves, the nodes after)."""
    before = _count(_on(c.nodes, c.room), need)
    sources = _sources(c, need, on)
    best: _Step | None = None
    for size in range(1, left + 1):  # the fewest moves anywhere first
        for src in sources:
            if best is not None and -c.room_score(src) > best[0][0]:
                break  # the sources are in that order: none after this one can win
            found = _free_room(c, need, src, on[src], budget, size, before, search, best and best[0])
            if found is None:
                continue
            rank = (-c.room_score(src), *found[0])  # of as few moves, room on its most preferred node
            if best is None or rank < best[0]:
                best = (rank, found[1], found[2])
        if best is not None:
            return best
    return None


def plan_pending(c: Cluster, need: Need, insts: list[Inst], budget: dict[str, int], max_moves: int,
                 entries: DestCache | None = None) -> tuple[list[Move], str] | None:
    """The moves (at most ``max_moves``) after which the whole gang fits, or None (``entries``:
    the destinations' cache, kept across plans by a ``Prepared``; else the plan's own)."""
    moves: list[Move] = []
    where = {i.iid: i for i in insts}
    budget = dict(budget)
    entries = DestCache() if entries is None else entries  # the destinations' cache over the steps
    while not _placement(_on(c.nodes, c.room), need):
        left = max_moves - len(moves)
        if left <= 0:
            return None
        on: dict[str, list[Inst]] = {}
        for i in where.values():
            on.setdefault(i.node, []).append(i)
        best = _best_step(c, need, on, budget, left, _Search(c, need, entries))
        if best is None:
            return None
        _, step, c.nodes = best
        for m in step:
            del where[m.inst.iid]
            budget[m.inst.bid] -= 1
            moves.append(m)
    return moves, ""


def plan_fragmentation(c: Cluster, insts: list[Inst], budget: dict[str, int], max_moves: int,
                       entries: DestCache | None = None) -> list[Move]:
    """Greedy: the move that lowers the cluster's fragmentation most per GPU moved, while one does."""
    moves: list[Move] = []
    where = {i.iid: i for i in insts}
    budget = dict(budget)
    entries = DestCache() if entries is None else entries
    while len(moves) < max_moves:
        dests = _Dests(c, c.nodes, entries)
        best: tuple[tuple[Any, ...], Move, _Node, _Node] | None = None
        for i in where.values():
            if budget.get(i.bid, 0) <= 0 or i.node not in c.nodes or not i.gpus:
                continue
            src = _copy(c.nodes[i.node])
            Cluster.release(src, i)
            saved = c.frag(i.node) - c.frag(i.node, src)
            dest = dests.find(c.nodes, i, {i.node})
            if dest is None:
                continue
            nid, gpus, cost = dest
            gain = saved - cost
            if gain <= EPS:
                continue
            rank = (-gain / max(i.gpu_amount, EPS), i.gpu_amount, i.priority, i.iid)
            if best is None or rank < best[0]:
                after = _copy(c.nodes[nid])
                Cluster.take(after, i, gpus)
                best = (rank, Move(i, nid, gpus, cost - saved), src, after)
        if best is None:
            break
        _, m, src, after = best
        c.nodes = {**c.nodes, m.inst.node: src, m.to: after}
        del where[m.inst.iid]
        budget[m.inst.bid] -= 1
        moves.append(m)
    return moves


def _reason_pending(m: Move, bid: str, src_free: int, after_free: int) -> str:
    gpu_mem = m.inst.gpu_memory if m.inst.sharing else 0.0  # an exclusive one frees its GPUs whole
    also = "".join(f", {v:g} {unit}" for v, unit in ((m.inst.cpu, "CPU"), (m.inst.memory, "MiB of memory"),
                                                      (gpu_mem, "MiB of each GPU's memory")) if v > 0)
    return (f"makes room for pending {bid}: frees {m.inst.gpu_amount:g} GPU(s){also} on {m.inst.node} "
            f"({src_free} -> {after_free} whole GPUs free), fragments least on {m.to}")


def _whole_free(n: _Node) -> int:
    return sum(1 for v in n.gpus.values() if v[1] >= 1 - EPS)


def _output(moves: list[Move], start: Mapping[str, _Node], c: Cluster, frag_before: float, reason: str,
            pending: str = "", fits: dict[str, int] | None = None) -> dict[str, Any]:
    out = []
    for m in moves:
        if pending:
            m = replace(m, reason=_reason_pending(m, pending, _whole_free(start[m.inst.node]),
                                                  _whole_free(c.nodes[m.inst.node])))
        elif not m.reason:
            m = replace(m, reason=(f"fragmentation: moving {m.inst.gpu_amount:g} GPU(s) from {m.inst.node} to {m.to} "
                                   f"lowers it by {-m.frag_delta:.1f} thousandths of a GPU"))
        out.append(m.as_dict(m.inst.gpu_amount))
    return {"moves": out, "for": pending, "fits": fits or {},
            "fragmentation": {"before": round(frag_before, 3), "after": round(c.total(), 3)}, "reason": reason}


@dataclass(frozen=True)
class _Parsed:
    """The input as the planner reads it: the nodes (never changed: each plan copies them), the
    workload, the fragmentation cache, the nodes' topology, and the movable instances (and
    budgets) under a priority ceiling."""

    nodes: dict[str, _Node]
    wl: Workload
    frags: Mapping[str, tuple[_Node, float]]
    topology: dict[str, Mapping[str, Any]]
    movable_of: Callable[[int | None], tuple[list[Inst], dict[str, int]]]
    #: the destinations' cache kept across plans (``Prepared.dest_cache``), or None (each plan its own)
    entries: DestCache | None = None

    def cluster(self) -> Cluster:
        """A fresh cluster to plan on (its own node map)."""
        return Cluster(dict(self.nodes), self.wl, self.frags, self.topology)


def _parse(input_data: Mapping[str, Any], needs: list[Need], prepared: Prepared | None) -> _Parsed:
    """The input parsed, or taken from ``prepared`` (see ``Prepared``)."""
    frags: Mapping[str, tuple[_Node, float]] = {}
    movable_of: Callable[[int | None], tuple[list[Inst], dict[str, int]]]
    if prepared is not None:
        nodes, wl, frags, movable_of = prepared.nodes, prepared.wl, prepared.frags, prepared.movable
    else:
        nodes = _nodes(input_data.get("cluster") or {})
        insts_all, _ = movable(input_data, None)
        wl = workload_of(input_data.get("workload"), needs, insts_all)
        movable_of = functools.partial(movable, input_data)
    topology = {str(k): v for k, v in (input_data.get("topology") or {}).items() if isinstance(v, Mapping)}
    entries = getattr(prepared, "dest_cache", None)
    return _Parsed(nodes, wl, frags, topology, movable_of, entries if isinstance(entries, DestCache) else None)


def _try_pending(src: _Parsed, p: Mapping[str, Any], need: Need, k: int, before: float,
                 ) -> tuple[Cluster | None, dict[str, Any] | str]:
    """Plan the moves that make room for pending block ``p``: (the cluster planned on, None when
    it fits without moves; the output when its moves are taken, else why they are not)."""
    bid = str(p.get("block_id") or "")
    room = None if p.get("targets") is None else frozenset(str(t) for t in p["targets"])
    if _placement(_on(src.nodes, room), need):
        return None, f"{bid} fits without moves"
    insts, budget = src.movable_of(int(p.get("priority") or 0))
    c = src.cluster()
    c.room, c.prefer = room, _prefer_of(p) or {}
    found = plan_pending(c, need, insts, budget, k, src.entries)
    if found is None:
        return c, f"{bid} does not fit after {k} move(s) or fewer"
    moves, _ = found
    if c.total() > before + EPS:
        return c, f"{bid}: the moves that make its room would raise the cluster's fragmentation"
    return c, _output(moves, src.nodes, c, before, f"{len(moves)} move(s) make room for pending {bid}", bid,
                      _placement(_on(c.nodes, room), need))


def plan(input_data: Mapping[str, Any], max_moves: int | None = None, prepared: Prepared | None = None) -> dict[str, Any]:
    """The moves of one rebalance (see the module's docstring). ``prepared``: the input's nodes,
    instances and workload already parsed (``Prepared``; the same answer, without the parsing)."""
    k = int(input_data.get("maxMoves", DEFAULT_MAX_MOVES) if max_moves is None else max_moves)
    pending = [p for p in input_data.get("pending") or () if isinstance(p, Mapping)]
    needs = [need_of(p) for p in pending]
    src = _parse(input_data, needs, prepared)
    c = Cluster(src.nodes, src.wl, src.frags, src.topology)
    before = c.total()
    if k <= 0:
        return _output([], src.nodes, c, before, "maxMoves is 0: no move")
    why = []
    for p, need in zip(pending, needs, strict=True):
        planned, got = _try_pending(src, p, need, k, before)
        c = planned or c  # a refused plan's cluster is what the output below measures (as before)
        if isinstance(got, dict):
            return got
        why.append(got)
    if pending and str(input_data.get("trigger") or "") == "pending":
        return _output([], src.nodes, c, before, "; ".join(why) or "no pending block")
    insts, budget = src.movable_of(None)
    c = src.cluster()
    moves = plan_fragmentation(c, insts, budget, k, src.entries)
    reason = (f"{len(moves)} move(s) lower the fragmentation from {before:.1f} to {c.total():.1f}" if moves
              else "no move lowers the cluster's fragmentation")
    return _output(moves, src.nodes, c, before, "; ".join([*why, reason]))


class RebalanceMinPolicy:
    """The seed-000 class shape: ``eval(parameters, input, context)``."""

    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        self.rule_id, self.settings, self.parameters = rule_id, settings or {}, parameters or {}

    def eval(self, parameters: dict[str, Any], input_data: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        return plan(input_data)
