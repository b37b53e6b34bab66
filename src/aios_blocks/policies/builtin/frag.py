"""The GPU-sharing baselines of "Beware of Fragmentation" (Weng et al., USENIX ATC '23) as built-in
resourceAllocators: ``builtin:random``, ``builtin:dot-product``, ``builtin:gpu-packing``,
``builtin:gpu-clustering``, ``builtin:best-fit`` and ``builtin:fgd``. Written from the paper's
definitions (docs/trace.md "Policies"); the seed's policy shape, like ``builtin:binpack``.

Every policy keeps the feasibility of the built-ins (``capacity.node_fits``: CPU, memory, GPUs
free, ``gpuShare`` and ``gpuModels``) and differs only in which feasible node and GPU it picks.
A GPU's free compute is its ``share_free`` thousandths (0 when held whole). Scores are "lower is
better"; equal scores are broken by a hash of the node id with ``parameters.seed`` (the replay's
seed): a fixed random order of the nodes per seed (kube-scheduler draws among equal nodes per
pod), so an inventory view keeps the fitting nodes sorted by it (``capacity.best_fit``).
``parameters.quantize`` (``builtin:dot-product`` and ``builtin:fgd``: true by default) ranks by
the FGD artifact's integer scores (0-100) instead, equal ones in the same seeded order;
``parameters.drawTies`` (with it) draws among the nodes with the top one per block, as
kube-scheduler does: every fitting node scored, no per-shape order (measured, not the default).

FGD needs the target workload: ``parameters.workload``, a list of task shapes
``{"cpu", "gpus", "gpuShare", "gpuModels", "weight"}`` (``blocks trace replay`` passes the trace's
most popular shapes). A node's fragmentation with respect to that workload is the GPU compute
(thousandths) a task drawn from it could not use there, summed with the tasks' weights: all of
the node's free compute when the task does not fit (CPU short, too few GPUs with enough free,
a model it may not use, or a CPU-only task), else the free compute of the GPUs each too small
for it. FGD places where that measure grows least.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from ...schemas.records import GpuView, Needs, NodeView
from .. import capacity
from .resource import _ResourceAllocator

UNITS = capacity.SHARE_UNITS


def gpu_left(node: NodeView) -> tuple[int, ...]:
    """Each GPU's free compute in thousandths (0 when held whole), in the node's GPU order."""
    return tuple(0 if g["exclusive"] else int(g.get("share_free", UNITS)) for g in node["gpus"])


def node_model(node: NodeView) -> str:
    gpus = node["gpus"]
    return str(gpus[0].get("model", "")) if gpus else ""


def request_units(needs: capacity.Needs, share: bool) -> int:
    """Thousandths of each of its GPUs an instance takes: its ``gpuShare`` when it shares, else
    the whole GPU (0 for a CPU-only instance)."""
    if not needs.get("gpus"):
        return 0
    units = capacity.share_units(needs) if share else 0
    return units if 0 < units < UNITS else UNITS


class Workload:
    """A target workload compiled for :meth:`frag`: shapes grouped by their GPU part, each group's
    weights cumulated by CPU so "the node has the CPU" is one bisection."""

    def __init__(self, shapes: list[dict[str, Any]]):
        groups: dict[tuple[int, int, tuple[str, ...]], list[tuple[float, float]]] = {}
        cpu_only: list[float] = []
        total = 0.0
        for s in shapes:
            weight = float(s.get("weight", 0) or 0)
            if weight <= 0:
                continue
            total += weight
            gpus = int(s.get("gpus", 0) or 0)
            if not gpus:
                cpu_only.append(weight)
                continue
            share = round(float(s.get("gpuShare") or 0) * UNITS)
            units = share if 0 < share < UNITS else UNITS
            key = (gpus, units, tuple(sorted(s.get("gpuModels") or ())))
            groups.setdefault(key, []).append((float(s.get("cpu", 0) or 0), weight))
        #: the weight of CPU-only tasks (for them all free GPU compute is fragment)
        self.cpu_only = sum(cpu_only)
        #: (gpus, units, allowed models, CPU figures sorted, weights cumulated in that order, total)
        self.groups: list[tuple[int, int, frozenset[str], list[float], list[float], float]] = []
        for (gpus, units, models), items in sorted(groups.items()):
            items.sort()
            cum, acc = [], 0.0
            for _, w in items:
                acc += w
                cum.append(acc)
            self.groups.append((gpus, units, frozenset(models), [c for c, _ in items], cum, acc))
        self.total = total
        self.cpus = sorted({c for g in self.groups for c in g[3]})
        self._memo: dict[tuple[Any, ...], float] = {}

    def frag(self, model: str, cpu_free: float, left: tuple[int, ...]) -> float:
        """The node's expected unusable GPU compute (thousandths) for a task of this workload."""
        free = sum(left)
        if not free:
            return 0.0
        # only the CPU thresholds of the shapes matter: nodes between two of them share a figure
        level = bisect.bisect_right(self.cpus, cpu_free + 1e-9)
        key = (model, level, tuple(sorted(left)))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        out = self.cpu_only * free
        for gpus, units, models, cpus, cum, weight in self.groups:
            if models and model not in models:
                out += weight * free
                continue
            fitting = sum(1 for x in left if x >= units)
            if fitting < gpus:
                out += weight * free
                continue
            n = bisect.bisect_right(cpus, cpu_free + 1e-9)  # the shapes whose CPU the node has
            ok = cum[n - 1] if n else 0.0
            small = sum(x for x in left if x < units)
            out += ok * small + (weight - ok) * free
        if len(self._memo) > 500_000:
            self._memo.clear()
        self._memo[key] = out
        return out


def workload_of(parameters: dict[str, Any]) -> Workload | None:
    shapes = parameters.get("workload")
    if not isinstance(shapes, list) or not shapes:
        return None
    return Workload([s for s in shapes if isinstance(s, dict)])


class _FragBase(_ResourceAllocator):
    """Feasibility as the built-ins, then the lowest ``_score`` (ties: a seeded hash of the id)."""

    mode = "frag"
    #: rank an inventory view's nodes by their state's score, each distinct state scored once per
    #: shape (``capacity.best_fit``'s ``by_state``); off: each node scored (the tests' slow path)
    rank_by_state = True
    #: ``parameters.quantize``'s default (only the policies with a :meth:`_integer` score read it)
    quantize_default = False

    def __init__(self, rule_id: str, settings: dict[str, Any], parameters: dict[str, Any]):
        super().__init__(rule_id, settings, parameters)
        self.seed = str(self.parameters.get("seed", ""))
        self.workload = workload_of(self.parameters)
        # what the per-view score memo is keyed by besides the shape: the same views scored for
        # another workload or seed are other figures
        self.key = (self.mode, self.seed, zlib.crc32(repr(self.parameters.get("workload")).encode()))
        self._ties: dict[str, tuple[int, str]] = {}
        #: rank by the artifact's integer score (0-100, higher better); equal ones in the seeded
        #: order of the node ids (the index's), or with ``drawTies`` drawn per block
        self.quantize = bool(self.parameters.get("quantize", self.quantize_default)) \
            and type(self)._integer is not _FragBase._integer
        self.draw_ties = self.quantize and bool(self.parameters.get("drawTies", False))

    def _integer(self, score: Any) -> int:
        """The artifact's integer node score (0-100, higher is better) for an exact ``_score``."""
        raise NotImplementedError

    def _pick(
        self, nodes: dict[str, Any], healthy: set[str], needs: Needs, avoid: set[str], seed: str
    ) -> tuple[str, list[str]] | None:
        count = int(needs.get("gpus", 0))
        share = self.share
        units = request_units(needs, share)
        fits_key = ("fits", *capacity.shape(needs, share))
        score_key = ("score", *self.key, fits_key)

        def fits(n: NodeView) -> list[GpuView] | None:
            return capacity.node_fits(n, needs, share)

        def score(n: NodeView) -> tuple[Any, list[str]]:
            usable = capacity.derived(n, fits_key, fits)
            return self._score(n, usable, needs, units, count)

        if self.draw_ties:
            return self._pick_integer(nodes, healthy, needs, avoid, seed, fits_key, fits, score_key, score)
        rank_key: tuple[Any, ...] = ("rank", *self.key, fits_key)
        tie = self._tie
        if self.quantize:  # the artifact's integer score, higher better: ranked by its negation
            integer = self._integer
            rank_key = (*rank_key, "integer")

            def state_score(n: NodeView) -> Any:
                return -integer(capacity.derived(n, score_key, score)[0])
        else:
            def state_score(n: NodeView) -> Any:
                return capacity.derived(n, score_key, score)[0]

        def rank(n: NodeView) -> tuple[Any, ...]:
            return (state_score(n), *tie(str(n["node_id"])))

        if "affinity" not in next(iter(nodes.values()), {}):
            # no affinity annotations (a view is annotated with all the others or not at all): the
            # lowest (score, seeded hash of the id) among the fitting nodes, which an inventory
            # view keeps in order per shape (``capacity.best_fit``), caught up in O(changes); a
            # score reads only the node's state, so the index scores each distinct state once
            skip = capacity.unhealthy(nodes, healthy) | avoid
            by_state = (state_score, tie) if self.rank_by_state else None
            found = capacity.best_fit(nodes, skip, fits_key, fits, rank_key, rank, count, by_state)
            if found is None:
                return None
            return found[0], capacity.derived(nodes[found[0]], score_key, score)[1]
        # annotated views (per-call copies): Required affinity filters, the same order picks
        best: tuple[Any, str] | None = None
        for nid in _fitting(nodes, _passing(nodes, healthy, avoid), fits_key, fits, count):
            r = rank(nodes[nid])
            if best is None or r < best[0]:
                best = (r, nid)
        if best is None:
            return None
        return best[1], capacity.derived(nodes[best[1]], score_key, score)[1]

    def _pick_integer(self, nodes: dict[str, Any], healthy: set[str], needs: Needs, avoid: set[str],
                      seed: str, fits_key: Any, fits: Any, score_key: Any,
                      score: Any) -> tuple[str, list[str]] | None:
        """``drawTies``: the highest integer score among the fitting nodes, equal ones drawn at
        random per block as kube-scheduler does (a hash of the replay's seed, the block's tie seed
        and the node id: the same in --live and --in-process). Every fitting node is scored (its
        exact score memoised per view); the per-shape index is not used, its order is per seed.
        Measured, not the default: FGD on default seed 42 reaches 90.32 % this way."""
        count = int(needs.get("gpus", 0))
        if "affinity" not in next(iter(nodes.values()), {}):
            ids: Any = capacity.fit_index(nodes, needs, self.share).ids & healthy - avoid
        else:
            ids = _passing(nodes, healthy, avoid)
        top, tied = -1, []
        for nid in _fitting(nodes, ids, fits_key, fits, count):
            q = self._integer(capacity.derived(nodes[nid], score_key, score)[0])
            if q > top:
                top, tied = q, [nid]
            elif q == top:
                tied.append(nid)
        if not tied:
            return None
        pre = f"{self.seed}:{seed}:"
        nid = min(tied, key=lambda i: (zlib.crc32((pre + i).encode()), i))
        return nid, capacity.derived(nodes[nid], score_key, score)[1]

    def _tie(self, nid: str) -> tuple[int, str]:
        """What breaks equal scores: a hash of the node id with the seed, then the id (kept per id)."""
        hit = self._ties.get(nid)
        if hit is None:
            if len(self._ties) >= 100_000:
                self._ties.clear()
            hit = self._ties[nid] = (zlib.crc32(f"{self.seed}:{nid}".encode()), nid)
        return hit

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        """The node's score for one instance (lower is better; it must read nothing of the view
        but its ``capacity.node_state``) and the GPUs it would take."""
        raise NotImplementedError

    # -- shared helpers ----------------------------------------------------------------------
    @staticmethod
    def _best_fit_gpus(usable: list[GpuView], units: int, count: int) -> list[str]:
        """The GPUs with the least free compute that still fit (whole GPUs: the first free ones)."""
        if units >= UNITS:
            return [g["id"] for g in usable[:count]]
        ranked = sorted(usable, key=lambda g: (0 if g["exclusive"] else g.get("share_free", UNITS), g["id"]))
        return [g["id"] for g in ranked[:count]]


class RandomFitPolicy(_FragBase):
    """Any feasible node, at random (seeded per block), and any of its fitting GPUs."""

    mode = "random"

    def _pick(
        self, nodes: dict[str, Any], healthy: set[str], needs: Needs, avoid: set[str], seed: str
    ) -> tuple[str, list[str]] | None:
        count = int(needs.get("gpus", 0))
        share = self.share
        fits_key = ("fits", *capacity.shape(needs, share))

        def fits(n: NodeView) -> list[GpuView] | None:
            return capacity.node_fits(n, needs, share)

        if "affinity" not in next(iter(nodes.values()), {}):
            # the fitting nodes from the capacity index (kept per shape), in id order
            ids = sorted(capacity.fit_index(nodes, needs, share).ids & healthy - avoid)
            feasible = [(nid, capacity.derived(nodes[nid], fits_key, fits)) for nid in ids]
        else:
            feasible = []
            for nid, node in nodes.items():
                if nid in healthy and nid not in avoid and (node.get("affinity") or {}).get("pass", True):
                    feasible.append((nid, capacity.derived(node, fits_key, fits)))
        feasible = [(nid, u) for nid, u in feasible if u is not None and len(u) >= count]
        if not feasible:
            return None
        h = zlib.crc32(f"{self.seed}:{seed}".encode())
        nid, usable = feasible[h % len(feasible)]
        off = (h // max(len(feasible), 1)) % max(len(usable), 1)
        ring = usable[off:] + usable[:off]
        return nid, [g["id"] for g in ring[:count]]


class DotProductPolicy(_FragBase):
    """Tetris-style alignment, as the paper's baseline: the lowest dot product of the node's free
    (CPU, GPU compute) with the request, both over the largest node's capacity; best-fit GPUs."""

    mode = "dot-product"
    #: the artifact's integer scores by default (docs/trace.md "Fidelity: where the artifact differs")
    quantize_default = True

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        cpu_max, gpu_max = 128.0, 8 * UNITS
        gpu_free = sum(gpu_left(node))
        dot = (node["cpu_free"] / cpu_max) * (float(needs.get("cpu", 0)) / cpu_max) \
            + (gpu_free / gpu_max) * (units * count / gpu_max)
        return round(dot, 12), self._best_fit_gpus(usable, units, count)

    def _integer(self, score: Any) -> int:
        """The artifact's DotProd: ``int(100 x (1 - dot / 2))`` (its dot is over two dimensions)."""
        return int(100 * (1 - float(score) / 2))


class BestFitPolicy(_FragBase):
    """The node left with the least free CPU and GPU compute (equal weights, over the largest
    node's capacity); best-fit GPUs."""

    mode = "best-fit"

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        cpu_max, gpu_max = 128.0, 8 * UNITS
        left = 0.5 * (node["cpu_free"] - float(needs.get("cpu", 0))) / cpu_max \
            + 0.5 * (sum(gpu_left(node)) - units * count) / gpu_max
        return round(left, 12), self._best_fit_gpus(usable, units, count)


class GpuPackingPolicy(_FragBase):
    """Pack GPU tasks onto GPUs already in use: first the nodes where it fits on partly used GPUs
    (the least free compute on them first), then partly used nodes where it needs idle GPUs
    (fewest first), then idle nodes (the smallest first). CPU-only tasks: any node."""

    mode = "gpu-packing"

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        if not count:
            return (0,), []
        left = gpu_left(node)
        whole = sum(1 for x in left if x == UNITS)
        if whole == len(left):  # an idle node
            return (2, whole), self._best_fit_gpus(usable, units, count)
        ranked = sorted(usable, key=lambda g: (0 if g["exclusive"] else g.get("share_free", UNITS), g["id"]))[:count]
        idle_used = sum(1 for g in ranked if g.get("share_free", UNITS) == UNITS and not g["exclusive"])
        if idle_used:
            return (1, idle_used), [g["id"] for g in ranked]
        return (0, sum(g.get("share_free", UNITS) for g in ranked)), [g["id"] for g in ranked]


class GpuClusteringPolicy(_FragBase):
    """Keep tasks of one kind together: nodes holding only tasks of the same kind (whole-GPU or
    GPU-sharing) first, then nodes holding both, then idle nodes, then nodes holding only the
    other kind; within a tier the node with the least free GPU compute. The kind of a node's
    tasks is read from its GPUs (held whole or shared): node views carry no task list."""

    mode = "gpu-clustering"

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        gpus = self._best_fit_gpus(usable, units, count)
        if not count:
            return (0, 0), gpus
        kinds = set()
        for g in node["gpus"]:
            if g["exclusive"]:
                kinds.add("whole")
            elif g.get("instances", 0):
                kinds.add("share")
        mine = "whole" if units >= UNITS else "share"
        tier = 0 if kinds == {mine} else 1 if mine in kinds else 2 if not kinds else 3
        return (tier, sum(gpu_left(node))), gpus


class FgdPolicy(_FragBase):
    """Fragmentation gradient descent: the node and GPUs where the node's fragmentation with
    respect to the target workload (``parameters.workload``) grows least."""

    mode = "fgd"
    #: the artifact's integer scores by default (docs/trace.md "Fidelity: where the artifact differs")
    quantize_default = True

    def _score(self, node: NodeView, usable: list[GpuView], needs: Needs, units: int,
               count: int) -> tuple[Any, list[str]]:
        wl = self.workload or Workload([{"cpu": needs.get("cpu", 0), "gpus": count or 0,
                                         "gpuShare": units / UNITS if units < UNITS else 0, "weight": 1}])
        model, cpu = node_model(node), float(node["cpu_free"])
        left: tuple[int, ...] = capacity.derived(node, "gpu_left", gpu_left)
        before = wl.frag(model, cpu, left)
        after_cpu = cpu - float(needs.get("cpu", 0))
        if not count:
            return round(wl.frag(model, after_cpu, left) - before, 9), []
        if units < UNITS:  # one shared GPU: the one whose use fragments least
            best: tuple[float, str] | None = None
            for g, _free, shared in share_options(usable, left, units):
                d = wl.frag(model, after_cpu, shared) - before
                if best is None or d < best[0] - 1e-9:
                    best = (d, g["id"])
            assert best is not None
            return round(best[0], 9), [best[1]]
        chosen = [g["id"] for g in usable[:count]]
        after = list(left)
        for _ in chosen:  # whole GPUs: idle ones, all alike
            after[after.index(UNITS)] = 0
        return round(wl.frag(model, after_cpu, tuple(after)) - before, 9), chosen

    def _integer(self, score: Any) -> int:
        """The artifact's FGD: ``int(100 x sigmoid((before - after) / 1000))`` for the growth
        ``after - before`` of the node's fragmentation (thousandths of a GPU)."""
        return fgd_integer(float(score))


def _passing(nodes: dict[str, Any], healthy: set[str], avoid: set[str]) -> list[str]:
    """An annotated view's healthy nodes, not avoided, that its Required affinity lets through."""
    return [nid for nid, n in nodes.items() if nid in healthy and nid not in avoid and n["affinity"].get("pass", True)]


def _fitting(nodes: dict[str, Any], ids: Iterable[str], fits_key: Any, fits: Any, count: int) -> Iterator[str]:
    """Those of ``ids`` whose usable GPUs for the shape (``capacity.derived``) are ``count`` at least."""
    for nid in ids:
        usable = capacity.derived(nodes[nid], fits_key, fits)
        if usable is not None and len(usable) >= count:
            yield nid


def fgd_integer(growth: float) -> int:
    """``int(100 x sigmoid(-growth / 1000))``: 50 when the fragmentation is unchanged, towards 100
    as it shrinks, towards 0 as it grows."""
    x = -growth / 1000
    sig = 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))
    return int(100 * sig)


def share_options(usable: list[GpuView], left: tuple[int, ...],
                  units: int) -> Iterator[tuple[GpuView, int, tuple[int, ...]]]:
    """Where one share of ``units`` may go on a node: for each free amount among ``usable``, its
    first GPU (GPUs with as much free compute are alike), that amount, and the node's free
    compute per GPU (``left``) once the share took it."""
    seen: set[int] = set()
    for g in usable:
        free = 0 if g["exclusive"] else int(g.get("share_free", UNITS))
        if free in seen:
            continue
        seen.add(free)
        after = list(left)
        after[after.index(free)] -= units
        yield g, free, tuple(after)

POLICIES: dict[str, type[_ResourceAllocator]] = {
    "builtin:random": RandomFitPolicy,
    "builtin:dot-product": DotProductPolicy,
    "builtin:gpu-packing": GpuPackingPolicy,
    "builtin:gpu-clustering": GpuClusteringPolicy,
    "builtin:best-fit": BestFitPolicy,
    "builtin:fgd": FgdPolicy,
}
